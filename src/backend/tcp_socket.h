// Blocking-style I/O on POSIX TCP sockets with deadlines, shared by the startup rendezvous (rendezvous.h) and the
// group's message channel (tcp_node_link.h): an owning descriptor, exact reads and whole writes that poll in short
// slices (so a deadline or a stop flag set from another thread ends them), and frames of model/tp_wire.h
// ([type][length][payload]). Errors come back as false plus a short reason; callers word the kiln::Error.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "model/tp_wire.h"

namespace kiln::backend::tcp {

using Clock = std::chrono::steady_clock;
inline constexpr Clock::time_point kNoDeadline = Clock::time_point::max();

// A socket closed when it goes out of scope.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  void reset();
};

// Why an I/O call stopped early.
enum class IoEnd { done, peer_closed, timed_out, stopped, failed };
struct IoResult {
  IoEnd end = IoEnd::done;
  size_t bytes = 0;    // moved before it stopped
  std::string reason;  // "timed out", "the connection was closed", strerror, ...
  bool ok() const { return end == IoEnd::done; }
};

// Milliseconds left until the deadline, clamped to 0..2^30.
int remaining_ms(Clock::time_point deadline);
// Waits until fd is readable (POLLIN) or writable (POLLOUT); false on time-out or error.
bool wait_fd(int fd, short events, Clock::time_point deadline);

// Reads exactly n bytes / writes all n bytes before the deadline; `stop` (may be null) is checked every 100 ms.
IoResult read_exact(int fd, void* buf, size_t n, Clock::time_point deadline, const std::atomic<bool>* stop = nullptr);
IoResult write_all(int fd, const void* buf, size_t n, Clock::time_point deadline,
                   const std::atomic<bool>* stop = nullptr);

// One frame: header and payload written together.
IoResult write_frame(int fd, model::wire::Message type, const void* payload, size_t bytes, Clock::time_point deadline,
                     const std::atomic<bool>* stop = nullptr);
// Reads one frame's header and payload. A header that is not a kiln frame (unknown type, payload over
// max_payload_bytes) throws kiln::Error (model/tp_wire.h's message); I/O endings come back in the result (a clean
// close between frames is peer_closed with bytes 0).
IoResult read_frame(int fd, model::wire::Message& type, std::vector<uint8_t>& payload, uint64_t max_payload_bytes,
                    Clock::time_point deadline, const std::atomic<bool>* stop = nullptr);

}  // namespace kiln::backend::tcp
