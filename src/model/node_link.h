// The message channel between the machines of a tensor-parallel group that spans several (--nnodes > 1), as an
// interface: the model layer says what it needs, backend/rendezvous.h provides it over TCP.
//
// Node 0 runs the scheduler: its TpRunner sends each step to every other node and reads back their ranks' results
// (tp_runner.h); the other nodes run no scheduler, only their ranks, step by step. A host communicator that spans
// the machines (backend/comm_net.h, the CPU backend's) sends its collectives over the same channel. Messages
// between two nodes arrive whole and in the order sent; both ends follow the same sequence (a step, its
// collectives, its reply), so a message of an unexpected type means the nodes are out of step: kiln::Error. The
// message types and payloads are model/tp_wire.h's.
//
// Topology: a star. Node 0 talks to every node; the others talk only to node 0 (peer 0).
#pragma once
#include <chrono>
#include <cstdint>
#include <vector>

#include "model/tp_wire.h"

namespace kiln::model {

class NodeLink {
 public:
  virtual ~NodeLink() = default;
  virtual int nnodes() const = 0;
  virtual int node_rank() const = 0;
  // One message of `type` to node `peer` (node 0: 1..nnodes - 1; any other node: 0). kiln::Error when the
  // connection is closed or broken. Safe to call from any thread (one writer per peer at a time).
  virtual void send(int peer, wire::Message type, const void* data, size_t bytes) = 0;
  // The next message from `peer`, which must be of `type`. timeout 0: wait until it comes. kiln::Error on a time-out,
  // a closed or broken connection, a message of another type, or after close().
  virtual std::vector<uint8_t> receive(int peer, wire::Message type, std::chrono::milliseconds timeout = {}) = 0;
  // The next message from `peer` of any type (timeout 0: wait). false when the peer closed the connection cleanly
  // between messages (it has stopped); kiln::Error when it broke mid-message or after close().
  virtual bool receive_any(int peer, wire::Message& type, std::vector<uint8_t>& payload,
                           std::chrono::milliseconds timeout = {}) = 0;
  // Breaks every connection: every waiting and later send / receive throws, here and (through the closed sockets)
  // on the other nodes. A group whose link is closed cannot be used again; every node must restart.
  virtual void close() = 0;
  virtual bool closed() const = 0;
};

}  // namespace kiln::model
