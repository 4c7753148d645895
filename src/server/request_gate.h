// The HTTP connections no worker serves: new ones, and kept-alive ones between requests. One epoll thread reads
// each connection's bytes into its buffer until one whole request has arrived (headers and body: Content-Length or
// chunked, see request_framing.h); only then is the connection handed on, with that request at the front of its
// buffer, so a worker parses from memory and never waits for a client. After its answer a kept-alive connection
// comes back (resume) and waits here for its next request. Slow uploads, slow headers and idle keep-alive
// connections therefore hold no worker, however many there are.
//
// Limits, each answered with a JSON error and a log line, then the connection is closed:
// - a request's headers must arrive within header_timeout_ms, the whole request within request_timeout_ms, and
//   after rate_grace_ms it must keep up min_upload_rate_bytes_s on average since its first byte: else 408;
// - a POST / PUT / PATCH without a length: 411; a body over max_body_bytes: 413; headers over max_header_bytes:
//   431; unframeable bytes: 400;
// - open connections (here and in workers): beyond max_connections the one that has waited here longest makes
//   room (an idle keep-alive one is closed silently, a partial request answered 408); when none waits here the
//   new one is answered 503;
// - connections from one client address: beyond max_connections_per_client the new one is answered 429;
// - request bytes held in memory: a body that would take the total over max_buffered_bytes is answered 503.
// An idle kept-alive connection is closed silently after keep_alive_timeout_ms.
#pragma once
#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "server/request_framing.h"

namespace kiln::server {

struct RequestGateOptions {
  int header_timeout_ms = 10000;         // request line and headers, from the request's start
  int request_timeout_ms = 60000;        // the whole request (headers and body), from its start
  int min_upload_rate_bytes_s = 500;     // average since the request's start, checked after the grace; 0: none
  int rate_grace_ms = 5000;
  int keep_alive_timeout_ms = 5000;      // an idle kept-alive connection waits this long for its next request
  int max_connections = 4096;            // open at once, here and in workers
  int max_connections_per_client = 0;    // per client address; 0: no limit
  int max_waiting = 0;                   // held here at once (beyond: the oldest goes); 0: max_connections
  size_t max_header_bytes = 65536;
  size_t max_body_bytes = 32u << 20;
  size_t max_buffered_bytes = size_t{1} << 30;  // request bytes held in all connections' buffers at once
  int retry_after_s = 1;                 // Retry-After of the 429 / 503 answers
  // --allowed-origins: a gate answer to a request whose headers arrived carries the CORS headers the routes would
  // (an allowed Origin, or "*"), and the client's X-Request-Id (sanitised as the routes do).
  std::vector<std::string> allowed_origins;
};

// A connection handed to a worker: its socket and the bytes read from it, the ready request first.
struct GateConnection {
  int fd = -1;
  std::string client;          // the peer's address ("" for a local socket)
  std::string bytes;           // read and not yet consumed: the request is bytes[0, request_bytes)
  size_t request_bytes = 0;
  bool priority = false;       // the request is GET /health or GET /metrics
  int served = 0;              // requests answered on this connection before this one
};

class RequestGate {
 public:
  // ready(connection): a whole request has arrived. Called on the gate's thread: it must only hand it on. The
  // callee gives the connection back through resume() or close().
  RequestGate(RequestGateOptions options, std::function<void(std::unique_ptr<GateConnection>)> ready);
  ~RequestGate();
  RequestGate(const RequestGate&) = delete;
  RequestGate& operator=(const RequestGate&) = delete;

  // Takes ownership of a newly accepted socket. Any thread.
  void admit(int fd);
  // A served connection kept alive: drops its request's bytes and waits for the next request. Any thread.
  void resume(std::unique_ptr<GateConnection> c);
  // A served connection that ends: closes it and releases its place. Any thread.
  void close(std::unique_ptr<GateConnection> c);
  // Stops the thread and closes the connections held here (and later resumed ones). Idempotent.
  void stop();

  int open_connections() const;
  size_t buffered_bytes() const { return buffered_bytes_.load(); }

 private:
  struct Held;
  void loop();
  void take_incoming();
  void add_new(int fd);
  void add(std::unique_ptr<GateConnection> c, bool is_new);
  void on_readable(int fd);
  void check_deadlines();
  void make_room();
  void answer(Held& h, int status, const std::string& message);  // and closes
  void drop(int fd);           // closes without an answer
  void linger(int fd, bool registered);  // after an answer: drops what the client still sends, then closes
  void discard(int fd);
  void release(const std::string& client);

  RequestGateOptions opts_;
  FramingLimits framing_limits_;
  std::function<void(std::unique_ptr<GateConnection>)> ready_;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;

  std::mutex mu_;
  std::vector<int> incoming_;                                   // admitted sockets (guarded by mu_)
  std::vector<std::unique_ptr<GateConnection>> resumed_;        // kept-alive connections (guarded by mu_)
  bool stopping_ = false;                                       // guarded by mu_

  mutable std::mutex count_mu_;
  int open_ = 0;                                                // guarded by count_mu_
  std::unordered_map<std::string, int> per_client_;             // guarded by count_mu_
  std::atomic<size_t> buffered_bytes_{0};

  // Owned by the gate's thread.
  std::unordered_map<int, std::unique_ptr<Held>> held_;
  std::unordered_map<int, std::chrono::steady_clock::time_point> lingering_;  // answered, closing (fd -> until)
  std::deque<std::pair<uint64_t, int>> by_age_;  // (order, fd), oldest first; stale entries skipped
  uint64_t next_order_ = 0;
  std::vector<char> read_buf_;  // what one recv reads, before it joins a connection's bytes
  std::chrono::steady_clock::time_point next_deadline_check_{};
  std::thread thread_;
};

}  // namespace kiln::server
