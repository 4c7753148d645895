#include "server/request_gate.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <string_view>

#include "core/error.h"
#include "core/log.h"
#include "server/api_error.h"
#include "server/server_state.h"

namespace kiln::server {

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kReadChunk = 65536;
constexpr auto kDeadlineCheckInterval = std::chrono::milliseconds(50);
// After an error answer the client's remaining bytes are read and dropped this long (or until it closes): closing
// with unread bytes would reset the connection, and the client could lose the answer before reading it.
constexpr auto kLinger = std::chrono::seconds(2);

// The peer's address without its port ("" when it has none, as for a local socket pair).
std::string client_of(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return "";
  char host[INET6_ADDRSTRLEN] = "";
  if (a.ss_family == AF_INET)
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&a)->sin_addr, host, sizeof(host));
  else if (a.ss_family == AF_INET6)
    inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&a)->sin6_addr, host, sizeof(host));
  return host;
}

const char* reason_of(int status) {
  switch (status) {
    case 400: return "Bad Request";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Payload Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

// A header's value in a request's header section (the request line first), the name matched in any case; "" when
// absent.
std::string header_value(std::string_view head, std::string_view name) {
  size_t pos = head.find("\r\n");
  while (pos != std::string_view::npos && pos + 2 < head.size()) {
    const size_t start = pos + 2;
    size_t end = head.find("\r\n", start);
    if (end == std::string_view::npos) end = head.size();
    const std::string_view line = head.substr(start, end - start);
    if (line.size() > name.size() && line[name.size()] == ':' &&
        std::equal(name.begin(), name.end(), line.begin(), [](char a, char b) {
          return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
        })) {
      std::string_view v = line.substr(name.size() + 1);
      while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
      while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
      return std::string(v);
    }
    pos = end;
  }
  return "";
}

// The CORS and X-Request-Id header lines of an answer to a request with these headers (as the routes add them).
std::string answer_headers(std::string_view head, const std::vector<std::string>& allowed_origins) {
  std::string out;
  const std::string origin = header_value(head, "Origin");
  if (!origin.empty())
    for (const auto& o : allowed_origins) {
      if (o != "*" && o != origin) continue;
      out += "Access-Control-Allow-Origin: " + (o == "*" ? std::string("*") : origin) + "\r\n";
      if (o != "*") out += "Vary: Origin\r\n";
      out += "Access-Control-Expose-Headers: X-Request-Id, Retry-After\r\n";
      break;
    }
  std::string id;
  for (char c : header_value(head, "X-Request-Id")) {
    if (id.size() == 128) break;
    if (std::isalnum(static_cast<unsigned char>(c)) || std::string_view("._:/+=-").find(c) != std::string_view::npos)
      id += c;
  }
  if (!id.empty()) out += "X-Request-Id: " + id + "\r\n";
  return out;
}

// Sends a whole error answer without blocking (it is small: it fits the socket buffer) and ends the sending side.
void send_answer(int fd, int status, const std::string& message, const std::string& path, int retry_after_s,
                 const std::string& extra_headers = "") {
  const std::string body = error_body(ApiError(status, message), error_style_of(path));
  std::string response = "HTTP/1.1 " + std::to_string(status) + " " + reason_of(status) +
                         "\r\nContent-Type: application/json\r\nConnection: close\r\n" + extra_headers;
  if (status == 429 || status == 503) response += "Retry-After: " + std::to_string(retry_after_s) + "\r\n";
  response += "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  ssize_t w = send(fd, response.data(), response.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)w;
  shutdown(fd, SHUT_WR);
}

}  // namespace

// A connection while it is here.
struct RequestGate::Held {
  std::unique_ptr<GateConnection> conn;
  RequestFraming framing;
  Clock::time_point start;        // the request's first byte (a new connection: its admission)
  bool idle = false;              // kept alive, no byte of its next request yet
  Clock::time_point idle_since;
  uint64_t order = 0;
  size_t request_bytes_seen = 0;  // bytes of this request read so far (for the rate)
};

RequestGate::RequestGate(RequestGateOptions options, std::function<void(std::unique_ptr<GateConnection>)> ready)
    : opts_(options), ready_(std::move(ready)), read_buf_(kReadChunk) {
  framing_limits_.max_header_bytes = opts_.max_header_bytes;
  framing_limits_.max_body_bytes = opts_.max_body_bytes;
  if (opts_.max_waiting <= 0) opts_.max_waiting = opts_.max_connections;
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  KILN_CHECK(epoll_fd_ >= 0 && wake_fd_ >= 0, "request gate: epoll / eventfd failed (errno {})", errno);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  thread_ = std::thread([this] { loop(); });
}

RequestGate::~RequestGate() {
  stop();
  ::close(epoll_fd_);
  ::close(wake_fd_);
}

void RequestGate::admit(int fd) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      incoming_.push_back(fd);
      fd = -1;
    }
  }
  if (fd >= 0) {
    ::close(fd);
    return;
  }
  uint64_t one = 1;
  ssize_t w = write(wake_fd_, &one, sizeof(one));
  (void)w;
}

