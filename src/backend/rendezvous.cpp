#include "backend/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <cerrno>
#include <cstring>
#include <map>
#include <thread>

#include "core/error.h"
#include "core/log.h"

namespace kiln::backend {

namespace {

using Clock = std::chrono::steady_clock;
constexpr char kMagic[8] = {'K', 'I', 'L', 'N', 'R', 'D', 'V', '1'};
constexpr uint32_t kMaxFingerprint = 4096;
constexpr uint32_t kMaxBlob = 1u << 20;
constexpr uint8_t kOk = 0, kRefused = 1;

std::string seconds(std::chrono::milliseconds ms) { return fmt::format("{:g} s", ms.count() / 1000.0); }

// A socket closed when it goes out of scope.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd = o.fd;
      o.fd = -1;
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  void reset() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

// Waits until fd is readable (POLLIN) or writable (POLLOUT); false on time-out.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, remaining_ms(deadline));
    if (r > 0) return true;
    if (r == 0) return false;
    if (errno != EINTR) return false;
  }
}

// Reads exactly n bytes before the deadline; false on time-out or a closed / broken connection (why in `error`).
bool read_exact(int fd, void* buf, size_t n, Clock::time_point deadline, std::string& error) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n) {
    if (!wait_fd(fd, POLLIN, deadline)) {
      error = "timed out";
      return false;
    }
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r == 0) {
      error = "the connection was closed";
      return false;
    }
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      error = std::strerror(errno);
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool write_all(int fd, const void* buf, size_t n, Clock::time_point deadline) {
  const auto* p = static_cast<const uint8_t*>(buf);
  while (n) {
    if (!wait_fd(fd, POLLOUT, deadline)) return false;
    const ssize_t r = ::send(fd, p, n, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  const uint32_t be = htonl(v);
  const auto* b = reinterpret_cast<const uint8_t*>(&be);
  out.insert(out.end(), b, b + 4);
}
bool read_u32(int fd, uint32_t& v, Clock::time_point deadline, std::string& error) {
  uint32_t be = 0;
  if (!read_exact(fd, &be, 4, deadline, error)) return false;
  v = ntohl(be);
  return true;
}

std::string describe(const RendezvousHeader& h) {
  return fmt::format("--nnodes {} --tp-size {}, model '{}'", h.nnodes, h.tp_size, h.fingerprint);
}

// The reply of node 0 to one node: status, then the blob (ok) or the reason (refused).
void send_reply(int fd, uint8_t status, const void* data, size_t n, Clock::time_point deadline) {
  std::vector<uint8_t> msg(kMagic, kMagic + 8);
  msg.push_back(status);
  put_u32(msg, static_cast<uint32_t>(n));
  const auto* d = static_cast<const uint8_t*>(data);
  msg.insert(msg.end(), d, d + n);
  write_all(fd, msg.data(), msg.size(), deadline);  // best effort: a node that left learns nothing
}

// The IPv4 address of `host` (kiln::Error when it does not resolve).
sockaddr_in resolve(const HostPort& hp, const std::string& addr) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(hp.host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res)
    fail("--dist-init-addr {}: cannot resolve host '{}' to an IPv4 address ({}): use node 0's IPv4 address or a host "
         "name every node resolves", addr, hp.host, ::gai_strerror(rc));
  sockaddr_in sa{};
  std::memcpy(&sa, res->ai_addr, sizeof(sa));
  ::freeaddrinfo(res);
  sa.sin_port = htons(static_cast<uint16_t>(hp.port));
  return sa;
}

// Node 0's side. keep: the connections of nodes 1..n-1 are moved into *kept (index = node rank) instead of closed.
std::vector<uint8_t> run_node0(const RendezvousOptions& o, const RendezvousHeader& h, const HostPort& hp,
                               const std::vector<uint8_t>& blob, std::vector<Fd>* kept = nullptr) {
  const Clock::time_point deadline = Clock::now() + o.timeout;
  resolve(hp, o.addr);  // the name must be valid even though node 0 listens on every interface
  Fd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (listener.fd < 0) fail("--dist-init-addr {}: cannot create a socket ({})", o.addr, std::strerror(errno));
  const int one = 1;
  ::setsockopt(listener.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_ANY);
  any.sin_port = htons(static_cast<uint16_t>(hp.port));
  if (::bind(listener.fd, reinterpret_cast<sockaddr*>(&any), sizeof(any)) != 0) {
    const int e = errno;
    if (e == EADDRINUSE)
      fail("--dist-init-addr {}: port {} is already in use on node 0 (another kiln or another program holds it): "
           "pick a free port and pass the same --dist-init-addr to every node", o.addr, hp.port);
    if (e == EACCES)
      fail("--dist-init-addr {}: port {} needs privileges to listen on: use a port above 1023", o.addr, hp.port);
    fail("--dist-init-addr {}: node 0 cannot listen on port {} ({})", o.addr, hp.port, std::strerror(e));
  }
  if (::listen(listener.fd, 64) != 0)
    fail("--dist-init-addr {}: node 0 cannot listen on port {} ({})", o.addr, hp.port, std::strerror(errno));
  KILN_LOG_INFO("rendezvous: node 0 waiting on port {} for {} other node(s) (time-out {})", hp.port, h.nnodes - 1,
                seconds(o.timeout));

  std::map<int, Fd> arrived;  // node rank -> its connection
  // Refuses every node that arrived (and `extra`, the one at fault) with `why`, then fails with it.
  auto refuse_all = [&](const std::string& why, int extra_fd) {
    const Clock::time_point d = Clock::now() + std::chrono::seconds(2);
    for (auto& [rank, fd] : arrived) send_reply(fd.fd, kRefused, why.data(), why.size(), d);
    if (extra_fd >= 0) send_reply(extra_fd, kRefused, why.data(), why.size(), d);
    throw Error(why);
  };
  while (static_cast<int>(arrived.size()) < h.nnodes - 1) {
    if (!wait_fd(listener.fd, POLLIN, deadline)) {
      std::vector<int> missing;
      for (int r = 1; r < h.nnodes; ++r)
        if (!arrived.count(r)) missing.push_back(r);
      refuse_all(fmt::format("rendezvous at {}: node rank(s) {} of {} did not arrive within {} (node 0 waited on port "
                             "{}): check that every node was started with --nnodes {} --node-rank R --dist-init-addr "
                             "{}, that '{}' is node 0's address as the other nodes see it, and that a firewall does "
                             "not block port {}", o.addr, fmt::join(missing, ", "), h.nnodes, seconds(o.timeout),
                             hp.port, h.nnodes, o.addr, hp.host, hp.port), -1);
    }
    sockaddr_in peer{};
    socklen_t len = sizeof(peer);
    Fd conn(::accept4(listener.fd, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC));
    if (conn.fd < 0) continue;
    char ip[INET_ADDRSTRLEN] = "?";
    ::inet_ntop(AF_INET, &peer.sin_addr, ip, sizeof(ip));
    // A silent peer (not a kiln node) is dropped after a few seconds instead of holding the rendezvous.
    const Clock::time_point hello_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(10));
    char magic[8];
    std::string err;
    uint32_t rank = 0, nnodes = 0, tp = 0, fp_len = 0;
    if (!read_exact(conn.fd, magic, 8, hello_deadline, err) || std::memcmp(magic, kMagic, 8) != 0 ||
        !read_u32(conn.fd, rank, hello_deadline, err) || !read_u32(conn.fd, nnodes, hello_deadline, err) ||
        !read_u32(conn.fd, tp, hello_deadline, err) || !read_u32(conn.fd, fp_len, hello_deadline, err) ||
        fp_len > kMaxFingerprint) {
      KILN_LOG_WARN("rendezvous: ignored a connection from {} that is not a kiln node ({})", ip,
                    err.empty() ? "unexpected bytes" : err);
      continue;
    }
    std::string fp(fp_len, '\0');
    if (fp_len && !read_exact(conn.fd, fp.data(), fp_len, hello_deadline, err)) {
      KILN_LOG_WARN("rendezvous: ignored a connection from {} ({})", ip, err);
      continue;
    }
    const RendezvousHeader theirs{static_cast<int>(nnodes), static_cast<int>(tp), fp};
    if (theirs.nnodes != h.nnodes || theirs.tp_size != h.tp_size || theirs.fingerprint != h.fingerprint)
      refuse_all(fmt::format("rendezvous at {}: the nodes disagree: node 0 has {}, node {} ({}) has {}: launch every "
                             "node with the same --nnodes, --tp-size and model", o.addr, describe(h), rank, ip,
                             describe(theirs)), conn.fd);
    if (rank == 0 || static_cast<int>(rank) >= h.nnodes)
      refuse_all(fmt::format("rendezvous at {}: a node at {} says --node-rank {}, but the ranks of the other nodes are "
                             "1 to {} (--nnodes {}; node 0 is this one)", o.addr, ip, rank, h.nnodes - 1, h.nnodes),
                 conn.fd);
    if (arrived.count(static_cast<int>(rank)))
      refuse_all(fmt::format("rendezvous at {}: two nodes say --node-rank {} (the second from {}): give every node its "
                             "own rank", o.addr, rank, ip), conn.fd);
    KILN_LOG_INFO("rendezvous: node {} arrived from {}", rank, ip);
    arrived.emplace(static_cast<int>(rank), std::move(conn));
  }
  const Clock::time_point send_deadline = Clock::now() + std::chrono::seconds(10);
  for (auto& [rank, fd] : arrived) {
    send_reply(fd.fd, kOk, blob.data(), blob.size(), send_deadline);
    if (kept) continue;
    // Wait for the node to close its end (it has read the reply), so the blob is not cut off by our close.
    char c;
    std::string err;
    read_exact(fd.fd, &c, 1, send_deadline, err);
  }
  if (kept) {
    kept->clear();
    kept->resize(static_cast<size_t>(h.nnodes));
    for (auto& [rank, fd] : arrived) (*kept)[static_cast<size_t>(rank)] = std::move(fd);
  }
  KILN_LOG_INFO("rendezvous: all {} nodes agree ({})", h.nnodes, describe(h));
  return blob;
}

