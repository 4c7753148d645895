#include "server/listening_server.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "core/log.h"
#include "server/http_server.h"

namespace kiln::server {

namespace {

// One request as httplib's request processing reads it: from the bytes the gate buffered (never from the socket,
// so a worker never waits for the client); answers go to the socket, each write within the write timeout.
class BufferedRequestStream : public httplib::Stream {
 public:
  BufferedRequestStream(const GateConnection& c, int write_timeout_s)
      : c_(c), write_ms_(write_timeout_s * 1000) {}

  bool is_readable() const override { return off_ < c_.request_bytes; }
  bool is_writable() const override { return ready(POLLOUT, write_ms_); }

  ssize_t read(char* ptr, size_t size) override {
    const size_t n = std::min(size, c_.request_bytes - off_);  // 0 past the request: its parser asked too much
    std::memcpy(ptr, c_.bytes.data() + off_, n);
    off_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (!ready(POLLOUT, write_ms_)) return -1;
    ssize_t n;
    do n = ::send(c_.fd, ptr, size, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(false, ip, port); }
  socket_t socket() const override { return c_.fd; }

 private:
  bool ready(short events, int timeout_ms) const {
    pollfd p{c_.fd, events, 0};
    int r;
    do r = ::poll(&p, 1, timeout_ms);
    while (r < 0 && errno == EINTR);
    return r > 0 && (p.revents & (events | POLLHUP)) != 0 && !(p.revents & (POLLERR | POLLNVAL));
  }
  void address(bool remote, std::string& ip, int& port) const {
    sockaddr_storage a{};
    socklen_t len = sizeof(a);
    int r = remote ? getpeername(c_.fd, reinterpret_cast<sockaddr*>(&a), &len)
                   : getsockname(c_.fd, reinterpret_cast<sockaddr*>(&a), &len);
    if (r != 0) return;
    char host[NI_MAXHOST] = "";
    if (getnameinfo(reinterpret_cast<sockaddr*>(&a), len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) == 0)
      ip = host;
    if (a.ss_family == AF_INET) port = ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
    else if (a.ss_family == AF_INET6) port = ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
  }

  const GateConnection& c_;
  int write_ms_;
  size_t off_ = 0;
};

}  // namespace

// httplib's accept loop hands each new socket to its task queue: this one admits it to the gate at once, on the
// accept thread (admission only queues the socket), so no worker is involved before a request is whole.
class ListeningServer::InlineAdmission : public httplib::TaskQueue {
 public:
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override {}
};

int resolve_max_connections(int requested) {
  constexpr rlim_t kReservedFiles = 256;  // model files, pipes, the engine's own sockets
  constexpr int kMostConnections = 65536;
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return requested > 0 ? requested : 1024;
  const rlim_t want = std::min<rlim_t>(lim.rlim_max, kMostConnections + kReservedFiles);
  if (lim.rlim_cur < want) {
    rlimit raised = lim;
    raised.rlim_cur = want;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  const int room = static_cast<int>(std::min<rlim_t>(
      lim.rlim_cur > kReservedFiles + 16 ? lim.rlim_cur - kReservedFiles : 16, kMostConnections));
  if (requested <= 0) return room;
  if (requested > room) {
    KILN_LOG_WARN("--max-connections {} is more than the open-file limit allows ({} files); using {} (raise "
                  "'ulimit -n')",
                  requested, static_cast<unsigned long long>(lim.rlim_cur), room);
    return room;
  }
  return requested;
}

ListeningServer::~ListeningServer() { stop_gate(); }

void ListeningServer::raise_backlog(int backlog) {
  socket_t fd = svr_sock_;
  if (fd != INVALID_SOCKET) ::listen(fd, backlog);
}

void ListeningServer::configure(const ServerOptions& o) {
  write_timeout_s_ = o.write_timeout_s;
  RequestGateOptions g;
  g.header_timeout_ms = o.header_timeout_ms;
  g.request_timeout_ms = o.request_timeout_s * 1000;
  g.min_upload_rate_bytes_s = o.min_upload_rate_bytes_s;
  g.keep_alive_timeout_ms = o.keep_alive_timeout_s * 1000;
  g.max_connections = resolve_max_connections(o.max_connections);
  g.max_connections_per_client = o.max_connections_per_client;
  g.max_waiting = o.max_waiting_connections;
  g.max_body_bytes = o.max_request_bytes;
  g.retry_after_s = o.retry_after_s;
  g.allowed_origins = o.allowed_origins;
  gate_ = std::make_unique<RequestGate>(g, [this](std::unique_ptr<GateConnection> c) { dispatch(std::move(c)); });
  const int threads = o.http_threads > 0 ? o.http_threads : 64;
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    workers_ = std::make_unique<httplib::ThreadPool>(static_cast<size_t>(threads));
    health_workers_ = std::make_unique<httplib::ThreadPool>(2);
  }
  new_task_queue = [] { return new InlineAdmission; };
}

void ListeningServer::stop_gate() {
  if (gate_) gate_->stop();
  std::unique_ptr<httplib::ThreadPool> workers, health_workers;
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    workers.swap(workers_);
    health_workers.swap(health_workers_);
  }
  if (workers) workers->shutdown();
  if (health_workers) health_workers->shutdown();
}

// A whole request: a worker answers it (GET /health and /metrics: one of their own).
void ListeningServer::dispatch(std::unique_ptr<GateConnection> c) {
  std::lock_guard<std::mutex> lock(pool_mu_);
  httplib::ThreadPool* pool = c->priority ? health_workers_.get() : workers_.get();
  if (!pool) {
    gate_->close(std::move(c));
    return;
  }
  auto* raw = c.release();  // std::function needs a copyable callable
  pool->enqueue([this, raw] { serve(std::unique_ptr<GateConnection>(raw)); });
}

bool ListeningServer::process_and_close_socket(socket_t sock) {
  gate_->admit(sock);
  return true;
}

// One request through httplib's processing; then the connection goes back to the gate or is closed.
void ListeningServer::serve(std::unique_ptr<GateConnection> c) {
  const bool last = static_cast<size_t>(c->served) + 1 >= keep_alive_max_count_ || svr_sock_ == INVALID_SOCKET;
  bool connection_closed = false;
  bool ok = false;
  {
    BufferedRequestStream strm(*c, write_timeout_s_);
    ok = process_request(strm, /*close_connection=*/last, connection_closed, nullptr);
  }
  if (ok && !connection_closed && !last && svr_sock_ != INVALID_SOCKET)
    gate_->resume(std::move(c));
  else
    gate_->close(std::move(c));
}

}  // namespace kiln::server
