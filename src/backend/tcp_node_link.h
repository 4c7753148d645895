// model::NodeLink over TCP connections (the ones the startup rendezvous leaves open, rendezvous.h): node 0 holds one
// connection per other node, the others one to node 0. Messages are model/tp_wire.h frames; one mutex per direction
// per peer (one writer and one reader at a time); TCP_NODELAY (small collectives: no Nagle delay) and keep-alive.
// Every wait polls in short slices, so close() from any thread ends it.
#pragma once
#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "backend/tcp_socket.h"
#include "model/node_link.h"

namespace kiln::backend {

class TcpNodeLink final : public model::NodeLink {
 public:
  // Frames longer than this are refused as not from a kiln node (the largest message is a step's logits reply).
  static constexpr uint64_t kMaxFrameBytes = uint64_t(4) << 30;

  // fds[peer] is the connection to node `peer` (empty Fd: not a peer of this node); the link owns them.
  TcpNodeLink(int nnodes, int node_rank, std::vector<tcp::Fd> fds);

  int nnodes() const override { return nnodes_; }
  int node_rank() const override { return node_rank_; }
  void send(int peer, model::wire::Message type, const void* data, size_t bytes) override;
  std::vector<uint8_t> receive(int peer, model::wire::Message type, std::chrono::milliseconds timeout = {}) override;
  bool receive_any(int peer, model::wire::Message& type, std::vector<uint8_t>& payload,
                   std::chrono::milliseconds timeout = {}) override;
  void close() override;
  bool closed() const override { return closed_; }

 private:
  int peer_fd(int peer, const char* what) const;

  int nnodes_, node_rank_;
  std::vector<tcp::Fd> fds_;
  std::vector<std::unique_ptr<std::mutex>> send_mu_, recv_mu_;
  std::atomic<bool> closed_{false};
};

}  // namespace kiln::backend