// Another node's side. kept: the connection to node 0 is moved there instead of closed.
std::vector<uint8_t> run_node(const RendezvousOptions& o, const RendezvousHeader& h, const HostPort& hp,
                              Fd* kept = nullptr) {
  const Clock::time_point start = Clock::now(), deadline = start + o.timeout;
  const sockaddr_in sa = resolve(hp, o.addr);
  std::string last_error = "no attempt";
  Fd conn;
  while (conn.fd < 0) {
    if (Clock::now() >= deadline)
      fail("rendezvous: node {} could not reach node 0 at {} within {} (last error: {}): start node 0 (--node-rank 0) "
           "with the same --dist-init-addr, check that '{}' is node 0's address and that port {} is open between the "
           "machines", o.node_rank, o.addr, seconds(o.timeout), last_error, hp.host, hp.port);
    Fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (s.fd < 0) fail("rendezvous: cannot create a socket ({})", std::strerror(errno));
    int rc = ::connect(s.fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa));
    if (rc != 0 && errno == EINPROGRESS) {
      const Clock::time_point attempt = std::min(deadline, Clock::now() + std::chrono::seconds(2));
      if (wait_fd(s.fd, POLLOUT, attempt)) {
        int so = 0;
        socklen_t l = sizeof(so);
        ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &so, &l);
        rc = so == 0 ? 0 : -1;
        errno = so;
      } else {
        rc = -1;
        errno = ETIMEDOUT;
      }
    }
    if (rc == 0) {
      conn = std::move(s);
      break;
    }
    last_error = std::strerror(errno);
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(200, remaining_ms(deadline))));
  }
  std::vector<uint8_t> hello(kMagic, kMagic + 8);
  put_u32(hello, static_cast<uint32_t>(o.node_rank));
  put_u32(hello, static_cast<uint32_t>(h.nnodes));
  put_u32(hello, static_cast<uint32_t>(h.tp_size));
  put_u32(hello, static_cast<uint32_t>(h.fingerprint.size()));
  hello.insert(hello.end(), h.fingerprint.begin(), h.fingerprint.end());
  // Node 0 answers once every node arrived: allow the whole time-out from the connection on.
  const Clock::time_point reply_deadline = Clock::now() + o.timeout;
  if (!write_all(conn.fd, hello.data(), hello.size(), reply_deadline))
    fail("rendezvous: node {} lost the connection to node 0 at {} while sending its header", o.node_rank, o.addr);
  char magic[8];
  uint8_t status = 0;
  uint32_t len = 0;
  std::string err;
  if (!read_exact(conn.fd, magic, 8, reply_deadline, err) || std::memcmp(magic, kMagic, 8) != 0 ||
      !read_exact(conn.fd, &status, 1, reply_deadline, err) || !read_u32(conn.fd, len, reply_deadline, err) ||
      len > kMaxBlob)
    fail("rendezvous: node {} got no answer from node 0 at {} within {} of connecting ({}): node 0 waits for every "
         "node; check that all {} nodes were started, and that {} is a kiln node 0", o.node_rank, o.addr,
         seconds(o.timeout), err.empty() ? "not a kiln rendezvous" : err, h.nnodes, o.addr);
  std::vector<uint8_t> payload(len);
  if (len && !read_exact(conn.fd, payload.data(), len, reply_deadline, err))
    fail("rendezvous: node {} lost the connection to node 0 at {} while reading its answer ({})", o.node_rank, o.addr,
         err);
  if (status != kOk)
    fail("rendezvous: node 0 at {} refused node {}: {}", o.addr, o.node_rank,
         std::string(payload.begin(), payload.end()));
  if (kept) *kept = std::move(conn);
  return payload;
}

