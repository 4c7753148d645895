#include "backend/tcp_node_link.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <fmt/format.h>

#include "core/error.h"

namespace kiln::backend {

using model::wire::Message;

namespace {
std::string seconds(std::chrono::milliseconds ms) { return fmt::format("{:g} s", ms.count() / 1000.0); }
}  // namespace

TcpNodeLink::TcpNodeLink(int nnodes, int node_rank, std::vector<tcp::Fd> fds)
    : nnodes_(nnodes), node_rank_(node_rank), fds_(std::move(fds)) {
  for (const tcp::Fd& f : fds_) {
    send_mu_.push_back(std::make_unique<std::mutex>());
    recv_mu_.push_back(std::make_unique<std::mutex>());
    if (f.fd < 0) continue;
    const int one = 1;
    ::setsockopt(f.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ::setsockopt(f.fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    ::fcntl(f.fd, F_SETFL, ::fcntl(f.fd, F_GETFL) | O_NONBLOCK);
  }
}

void TcpNodeLink::send(int peer, Message type, const void* data, size_t bytes) {
  const int fd = peer_fd(peer, "send to");
  std::lock_guard lock(*send_mu_[static_cast<size_t>(peer)]);
  const tcp::IoResult r = tcp::write_frame(fd, type, data, bytes, tcp::kNoDeadline, &closed_);
  if (!r.ok())
    fail("node {}: sending a {} message to node {} failed ({}): the multi-node group is broken; restart every node",
         node_rank_, model::wire::message_name(type), peer, r.reason);
}

std::vector<uint8_t> TcpNodeLink::receive(int peer, Message type, std::chrono::milliseconds timeout) {
  Message got{};
  std::vector<uint8_t> payload;
  if (!receive_any(peer, got, payload, timeout))
    fail("node {}: node {} closed the connection (it stopped or failed): the multi-node group is broken; restart "
         "every node", node_rank_, peer);
  if (got != type)
    fail("node {}: node {} sent a {} message where a {} message was due: the nodes are out of step (different kiln "
         "versions or a failed step); restart every node", node_rank_, peer, model::wire::message_name(got),
         model::wire::message_name(type));
  return payload;
}

bool TcpNodeLink::receive_any(int peer, Message& type, std::vector<uint8_t>& payload,
                              std::chrono::milliseconds timeout) {
  const int fd = peer_fd(peer, "receive from");
  std::lock_guard lock(*recv_mu_[static_cast<size_t>(peer)]);
  const tcp::Clock::time_point deadline = timeout.count() > 0 ? tcp::Clock::now() + timeout : tcp::kNoDeadline;
  tcp::IoResult r;
  try {
    r = tcp::read_frame(fd, type, payload, kMaxFrameBytes, deadline, &closed_);
  } catch (const Error& e) {
    fail("node {}: receiving from node {}: {}", node_rank_, peer, e.what());
  }
  if (r.ok()) return true;
  // close() here shuts the sockets down, which reads as the peer closing: say which it was.
  if (closed_) fail("node {}: the multi-node group was closed after a failure; restart every node", node_rank_);
  if (r.end == tcp::IoEnd::peer_closed && r.bytes == 0) return false;
  if (r.end == tcp::IoEnd::timed_out)
    fail("node {}: receiving from node {} failed (timed out after {})", node_rank_, peer, seconds(timeout));
  fail("node {}: receiving from node {} failed ({}{}): the multi-node group is broken; restart every node", node_rank_,
       peer, r.reason, r.bytes ? " mid-message" : "");
}

void TcpNodeLink::close() {
  closed_ = true;
  for (tcp::Fd& f : fds_)
    if (f.fd >= 0) ::shutdown(f.fd, SHUT_RDWR);  // wakes every poll; the descriptors close with the link
}

int TcpNodeLink::peer_fd(int peer, const char* what) const {
  if (peer < 0 || peer >= static_cast<int>(fds_.size()) || fds_[static_cast<size_t>(peer)].fd < 0)
    fail("node {}: cannot {} node {}: not a peer of this node (node 0 talks to 1..{}, the others to 0)", node_rank_,
         what, peer, nnodes_ - 1);
  if (closed_) fail("node {}: the multi-node group was closed after a failure; restart every node", node_rank_);
  return fds_[static_cast<size_t>(peer)].fd;
}

}  // namespace kiln::backend