void RequestGate::resume(std::unique_ptr<GateConnection> c) {
  const size_t used = std::min(c->request_bytes, c->bytes.size());
  c->bytes.erase(0, used);
  buffered_bytes_ -= used;
  c->request_bytes = 0;
  c->priority = false;
  ++c->served;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      resumed_.push_back(std::move(c));
    }
  }
  if (c) {
    close(std::move(c));
    return;
  }
  uint64_t one = 1;
  ssize_t w = write(wake_fd_, &one, sizeof(one));
  (void)w;
}

void RequestGate::close(std::unique_ptr<GateConnection> c) {
  if (!c) return;
  buffered_bytes_ -= c->bytes.size();
  release(c->client);
  shutdown(c->fd, SHUT_RDWR);
  ::close(c->fd);
}

void RequestGate::release(const std::string& client) {
  std::lock_guard<std::mutex> lock(count_mu_);
  --open_;
  auto it = per_client_.find(client);
  if (it != per_client_.end() && --it->second <= 0) per_client_.erase(it);
}

int RequestGate::open_connections() const {
  std::lock_guard<std::mutex> lock(count_mu_);
  return open_;
}

void RequestGate::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  uint64_t one = 1;
  ssize_t w = write(wake_fd_, &one, sizeof(one));
  (void)w;
  if (thread_.joinable()) thread_.join();
}

// A new socket: counted against the limits, then held until its first request has arrived.
void RequestGate::add_new(int fd) {
  auto c = std::make_unique<GateConnection>();
  c->fd = fd;
  c->client = client_of(fd);
  int from_client = 0;
  bool full = false;
  {
    std::lock_guard<std::mutex> lock(count_mu_);
    auto it = per_client_.find(c->client);
    from_client = it == per_client_.end() ? 0 : it->second;
    full = open_ >= opts_.max_connections;
  }
  if (opts_.max_connections_per_client > 0 && from_client >= opts_.max_connections_per_client) {
    const std::string msg = "too many connections from " + c->client + " (the limit is " +
                            std::to_string(opts_.max_connections_per_client) +
                            " per client address); reuse or close the open ones, or retry later";
    KILN_LOG_INFO("connection refused remote={} status=429 error=\"{}\"", c->client, msg);
    send_answer(fd, 429, msg, "", opts_.retry_after_s);
    linger(fd, /*registered=*/false);
    return;
  }
  if (full) make_room();
  {
    std::lock_guard<std::mutex> lock(count_mu_);
    full = open_ >= opts_.max_connections;
    if (!full) {
      ++open_;
      ++per_client_[c->client];
    }
  }
  if (full) {
    const std::string msg = "the server has " + std::to_string(opts_.max_connections) +
                            " connections open, its limit, and all of them are being answered; retry later";
    KILN_LOG_INFO("connection refused remote={} status=503 error=\"{}\"", c->client, msg);
    send_answer(fd, 503, msg, "", opts_.retry_after_s);
    linger(fd, /*registered=*/false);
    return;
  }
  add(std::move(c), /*is_new=*/true);
}

// The connection that has waited here longest goes: an idle kept-alive one silently, a partial request with 408.
void RequestGate::make_room() {
  while (!by_age_.empty()) {
    auto [order, fd] = by_age_.front();
    by_age_.pop_front();
    auto it = held_.find(fd);
    if (it == held_.end() || it->second->order != order) continue;  // stale: already gone
    if (it->second->idle) drop(fd);
    else answer(*it->second, 408, "the server is at its connection limit and this request waited longest");
    return;
  }
}

void RequestGate::add(std::unique_ptr<GateConnection> c, bool is_new) {
  const int fd = c->fd;
  if (static_cast<int>(held_.size()) >= opts_.max_waiting) make_room();
  auto h = std::make_unique<Held>();
  const auto now = Clock::now();
  h->framing = RequestFraming(framing_limits_);
  h->start = now;
  h->idle = !is_new && c->bytes.empty();
  h->idle_since = now;
  h->order = next_order_++;
  h->request_bytes_seen = c->bytes.size();  // a pipelined request's bytes, read with the previous one
  h->conn = std::move(c);
  by_age_.push_back({h->order, fd});
  held_[fd] = std::move(h);
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET;  // edge-triggered: on_readable reads until the socket is empty
  ev.data.fd = fd;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    drop(fd);
    return;
  }
  on_readable(fd);  // bytes may be there already (or left over from a pipelined request)
}

