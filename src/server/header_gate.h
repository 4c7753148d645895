// Holds each new HTTP connection until its request headers have arrived, on one thread of its own, so that a
// client sending its headers slowly (or not at all) never holds a worker of the connection pool: workers only
// see connections whose first request is ready to be read. A connection whose headers are not complete within
// the deadline is answered 408 and closed; when more connections than the limit wait, the oldest waiting one is
// closed (so a flood of slow clients cannot keep out a real request, which sends its headers at once).
// A POST / PUT / PATCH without Content-Length or chunked encoding is answered 411 at once instead of being read
// until the connection closes.
#pragma once
#include <chrono>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace kiln::server {

struct HeaderGateOptions {
  int timeout_ms = 10000;          // headers of a new connection must be complete by then
  int max_waiting = 1024;          // connections waiting for their headers; beyond: the oldest is closed
  size_t max_header_bytes = 65536;  // larger headers go to the server as they are (it rejects them)
};

class HeaderGate {
 public:
  // ready(fd): the connection's headers are complete; the callee owns fd from then on. Called on the gate's
  // thread: it must only hand the connection on.
  HeaderGate(HeaderGateOptions options, std::function<void(int)> ready);
  ~HeaderGate();
  HeaderGate(const HeaderGate&) = delete;
  HeaderGate& operator=(const HeaderGate&) = delete;

  // Takes ownership of a newly accepted connection.
  void admit(int fd);
  // Stops the thread and closes the connections still waiting. Idempotent.
  void stop();

 private:
  struct Waiting {
    std::chrono::steady_clock::time_point deadline;
    uint64_t order = 0;
  };
  void loop();
  void add(int fd);
  void check(int fd);
  void reject(int fd, int status, const std::string& message);
  void forget(int fd);

  HeaderGateOptions opts_;
  std::function<void(int)> ready_;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::mutex mu_;
  std::vector<int> incoming_;  // admitted, not yet registered (guarded by mu_)
  bool stopping_ = false;      // guarded by mu_
  // Owned by the gate's thread.
  std::unordered_map<int, Waiting> waiting_;
  std::deque<std::pair<uint64_t, int>> by_age_;  // (order, fd), oldest first; stale entries skipped
  uint64_t next_order_ = 0;
  std::vector<char> peek_buf_;
  std::thread thread_;
};

}  // namespace kiln::server
