#include "backend/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <thread>

#include "backend/tcp_node_link.h"
#include "backend/tcp_socket.h"
#include "core/error.h"
#include "core/log.h"
#include "model/tp_wire.h"

namespace kiln::backend {

namespace {

using tcp::Clock;
using tcp::Fd;
using model::wire::Message;
constexpr uint32_t kMaxFingerprint = 4096;
constexpr uint32_t kMaxBlob = 1u << 20;
// A hello frame is small; a longer one is not from a kiln node (and is not read into memory).
constexpr uint64_t kMaxHelloBytes = kMaxFingerprint + 64, kMaxAnswerBytes = kMaxBlob + kMaxFingerprint + 64;

std::string seconds(std::chrono::milliseconds ms) { return fmt::format("{:g} s", ms.count() / 1000.0); }

std::string describe(const RendezvousHeader& h) {
  return fmt::format("--nnodes {} --tp-size {}, model '{}'", h.nnodes, h.tp_size, h.fingerprint);
}

// Node 0's answer to one node: the blob, or why it refused the node. Best effort: a node that left learns nothing.
void send_answer(int fd, const model::wire::RendezvousAnswer& answer, Clock::time_point deadline) {
  const std::vector<uint8_t> msg = model::wire::encode_rendezvous_answer(answer);
  tcp::write_frame(fd, Message::rendezvous_answer, msg.data(), msg.size(), deadline);
}
void send_refusal(int fd, const std::string& why, Clock::time_point deadline) {
  send_answer(fd, model::wire::RendezvousAnswer{false, {}, why}, deadline);
}

// One node's hello from a new connection; the reason (empty: none) when it is not a kiln node of this version.
std::string read_hello(int fd, Clock::time_point deadline, model::wire::NodeHello& hello) {
  Message type{};
  std::vector<uint8_t> payload;
  try {
    const tcp::IoResult r = tcp::read_frame(fd, type, payload, kMaxHelloBytes, deadline);
    if (!r.ok()) return r.reason;
    if (type != Message::rendezvous_hello)
      return fmt::format("a {} message where a rendezvous hello was due", model::wire::message_name(type));
    hello = model::wire::decode_node_hello(payload);
  } catch (const Error& e) {
    return e.what();
  }
  return {};
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
    for (auto& [rank, fd] : arrived) send_refusal(fd.fd, why, d);
    if (extra_fd >= 0) send_refusal(extra_fd, why, d);
    throw Error(why);
  };
  while (static_cast<int>(arrived.size()) < h.nnodes - 1) {
    if (!tcp::wait_fd(listener.fd, POLLIN, deadline)) {
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
    model::wire::NodeHello hello;
    const std::string err = read_hello(conn.fd, hello_deadline, hello);
    if (!err.empty()) {
      KILN_LOG_WARN("rendezvous: ignored a connection from {} that is not a kiln node ({})", ip, err);
      continue;
    }
    const int rank = hello.node_rank;
    const RendezvousHeader theirs{hello.nnodes, hello.tp_size, hello.fingerprint};
    if (theirs.nnodes != h.nnodes || theirs.tp_size != h.tp_size || theirs.fingerprint != h.fingerprint)
      refuse_all(fmt::format("rendezvous at {}: the nodes disagree: node 0 has {}, node {} ({}) has {}: launch every "
                             "node with the same --nnodes, --tp-size and model", o.addr, describe(h), rank, ip,
                             describe(theirs)), conn.fd);
    if (rank <= 0 || rank >= h.nnodes)
      refuse_all(fmt::format("rendezvous at {}: a node at {} says --node-rank {}, but the ranks of the other nodes are "
                             "1 to {} (--nnodes {}; node 0 is this one)", o.addr, ip, rank, h.nnodes - 1, h.nnodes),
                 conn.fd);
    if (arrived.count(rank))
      refuse_all(fmt::format("rendezvous at {}: two nodes say --node-rank {} (the second from {}): give every node its "
                             "own rank", o.addr, rank, ip), conn.fd);
    KILN_LOG_INFO("rendezvous: node {} arrived from {}", rank, ip);
    arrived.emplace(rank, std::move(conn));
  }
  const Clock::time_point send_deadline = Clock::now() + std::chrono::seconds(10);
  for (auto& [rank, fd] : arrived) {
    send_answer(fd.fd, model::wire::RendezvousAnswer{true, blob, {}}, send_deadline);
    if (kept) continue;
    // Wait for the node to close its end (it has read the reply), so the blob is not cut off by our close.
    char c;
    tcp::read_exact(fd.fd, &c, 1, send_deadline);
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
      if (tcp::wait_fd(s.fd, POLLOUT, attempt)) {
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
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(200, tcp::remaining_ms(deadline))));
  }
  const std::vector<uint8_t> hello =
      model::wire::encode_node_hello({o.node_rank, h.nnodes, h.tp_size, h.fingerprint});
  // Node 0 answers once every node arrived: allow the whole time-out from the connection on.
  const Clock::time_point reply_deadline = Clock::now() + o.timeout;
  if (!tcp::write_frame(conn.fd, Message::rendezvous_hello, hello.data(), hello.size(), reply_deadline).ok())
    fail("rendezvous: node {} lost the connection to node 0 at {} while sending its header", o.node_rank, o.addr);
  Message type{};
  std::vector<uint8_t> payload;
  model::wire::RendezvousAnswer answer;
  std::string err;
  try {
    const tcp::IoResult r = tcp::read_frame(conn.fd, type, payload, kMaxAnswerBytes, reply_deadline);
    if (!r.ok())
      err = r.reason;
    else if (type != Message::rendezvous_answer)
      err = fmt::format("a {} message where the rendezvous answer was due", model::wire::message_name(type));
    else
      answer = model::wire::decode_rendezvous_answer(payload);
  } catch (const Error& e) {
    err = e.what();
  }
  if (!err.empty())
    fail("rendezvous: node {} got no answer from node 0 at {} within {} of connecting ({}): node 0 waits for every "
         "node; check that all {} nodes were started, and that {} is a kiln node 0 of the same version", o.node_rank,
         o.addr, seconds(o.timeout), err, h.nnodes, o.addr);
  if (!answer.accepted) fail("rendezvous: node 0 at {} refused node {}: {}", o.addr, o.node_rank, answer.refusal);
  if (kept) *kept = std::move(conn);
  return answer.blob;
}

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

namespace {
// The checks both entry points make before any socket; the parsed address.
HostPort check_launch(const RendezvousOptions& o, const RendezvousHeader& h, const std::vector<uint8_t>& blob) {
  if (o.timeout.count() <= 0) fail("rendezvous time-out must be positive");
  if (h.fingerprint.size() > kMaxFingerprint)
    fail("rendezvous: model fingerprint too long ({} bytes)", h.fingerprint.size());
  if (o.node_rank == 0 && blob.size() > kMaxBlob)
    fail("rendezvous: blob of {} bytes is larger than {}", blob.size(), kMaxBlob);
  return parse_dist_init_addr(o.addr);
}
void check_node_rank(const RendezvousOptions& o, const RendezvousHeader& h) {
  if (o.node_rank < 0 || o.node_rank >= h.nnodes)
    fail("--node-rank {} is outside 0..{} (--nnodes {})", o.node_rank, h.nnodes - 1, h.nnodes);
}
}  // namespace

std::vector<uint8_t> rendezvous(const RendezvousOptions& o, const RendezvousHeader& h,
                                const std::vector<uint8_t>& blob) {
  if (h.nnodes < 1) fail("--nnodes must be at least 1, got {}", h.nnodes);
  check_node_rank(o, h);
  if (h.nnodes == 1) return blob;
  const HostPort hp = check_launch(o, h, blob);
  return o.node_rank == 0 ? run_node0(o, h, hp, blob) : run_node(o, h, hp);
}

RendezvousLink rendezvous_link(const RendezvousOptions& o, const RendezvousHeader& h,
                               const std::vector<uint8_t>& blob) {
  if (h.nnodes < 2) fail("rendezvous_link: a link needs --nnodes 2 or more (got {})", h.nnodes);
  check_node_rank(o, h);
  const HostPort hp = check_launch(o, h, blob);
  RendezvousLink out;
  std::vector<Fd> fds;
  if (o.node_rank == 0) {
    out.blob = run_node0(o, h, hp, blob, &fds);
  } else {
    fds.resize(1);
    out.blob = run_node(o, h, hp, &fds[0]);
  }
  out.link = std::make_shared<TcpNodeLink>(h.nnodes, o.node_rank, std::move(fds));
  return out;
}

}  // namespace kiln::backend