void RequestGate::drop(int fd) {
  auto it = held_.find(fd);
  if (it == held_.end()) return;
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  std::unique_ptr<GateConnection> c = std::move(it->second->conn);
  held_.erase(it);
  close(std::move(c));
}

void RequestGate::answer(Held& h, int status, const std::string& message) {
  const int fd = h.conn->fd;
  const std::string& method = h.framing.method();
  const std::string& path = h.framing.path();
  if (!method.empty())
    KILN_LOG_INFO("request rejected method={} path={} remote={} status={} error=\"{}\"", method, path, h.conn->client,
                  status, message);
  else
    KILN_LOG_INFO("request rejected remote={} status={} error=\"{}\"", h.conn->client, status, message);
  release(h.conn->client);  // first: the client may be told before the gate goes on
  std::string extra;
  if (h.framing.header_bytes() > 0)  // the header section arrived (also when one of its headers was refused)
    extra = answer_headers(std::string_view(h.conn->bytes).substr(0, h.framing.header_bytes()), opts_.allowed_origins);
  send_answer(fd, status, message, path, opts_.retry_after_s, extra);
  buffered_bytes_ -= h.conn->bytes.size();
  held_.erase(fd);  // h is gone from here on
  linger(fd, /*registered=*/true);
}

void RequestGate::linger(int fd, bool registered) {
  if (!registered) {
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      ::close(fd);
      return;
    }
  }
  lingering_[fd] = Clock::now() + kLinger;
  discard(fd);
}

void RequestGate::discard(int fd) {
  for (;;) {
    ssize_t n = recv(fd, read_buf_.data(), read_buf_.size(), MSG_DONTWAIT);
    if (n > 0 || (n < 0 && errno == EINTR)) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    break;  // the client closed (or reset): done
  }
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  ::close(fd);
  lingering_.erase(fd);
}

