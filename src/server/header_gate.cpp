#include "server/header_gate.h"

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

namespace kiln::server {

namespace {

std::string peer_of(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (a.ss_family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&a);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (a.ss_family == AF_INET6) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&a);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

bool iequals_prefix(std::string_view line, std::string_view name) {
  if (line.size() < name.size()) return false;
  for (size_t i = 0; i < name.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(line[i])) != name[i]) return false;
  return true;
}

// The request's headers say how long its body is (or that it has none: GET and the like).
bool body_length_known(std::string_view head) {
  size_t line_end = head.find('\n');
  std::string_view request_line = head.substr(0, line_end);
  std::string_view method = request_line.substr(0, request_line.find(' '));
  if (method != "POST" && method != "PUT" && method != "PATCH") return true;
  while (line_end != std::string_view::npos) {
    size_t start = line_end + 1;
    line_end = head.find('\n', start);
    std::string_view line = head.substr(start, line_end == std::string_view::npos ? std::string_view::npos : line_end - start);
    if (iequals_prefix(line, "content-length:") || iequals_prefix(line, "transfer-encoding:")) return true;
  }
  return false;
}

}  // namespace

HeaderGate::HeaderGate(HeaderGateOptions options, std::function<void(int)> ready)
    : opts_(options), ready_(std::move(ready)), peek_buf_(options.max_header_bytes) {
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  KILN_CHECK(epoll_fd_ >= 0 && wake_fd_ >= 0, "header gate: epoll / eventfd failed (errno {})", errno);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  thread_ = std::thread([this] { loop(); });
}

HeaderGate::~HeaderGate() {
  stop();
  close(epoll_fd_);
  close(wake_fd_);
}

void HeaderGate::admit(int fd) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      incoming_.push_back(fd);
      fd = -1;
    }
  }
  if (fd >= 0) {
    close(fd);
    return;
  }
  uint64_t one = 1;
  ssize_t w = write(wake_fd_, &one, sizeof(one));
  (void)w;
}

void HeaderGate::stop() {
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

void HeaderGate::add(int fd) {
  // Over the limit: the connection waiting longest goes (a real client has sent its headers by now).
  while (static_cast<int>(waiting_.size()) >= opts_.max_waiting && !by_age_.empty()) {
    auto [order, old] = by_age_.front();
    by_age_.pop_front();
    auto it = waiting_.find(old);
    if (it == waiting_.end() || it->second.order != order) continue;  // stale: already gone
    reject(old, 408, "too many connections are waiting for their request headers; this one waited longest");
  }
  Waiting w;
  w.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(opts_.timeout_ms);
  w.order = next_order_++;
  waiting_[fd] = w;
  by_age_.push_back({w.order, fd});
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET;  // edge-triggered: peeked bytes stay, only new ones wake us
  ev.data.fd = fd;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    waiting_.erase(fd);
    close(fd);
    return;
  }
  check(fd);  // the headers may be there already
}

void HeaderGate::forget(int fd) {
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  waiting_.erase(fd);
}

void HeaderGate::reject(int fd, int status, const std::string& message) {
  const char* reason = status == 408 ? "Request Timeout" : status == 411 ? "Length Required" : "Bad Request";
  std::string body = error_body(status, message);
  std::string response = "HTTP/1.1 " + std::to_string(status) + " " + reason +
                         "\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " +
                         std::to_string(body.size()) + "\r\n\r\n" + body;
  ssize_t w = send(fd, response.data(), response.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)w;
  KILN_LOG_INFO("request rejected remote={} status={} error=\"{}\"", peer_of(fd), status, message);
  forget(fd);
  close(fd);
}

void HeaderGate::check(int fd) {
  ssize_t n = recv(fd, peek_buf_.data(), peek_buf_.size(), MSG_PEEK | MSG_DONTWAIT);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
    forget(fd);  // the client left before sending a request
    close(fd);
    return;
  }
  if (n < 0) return;
  std::string_view head(peek_buf_.data(), static_cast<size_t>(n));
  size_t end = head.find("\r\n\r\n");
  if (end == std::string_view::npos) end = head.find("\n\n");
  if (end == std::string_view::npos && static_cast<size_t>(n) < peek_buf_.size()) return;  // not yet
  if (end != std::string_view::npos && !body_length_known(head.substr(0, end))) {
    std::string_view request_line = head.substr(0, head.find_first_of("\r\n"));
    reject(fd, 411,
           std::string(request_line.substr(0, request_line.rfind(' '))) +
               ": the request has neither Content-Length nor chunked Transfer-Encoding; send Content-Length: 0 for "
               "an empty body");
    return;
  }
  forget(fd);
  ready_(fd);
}

void HeaderGate::loop() {
  std::vector<epoll_event> events(64);
  for (;;) {
    std::vector<int> incoming;
    bool stopping;
    {
      std::lock_guard<std::mutex> lock(mu_);
      incoming.swap(incoming_);
      stopping = stopping_;
    }
    if (stopping) {
      for (int fd : incoming) close(fd);
      for (auto& [fd, w] : waiting_) close(fd);
      waiting_.clear();
      return;
    }
    for (int fd : incoming) add(fd);
    int n = epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), 100);
    for (int i = 0; i < n; ++i) {
      int fd = events[i].data.fd;
      if (fd == wake_fd_) {
        uint64_t v;
        while (read(wake_fd_, &v, sizeof(v)) > 0) {
        }
        continue;
      }
      if (waiting_.count(fd)) check(fd);
    }
    auto now = std::chrono::steady_clock::now();
    std::vector<int> expired;
    for (auto& [fd, w] : waiting_)
      if (now >= w.deadline) expired.push_back(fd);
    for (int fd : expired)
      reject(fd, 408, "the request headers did not arrive within " + std::to_string(opts_.timeout_ms) + " ms");
    // Entries of connections that left the queue (ready, closed) are dropped once they reach its front.
    while (!by_age_.empty()) {
      auto it = waiting_.find(by_age_.front().second);
      if (it != waiting_.end() && it->second.order == by_age_.front().first) break;
      by_age_.pop_front();
    }
  }
}

}  // namespace kiln::server
