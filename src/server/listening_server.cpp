#include "server/listening_server.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "server/http_server.h"

namespace kiln::server {

namespace {

using Clock = std::chrono::steady_clock;

// A connection as httplib's request processing reads it: a read buffer (its line reader asks for one byte at a
// time), the server's read and write timeouts.
class SocketStream : public httplib::Stream {
 public:
  SocketStream(socket_t sock, int read_timeout_s, int write_timeout_s)
      : sock_(sock), read_ms_(read_timeout_s * 1000), write_ms_(write_timeout_s * 1000) {}

  bool is_readable() const override { return off_ < len_ || ready(POLLIN, read_ms_); }
  bool is_writable() const override { return ready(POLLOUT, write_ms_); }

  ssize_t read(char* ptr, size_t size) override {
    if (off_ >= len_) {
      if (!ready(POLLIN, read_ms_)) return -1;
      ssize_t n;
      do n = ::recv(sock_, buf_, sizeof(buf_), 0);
      while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      off_ = 0;
      len_ = static_cast<size_t>(n);
    }
    size_t n = std::min(size, len_ - off_);
    std::memcpy(ptr, buf_ + off_, n);
    off_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (!ready(POLLOUT, write_ms_)) return -1;
    ssize_t n;
    do n = ::send(sock_, ptr, size, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(false, ip, port); }
  socket_t socket() const override { return sock_; }

 private:
  bool ready(short events, int timeout_ms) const {
    pollfd p{sock_, events, 0};
    int r;
    do r = ::poll(&p, 1, timeout_ms);
    while (r < 0 && errno == EINTR);
    return r > 0 && (p.revents & (events | POLLHUP)) != 0 && !(p.revents & (POLLERR | POLLNVAL));
  }
  void address(bool remote, std::string& ip, int& port) const {
    sockaddr_storage a{};
    socklen_t len = sizeof(a);
    int r = remote ? getpeername(sock_, reinterpret_cast<sockaddr*>(&a), &len)
                   : getsockname(sock_, reinterpret_cast<sockaddr*>(&a), &len);
    if (r != 0) return;
    char host[NI_MAXHOST] = "";
    if (getnameinfo(reinterpret_cast<sockaddr*>(&a), len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) == 0)
      ip = host;
    if (a.ss_family == AF_INET) port = ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
    else if (a.ss_family == AF_INET6) port = ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
  }

  socket_t sock_;
  int read_ms_, write_ms_;
  char buf_[4096];
  size_t off_ = 0, len_ = 0;
};

}  // namespace

// The pool of workers; it tells the server while it can take connections.
class ListeningServer::Pool : public httplib::ThreadPool {
 public:
  Pool(ListeningServer& s, size_t n) : httplib::ThreadPool(n), server_(s) {
    std::lock_guard<std::mutex> lock(server_.pool_mu_);
    server_.pool_ = this;
  }
  void shutdown() override {
    {
      std::lock_guard<std::mutex> lock(server_.pool_mu_);
      server_.pool_ = nullptr;
    }
    httplib::ThreadPool::shutdown();
  }

 private:
  ListeningServer& server_;
};

ListeningServer::~ListeningServer() { stop_gate(); }

void ListeningServer::raise_backlog(int backlog) {
  socket_t fd = svr_sock_;
  if (fd != INVALID_SOCKET) ::listen(fd, backlog);
}

void ListeningServer::configure(const ServerOptions& o) {
  read_timeout_s_ = o.read_timeout_s;
  write_timeout_s_ = o.write_timeout_s;
  keep_alive_timeout_s_ = o.keep_alive_timeout_s;
  HeaderGateOptions g;
  g.timeout_ms = o.header_timeout_ms;
  g.max_waiting = o.max_waiting_connections;
  gate_ = std::make_unique<HeaderGate>(g, [this](int fd) { dispatch(fd); });
  const int threads = o.http_threads > 0 ? o.http_threads : 64;
  new_task_queue = [this, threads] { return new Pool(*this, static_cast<size_t>(threads)); };
}

void ListeningServer::stop_gate() {
  if (gate_) gate_->stop();
}

// Headers complete: a worker takes the connection.
void ListeningServer::dispatch(int fd) {
  std::lock_guard<std::mutex> lock(pool_mu_);
  if (!pool_) {
    ::close(fd);
    return;
  }
  pool_->enqueue([this, fd] { serve(fd); });
}

// httplib's accept loop hands every new connection here (on a worker): into the gate.
bool ListeningServer::process_and_close_socket(socket_t sock) {
  gate_->admit(sock);
  return true;
}

// What httplib does with a connection: requests while the client keeps it alive and the server runs.
bool ListeningServer::serve(socket_t sock) {
  bool ok = false;
  for (size_t count = keep_alive_max_count_; svr_sock_ != INVALID_SOCKET && count > 0 && next_request(sock);
       --count) {
    SocketStream strm(sock, read_timeout_s_, write_timeout_s_);
    bool connection_closed = false;
    ok = process_request(strm, /*close_connection=*/count == 1, connection_closed, nullptr);
    if (!ok || connection_closed) break;
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return ok;
}

// Waits (up to the keep-alive timeout) for the next request's bytes; false when none come or the peer left.
bool ListeningServer::next_request(socket_t sock) const {
  const auto deadline = Clock::now() + std::chrono::seconds(keep_alive_timeout_s_);
  while (svr_sock_ != INVALID_SOCKET) {
    pollfd p{sock, POLLIN, 0};
    int r = ::poll(&p, 1, 50);
    if (r < 0 && errno != EINTR) return false;
    if (r > 0) {
      if (p.revents & (POLLERR | POLLNVAL)) return false;
      char c;
      return ::recv(sock, &c, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
    }
    if (Clock::now() >= deadline) return false;
  }
  return false;
}

}  // namespace kiln::server