// The kept connections as a model::NodeLink: frames of [type u8][length u64, little-endian][payload], one mutex per
// direction per peer; every wait polls in short slices so that close() (from any thread) wakes it.
constexpr uint64_t kMaxFrame = uint64_t(4) << 30;

class TcpNodeLink final : public model::NodeLink {
 public:
  TcpNodeLink(int nnodes, int node_rank, std::vector<Fd> fds) : nnodes_(nnodes), node_rank_(node_rank), fds_(std::move(fds)) {
    for (size_t i = 0; i < fds_.size(); ++i) {
      send_mu_.push_back(std::make_unique<std::mutex>());
      recv_mu_.push_back(std::make_unique<std::mutex>());
      if (fds_[i].fd < 0) continue;
      const int one = 1;
      ::setsockopt(fds_[i].fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // small collectives: no Nagle delay
      ::setsockopt(fds_[i].fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
      ::fcntl(fds_[i].fd, F_SETFL, ::fcntl(fds_[i].fd, F_GETFL) | O_NONBLOCK);
    }
  }
  ~TcpNodeLink() override = default;

  int nnodes() const override { return nnodes_; }
  int node_rank() const override { return node_rank_; }

  void send(int peer, uint8_t type, const void* data, size_t bytes) override {
    const int fd = peer_fd(peer, "send to");
    std::lock_guard lock(*send_mu_[static_cast<size_t>(peer)]);
    uint8_t head[9];
    head[0] = type;
    for (int i = 0; i < 8; ++i) head[1 + i] = static_cast<uint8_t>(static_cast<uint64_t>(bytes) >> (8 * i));
    std::string err;
    if (!put(fd, head, sizeof(head), err) || (bytes && !put(fd, data, bytes, err)))
      fail("node {}: sending to node {} failed ({}): the multi-node group is broken; restart every node", node_rank_,
           peer, err);
  }

  std::vector<uint8_t> receive(int peer, uint8_t type, std::chrono::milliseconds timeout) override {
    uint8_t got = 0;
    std::vector<uint8_t> payload;
    if (!receive_any(peer, got, payload, timeout))
      fail("node {}: node {} closed the connection (it stopped or failed): the multi-node group is broken; restart "
           "every node", node_rank_, peer);
    if (got != type)
      fail("node {}: node {} sent a message of type {} where type {} was due: the nodes are out of step (different "
           "kiln versions or a failed step); restart every node", node_rank_, peer, got, type);
    return payload;
  }

  bool receive_any(int peer, uint8_t& type, std::vector<uint8_t>& payload, std::chrono::milliseconds timeout) override {
    const int fd = peer_fd(peer, "receive from");
    std::lock_guard lock(*recv_mu_[static_cast<size_t>(peer)]);
    const bool bounded = timeout.count() > 0;
    const Clock::time_point deadline = Clock::now() + timeout;
    uint8_t head[9];
    size_t got = 0;
    std::string err;
    if (!take(fd, head, sizeof(head), got, bounded, deadline, err)) {
      if (got == 0 && err == "closed") return false;
      fail("node {}: receiving from node {} failed ({}){}", node_rank_, peer, err == "closed" ? "the connection was closed mid-message" : err,
           err == "timed out" ? fmt::format(" after {}", seconds(timeout)) : std::string(": the multi-node group is broken; restart every node"));
    }
    type = head[0];
    uint64_t len = 0;
    for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(head[1 + i]) << (8 * i);
    if (len > kMaxFrame)
      fail("node {}: node {} sent a frame of {} bytes (more than {}): not a kiln node of this version", node_rank_,
           peer, len, kMaxFrame);
    payload.resize(static_cast<size_t>(len));
    got = 0;
    if (len && !take(fd, payload.data(), payload.size(), got, bounded, deadline, err))
      fail("node {}: receiving from node {} failed mid-message ({}): the multi-node group is broken; restart every node",
           node_rank_, peer, err);
    return true;
  }

  void close() override {
    closed_ = true;
    for (Fd& f : fds_)
      if (f.fd >= 0) ::shutdown(f.fd, SHUT_RDWR);  // wakes every poll; the descriptors close with the link
  }
  bool closed() const override { return closed_; }

 private:
  int peer_fd(int peer, const char* what) const {
    if (peer < 0 || peer >= static_cast<int>(fds_.size()) || fds_[static_cast<size_t>(peer)].fd < 0)
      fail("node {}: cannot {} node {}: not a peer of this node (node 0 talks to 1..{}, the others to 0)", node_rank_,
           what, peer, nnodes_ - 1);
    if (closed_) fail("node {}: the multi-node group was closed after a failure; restart every node", node_rank_);
    return fds_[static_cast<size_t>(peer)].fd;
  }
  // Waits for `events` in slices of 100 ms, so close() is noticed; false (why in err) on close or the deadline.
  bool wait(int fd, short events, bool bounded, Clock::time_point deadline, std::string& err) const {
    for (;;) {
      if (closed_) {
        err = "the group was closed after a failure";
        return false;
      }
      int slice = 100;
      if (bounded) {
        const int left = remaining_ms(deadline);
        if (left <= 0) {
          err = "timed out";
          return false;
        }
        slice = std::min(slice, left);
      }
      pollfd p{fd, events, 0};
      const int r = ::poll(&p, 1, slice);
      if (r > 0) return true;
      if (r < 0 && errno != EINTR) {
        err = std::strerror(errno);
        return false;
      }
    }
  }
  bool take(int fd, void* buf, size_t n, size_t& got, bool bounded, Clock::time_point deadline, std::string& err) const {
    auto* p = static_cast<uint8_t*>(buf);
    while (got < n) {
      const ssize_t r = ::recv(fd, p + got, n - got, 0);
      if (r > 0) {
        got += static_cast<size_t>(r);
        continue;
      }
      if (r == 0) {
        err = "closed";
        return false;
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        err = std::strerror(errno);
        return false;
      }
      if (!wait(fd, POLLIN, bounded, deadline, err)) return false;
    }
    return true;
  }
  bool put(int fd, const void* buf, size_t n, std::string& err) const {
    const auto* p = static_cast<const uint8_t*>(buf);
    while (n) {
      const ssize_t r = ::send(fd, p, n, MSG_NOSIGNAL);
      if (r > 0) {
        p += r;
        n -= static_cast<size_t>(r);
        continue;
      }
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
        err = std::strerror(errno);
        return false;
      }
      if (!wait(fd, POLLOUT, false, Clock::time_point{}, err)) return false;
    }
    return true;
  }

  int nnodes_, node_rank_;
  std::vector<Fd> fds_;
  std::vector<std::unique_ptr<std::mutex>> send_mu_, recv_mu_;
  std::atomic<bool> closed_{false};
};

}  // namespace

