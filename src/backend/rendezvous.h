// Startup rendezvous of several machines (--nnodes, --node-rank, --dist-init-addr host:port; SGLang's names):
// node 0 listens on the address's port, every other node connects to it (retrying until the time-out), each sends
// its hello (node rank, nnodes, tp size, a model fingerprint; model/tp_wire.h messages), node 0 checks that all agree
// and sends every node the same blob (the NCCL unique id). Host-only POSIX TCP sockets (IPv4 addresses and host
// names; backend/tcp_socket.h); no CUDA, no NCCL here. Every wait has a time-out: a node that never comes, a peer
// that hangs or a mismatched launch is a kiln::Error that names the node ranks and numbers on both sides and what to
// check.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "format/model_config.h"
#include "model/node_link.h"

namespace kiln::backend {

struct HostPort {
  std::string host;
  int port = 0;
};
// Parses "host:port" (IPv4 address or host name; port 1..65535); kiln::Error naming what is wrong otherwise.
HostPort parse_dist_init_addr(const std::string& addr);

// What every node must agree on.
struct RendezvousHeader {
  int nnodes = 1;
  int tp_size = 1;
  std::string fingerprint;  // the model (rendezvous_fingerprint), so nodes of different models do not pair up
};
// A short description of the model's shape ("qwen3_5_moe: 60 layers, hidden 4096, 512 experts, vocab 248320").
std::string rendezvous_fingerprint(const format::ModelConfig& config);

struct RendezvousOptions {
  std::string addr;  // --dist-init-addr host:port (node 0 listens on this port on every interface)
  int node_rank = 0;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // for the whole rendezvous, on every node
};

// Runs the rendezvous of header.nnodes nodes. Node 0 passes the blob (at most 1 MiB) and gets it back; the others
// pass anything (ignored) and get node 0's blob. header.nnodes == 1 returns the blob at once.
std::vector<uint8_t> rendezvous(const RendezvousOptions& options, const RendezvousHeader& header,
                                const std::vector<uint8_t>& blob);

// The same rendezvous, keeping the connections open as the group's message channel (model/node_link.h: node 0
// linked to every node, the others to node 0: tcp_node_link.h). header.nnodes must be 2 or more.
struct RendezvousLink {
  std::vector<uint8_t> blob;
  std::shared_ptr<model::NodeLink> link;
};
RendezvousLink rendezvous_link(const RendezvousOptions& options, const RendezvousHeader& header,
                               const std::vector<uint8_t>& blob);

}  // namespace kiln::backend
