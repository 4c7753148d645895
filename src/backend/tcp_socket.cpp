#include "backend/tcp_socket.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace kiln::backend::tcp {

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    reset();
    fd = o.fd;
    o.fd = -1;
  }
  return *this;
}

void Fd::reset() {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

int remaining_ms(Clock::time_point deadline) {
  if (deadline == kNoDeadline) return 1 << 30;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, remaining_ms(deadline));
    if (r > 0) return true;
    if (r == 0) return false;
    if (errno != EINTR) return false;
  }
}

namespace {

// Waits for `events` in slices of 100 ms, so a stop flag set from another thread is noticed.
IoResult wait_sliced(int fd, short events, Clock::time_point deadline, const std::atomic<bool>* stop) {
  for (;;) {
    if (stop && *stop) return {IoEnd::stopped, 0, "the group was closed after a failure"};
    const int left = remaining_ms(deadline);
    if (left <= 0) return {IoEnd::timed_out, 0, "timed out"};
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, std::min(left, 100));
    if (r > 0) return {};
    if (r < 0 && errno != EINTR) return {IoEnd::failed, 0, std::strerror(errno)};
  }
}

bool retry(int e) { return e == EINTR || e == EAGAIN || e == EWOULDBLOCK; }

}  // namespace

IoResult read_exact(int fd, void* buf, size_t n, Clock::time_point deadline, const std::atomic<bool>* stop) {
  auto* p = static_cast<uint8_t*>(buf);
  size_t got = 0;
  while (got < n) {
    IoResult w = wait_sliced(fd, POLLIN, deadline, stop);
    if (!w.ok()) return {w.end, got, w.reason};
    const ssize_t r = ::recv(fd, p + got, n - got, MSG_DONTWAIT);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r == 0) {
      return {IoEnd::peer_closed, got, "the connection was closed"};
    } else if (!retry(errno)) {
      return {IoEnd::failed, got, std::strerror(errno)};
    }
  }
  return {IoEnd::done, got, {}};
}

IoResult write_all(int fd, const void* buf, size_t n, Clock::time_point deadline, const std::atomic<bool>* stop) {
  const auto* p = static_cast<const uint8_t*>(buf);
  size_t sent = 0;
  while (sent < n) {
    IoResult w = wait_sliced(fd, POLLOUT, deadline, stop);
    if (!w.ok()) return {w.end, sent, w.reason};
    const ssize_t r = ::send(fd, p + sent, n - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r > 0) {
      sent += static_cast<size_t>(r);
    } else if (r < 0 && !retry(errno)) {
      return {IoEnd::failed, sent, std::strerror(errno)};
    }
  }
  return {IoEnd::done, sent, {}};
}

IoResult write_frame(int fd, model::wire::Message type, const void* payload, size_t bytes, Clock::time_point deadline,
                     const std::atomic<bool>* stop) {
  const auto head = model::wire::encode_frame_header(type, bytes);
  IoResult r = write_all(fd, head.data(), head.size(), deadline, stop);
  if (r.ok() && bytes) r = write_all(fd, payload, bytes, deadline, stop);
  return r;
}

IoResult read_frame(int fd, model::wire::Message& type, std::vector<uint8_t>& payload, uint64_t max_payload_bytes,
                    Clock::time_point deadline, const std::atomic<bool>* stop) {
  std::array<uint8_t, model::wire::kFrameHeaderBytes> head{};
  IoResult r = read_exact(fd, head.data(), head.size(), deadline, stop);
  if (!r.ok()) return r;
  const model::wire::FrameHeader h = model::wire::decode_frame_header(head, max_payload_bytes);
  type = h.type;
  payload.resize(static_cast<size_t>(h.payload_bytes));
  r = read_exact(fd, payload.data(), payload.size(), deadline, stop);
  r.bytes += head.size();
  return r;
}

}  // namespace kiln::backend::tcp