HostPort parse_dist_init_addr(const std::string& addr) {
  auto bad = [&](const std::string& why) -> HostPort {
    fail("--dist-init-addr '{}': {}; expected host:port, e.g. 10.0.0.1:5000 or node0.example:5000 (node 0's IPv4 "
         "address or host name)", addr, why);
  };
  if (addr.empty()) return bad("empty");
  if (addr.front() == '[') return bad("IPv6 addresses are not supported");
  const size_t colon = addr.rfind(':');
  if (colon == std::string::npos) return bad("no port");
  HostPort hp;
  hp.host = addr.substr(0, colon);
  const std::string port = addr.substr(colon + 1);
  if (hp.host.empty()) return bad("no host");
  if (hp.host.find(':') != std::string::npos) return bad("IPv6 addresses are not supported");
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return bad(fmt::format("port '{}' is not a number", port));
  hp.port = std::stoi(port);
  if (hp.port < 1 || hp.port > 65535) return bad(fmt::format("port {} is outside 1..65535", hp.port));
  return hp;
}

std::string rendezvous_fingerprint(const format::ModelConfig& c) {
  return fmt::format("{}: {} layers, hidden {}, {} experts, vocab {}", c.model_type, c.num_layers, c.hidden_size,
                     c.num_experts, c.vocab_size);
}

