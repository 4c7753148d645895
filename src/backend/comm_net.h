// The host communicator of a tensor-parallel group that spans machines (--nnodes > 1 with the CPU backend): each
// node's ranks are threads of its process (like comm_local.h), and the nodes meet over the group's message channel
// (model/node_link.h, a star around node 0). The CPU backend's multi-node runs are the oracle and the CI test of the
// multi-node path (the CUDA backend uses NCCL across machines instead).
//
// Each collective: the node's ranks post their buffers; the last to arrive exchanges them with node 0 (every other
// node sends its ranks' buffers; node 0 sums all ranks' buffers in global rank order, ((x0 + x1) + x2) + ..., the
// order of comm_local.h, and sends the sum back), then writes the result into every local buffer. So the result
// is bitwise the same on every rank of every node and equal to the one-process group's.
//
// Failures: a collective waits at most the time-out (set_timeout) for the local ranks and for the other nodes;
// abort() closes the link (the other nodes' waits fail too): a multi-node group that failed cannot be reset, every
// node must restart. The messages are model/tp_wire.h's collective_up / collective_down.
#pragma once
#include <chrono>
#include <memory>
#include <vector>

#include "model/comm.h"
#include "model/node_link.h"

namespace kiln::backend {

// One communicator per local rank (index = local rank; rank() = node_rank x local + index, size() = tp) of a group
// of `tp` ranks over link->nnodes() nodes, tp / nnodes on each.
std::vector<std::unique_ptr<model::Communicator>> make_net_group(int tp, std::shared_ptr<model::NodeLink> link,
                                                                 std::chrono::milliseconds timeout);

}  // namespace kiln::backend