// Reads what the socket holds; hands the connection on once its request is whole.
void RequestGate::on_readable(int fd) {
  auto it = held_.find(fd);
  if (it == held_.end()) {
    if (lingering_.count(fd)) discard(fd);
    return;
  }
  Held& h = *it->second;
  GateConnection& c = *h.conn;
  bool peer_closed = false;
  for (;;) {
    if (!c.bytes.empty() || !h.idle) {
      // Parse what is there before reading more: a request may already be whole (pipelined, or just read).
      if (h.idle) {
        h.idle = false;
        h.start = Clock::now();
      }
      const bool had_headers = h.framing.headers_complete();
      const RequestFraming::State s = h.framing.feed(c.bytes);
      if (s == RequestFraming::State::kError) {
        answer(h, h.framing.error_status(), h.framing.error_message());
        return;
      }
      if (!had_headers && h.framing.headers_complete()) {
        const size_t have_body = c.bytes.size() - h.framing.header_bytes();
        const size_t more = h.framing.announced_body_bytes() > have_body ? h.framing.announced_body_bytes() - have_body : 0;
        if (buffered_bytes_.load() + more > opts_.max_buffered_bytes) {
          answer(h, 503, "the server holds too many request bodies in memory; retry later");
          return;
        }
        if (h.framing.expects_continue()) {
          // Answered here, and dropped from what the worker's parser reads (it would answer it again).
          static const char kContinue[] = "HTTP/1.1 100 Continue\r\n\r\n";
          ssize_t w = send(fd, kContinue, sizeof(kContinue) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
          (void)w;
          const size_t b = h.framing.expect_begin(), e = h.framing.expect_end();
          c.bytes.erase(b, e - b);
          buffered_bytes_ -= e - b;
          h.framing = RequestFraming(framing_limits_);
          h.framing.feed(c.bytes);
        }
      }
      if (h.framing.state() == RequestFraming::State::kComplete) {
        c.request_bytes = h.framing.request_bytes();
        c.priority = h.framing.method() == "GET" && (h.framing.path() == "/health" || h.framing.path() == "/metrics");
        epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
        std::unique_ptr<GateConnection> ready = std::move(h.conn);
        held_.erase(it);
        ready_(std::move(ready));
        return;
      }
      if (buffered_bytes_.load() > opts_.max_buffered_bytes) {
        answer(h, 503, "the server holds too many request bodies in memory; retry later");
        return;
      }
    }
    if (peer_closed) {
      drop(fd);  // the client left before its request was whole
      return;
    }
    ssize_t n = recv(fd, read_buf_.data(), read_buf_.size(), MSG_DONTWAIT);
    if (n > 0) {
      c.bytes.append(read_buf_.data(), static_cast<size_t>(n));
      buffered_bytes_ += static_cast<size_t>(n);
      h.request_bytes_seen += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    peer_closed = true;  // 0: orderly close; < 0: reset
    if (c.bytes.empty() || n < 0) {
      drop(fd);
      return;
    }
  }
}

void RequestGate::check_deadlines() {
  const auto now = Clock::now();
  std::vector<std::pair<int, std::string>> late;
  std::vector<int> idle_done;
  for (auto& [fd, hp] : held_) {
    const Held& h = *hp;
    if (h.idle) {
      if (now - h.idle_since >= std::chrono::milliseconds(opts_.keep_alive_timeout_ms)) idle_done.push_back(fd);
      continue;
    }
    const auto elapsed_ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - h.start).count();
    if (!h.framing.headers_complete() && elapsed_ms >= opts_.header_timeout_ms) {
      late.push_back({fd, "the request headers did not arrive within " + std::to_string(opts_.header_timeout_ms) + " ms"});
    } else if (elapsed_ms >= opts_.request_timeout_ms) {
      late.push_back({fd, "the request (headers and body) did not arrive within " +
                              std::to_string(opts_.request_timeout_ms) + " ms"});
    } else if (opts_.min_upload_rate_bytes_s > 0 && elapsed_ms > opts_.rate_grace_ms) {
      const double needed = opts_.min_upload_rate_bytes_s * (elapsed_ms - opts_.rate_grace_ms) / 1000.0;
      if (static_cast<double>(h.request_bytes_seen) < needed)
        late.push_back({fd, "the request arrived at " +
                                std::to_string(static_cast<long long>(h.request_bytes_seen * 1000 / elapsed_ms)) +
                                " bytes/s, below the minimum of " + std::to_string(opts_.min_upload_rate_bytes_s) +
                                " bytes/s"});
    }
  }
  for (int fd : idle_done) drop(fd);
  for (auto it = lingering_.begin(); it != lingering_.end();) {
    if (now < it->second) {
      ++it;
      continue;
    }
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, it->first, nullptr);
    ::close(it->first);
    it = lingering_.erase(it);
  }
  for (auto& [fd, msg] : late) {
    auto it = held_.find(fd);
    if (it != held_.end()) answer(*it->second, 408, msg);
  }
  // Entries of connections that left (handed on, closed) are dropped once they reach the front.
  while (!by_age_.empty()) {
    auto it = held_.find(by_age_.front().second);
    if (it != held_.end() && it->second->order == by_age_.front().first) break;
    by_age_.pop_front();
  }
}

void RequestGate::take_incoming() {
  std::vector<int> incoming;
  std::vector<std::unique_ptr<GateConnection>> resumed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    incoming.swap(incoming_);
    resumed.swap(resumed_);
  }
  for (auto& c : resumed) add(std::move(c), /*is_new=*/false);
  for (int fd : incoming) add_new(fd);
}

void RequestGate::loop() {
  std::vector<epoll_event> events(256);
  for (;;) {
    bool stopping;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping = stopping_;
    }
    if (stopping) {
      std::vector<int> incoming;
      std::vector<std::unique_ptr<GateConnection>> resumed;
      {
        std::lock_guard<std::mutex> lock(mu_);
        incoming.swap(incoming_);
        resumed.swap(resumed_);
      }
      for (int fd : incoming) ::close(fd);
      for (auto& c : resumed) close(std::move(c));
      std::vector<int> fds;
      for (auto& [fd, h] : held_) fds.push_back(fd);
      for (int fd : fds) drop(fd);
      for (auto& [fd, until] : lingering_) ::close(fd);
      lingering_.clear();
      return;
    }
    take_incoming();
    int n = epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), 50);
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == wake_fd_) {
        uint64_t v;
        while (read(wake_fd_, &v, sizeof(v)) > 0) {
        }
        continue;
      }
      on_readable(fd);
    }
    const auto now = Clock::now();
    if (now >= next_deadline_check_) {
      check_deadlines();
      next_deadline_check_ = now + kDeadlineCheckInterval;
    }
  }
}

}  // namespace kiln::server