std::vector<uint8_t> rendezvous(const RendezvousOptions& o, const RendezvousHeader& h,
                                const std::vector<uint8_t>& blob) {
  if (h.nnodes < 1) fail("--nnodes must be at least 1, got {}", h.nnodes);
  if (o.node_rank < 0 || o.node_rank >= h.nnodes)
    fail("--node-rank {} is outside 0..{} (--nnodes {})", o.node_rank, h.nnodes - 1, h.nnodes);
  if (h.nnodes == 1) return blob;
  if (o.timeout.count() <= 0) fail("rendezvous time-out must be positive");
  if (h.fingerprint.size() > kMaxFingerprint) fail("rendezvous: model fingerprint too long ({} bytes)", h.fingerprint.size());
  const HostPort hp = parse_dist_init_addr(o.addr);
  if (o.node_rank == 0) {
    if (blob.size() > kMaxBlob) fail("rendezvous: blob of {} bytes is larger than {}", blob.size(), kMaxBlob);
    return run_node0(o, h, hp, blob);
  }
  return run_node(o, h, hp);
}

RendezvousLink rendezvous_link(const RendezvousOptions& o, const RendezvousHeader& h, const std::vector<uint8_t>& blob) {
  if (h.nnodes < 2) fail("rendezvous_link: a link needs --nnodes 2 or more (got {})", h.nnodes);
  if (o.node_rank < 0 || o.node_rank >= h.nnodes)
    fail("--node-rank {} is outside 0..{} (--nnodes {})", o.node_rank, h.nnodes - 1, h.nnodes);
  if (o.timeout.count() <= 0) fail("rendezvous time-out must be positive");
  if (h.fingerprint.size() > kMaxFingerprint) fail("rendezvous: model fingerprint too long ({} bytes)", h.fingerprint.size());
  const HostPort hp = parse_dist_init_addr(o.addr);
  RendezvousLink out;
  std::vector<Fd> fds;
  if (o.node_rank == 0) {
    if (blob.size() > kMaxBlob) fail("rendezvous: blob of {} bytes is larger than {}", blob.size(), kMaxBlob);
    out.blob = run_node0(o, h, hp, blob, &fds);
  } else {
    Fd conn;
    out.blob = run_node(o, h, hp, &conn);
    fds.resize(1);
    fds[0] = std::move(conn);
  }
  out.link = std::make_shared<TcpNodeLink>(h.nnodes, o.node_rank, std::move(fds));
  return out;
}

}  // namespace kiln::backend
