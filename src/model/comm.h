// The collectives a tensor-parallel rank needs from its group, as an interface: the model layer says what it needs
// (like ops.h), backends provide it. Implementations: backend/comm_local.h (N ranks as threads of one process, host
// memory: the CPU backend and the oracle); NCCL / peer-memory all-reduce for GPUs come behind the same interface.
//
// Contract
//  - Every rank of a group calls the same collectives in the same order (the runners run in lockstep); a collective
//    returns on a rank once every rank has joined it.
//  - Buffers are the rank's own memory: host memory for the CPU backend, the rank's device memory for a GPU
//    backend. `stream` is the rank's queue to enqueue on (a cudaStream_t for CUDA, passed as void* so no CUDA type
//    is named here); nullptr: run synchronously on the calling thread. A host implementation ignores it.
//  - all_reduce_sum adds in rank order (((x0 + x1) + x2) + ...) for every element: the result is bitwise the same
//    on every rank and does not depend on thread timing.
//  - A collective that waits longer than the time-out (set_timeout; 0 = wait forever) throws kiln::Error naming the
//    collective and the ranks that did not arrive. abort() (from any thread) makes every waiting and later
//    collective throw GroupAborted until reset(): a rank that fails must not leave the others hanging. A caller
//    that picks the reason of a failed step skips GroupAborted (it only follows another rank's own error).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace kiln::model {

// A collective that stopped because the group was aborted (another rank failed), not for a reason of its own.
class GroupAborted : public Error {
 public:
  explicit GroupAborted(const std::string& msg) : Error(msg) {}
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // data[i] = sum over ranks of data[i], in place (F32, count elements).
  virtual void all_reduce_sum(float* data, int64_t count, void* stream = nullptr) = 0;
  // out[r * bytes, (r + 1) * bytes) = rank r's in[0, bytes), on every rank. out holds size() * bytes.
  virtual void all_gather(const void* in, int64_t bytes, void* out, void* stream = nullptr) = 0;
  virtual void barrier() = 0;
  // Whether all_reduce_sum may be captured in a CUDA graph (no host step inside it). A backend captures steps only
  // over a communicator that says so.
  virtual bool capturable() const { return false; }
  virtual void set_timeout(std::chrono::milliseconds timeout) = 0;
  virtual void abort() = 0;
  virtual void reset() = 0;
};

}  // namespace kiln::model
