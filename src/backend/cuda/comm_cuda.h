// The CUDA tensor-parallel group: model::Communicator (model/comm.h) for N ranks of this process, rank r on CUDA
// device devices[r], each calling from its own thread with its own stream. Two transports:
//  - peer: the one-shot all-reduce over peer memory (allreduce.cu; what SGLang and vLLM call the custom
//    all-reduce) for GPUs that can map each other's memory (NVLink / PCIe peer access): the ranks' kernels meet on
//    the GPUs, no host step, so it is captured in the decode CUDA graphs. Ranks that share one GPU (the correctness
//    runs on one H200) meet on the host instead (events and two host barriers per call; graphs off).
//  - nccl: NCCL (loaded at run time, libnccl.so.2; distinct GPUs only: NCCL refuses two ranks on one GPU),
//    started with NCCL_NVLS_ENABLE=0 (NVLink multicast off; the GPU machines here require it).
// auto: peer for messages up to peer_max_bytes and NCCL above it when both are usable, else whichever is.
// Every collective sums in rank order on the peer path (bitwise the same on every rank); NCCL's order is its own
// (also the same on every rank).
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/comm.h"

namespace kiln::backend::cuda {

struct CudaGroupOptions {
  std::vector<int> devices;  // rank r's CUDA device; the same device may appear several times (peer only)
  enum class Transport { automatic, peer, nccl };
  Transport transport = Transport::automatic;  // nccl: --disable-custom-all-reduce (SGLang's flag)
  int64_t peer_max_bytes = int64_t(8) << 20;   // automatic: larger all-reduces go to NCCL when it is usable
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};  // startup; set_timeout changes it
  // Ranks that share a GPU use the host-coordinated peer all-reduce (not capturable: CUDA graphs stay off for
  // them). Tests and bench_allreduce set this to run the GPU-waiting kernel of distinct GPUs on one GPU instead,
  // in a fresh process: after many other streams and kernels in the same process it has timed out (the ranks'
  // kernels did not all run at once; queued behind one another in shared hardware work queues is the likely
  // cause, not confirmed), and the timeout's trap breaks the process's CUDA context. Distinct GPUs are not affected.
  bool spin_on_shared_gpu = false;
  // Several machines (--nnodes > 1): these devices are ranks first_rank.. of a group of world_size over all the
  // nodes, joined by NCCL only (NCCL's own transports between machines and within one); nccl_id is node 0's
  // nccl_unique_id(), passed to every node by the rendezvous. world_size 0: one machine.
  int world_size = 0;
  int first_rank = 0;
  std::vector<uint8_t> nccl_id;
};

// A fresh NCCL unique id (node 0 of several machines), as bytes for the rendezvous; kiln::Error without NCCL.
std::vector<uint8_t> nccl_unique_id();

// The group (index = rank). kiln::Error naming the devices when the transport cannot join them (no peer access and
// no NCCL, NCCL asked for ranks sharing a GPU, NCCL init failing or timing out).
std::vector<std::unique_ptr<model::Communicator>> make_cuda_group(const CudaGroupOptions& options);

// The transports a group of these options uses, for the startup summary ("peer (one-shot, <= 8 MiB) + NCCL 2.28.3").
std::string describe_cuda_group(const CudaGroupOptions& options);

// Whether NCCL can be loaded here (reason: why not, or its version).
bool nccl_available(std::string* reason = nullptr);

// For benchmarks: N ranks whose all-reduce is one device-to-device copy of the same size, no peers (a single rank
// of a larger group timed alone: `kiln bench-engine --single-rank`). rank / size are the simulated group's.
std::unique_ptr<model::Communicator> make_copy_communicator(int rank, int size);

// For benchmarks (bench_allreduce, `kiln bench-engine --single-rank`): the latency of one all_reduce_sum of each size
// in `floats` over a fresh group of `options`, one thread and stream per rank, as a decode step runs it: `iters`
// all-reduces captured in one CUDA graph per rank, replayed once to warm up, then 5 timed replays (the ranks meet on
// the host barrier before each); the median replay / iters. Ranks sharing a GPU need options.spin_on_shared_gpu (and a
// process that has run little else on the GPU; see above). kiln::Error naming the rank when one fails.
struct AllReduceTiming {
  int64_t floats = 0;
  double rank0_us = 0;    // rank 0's median, microseconds per all-reduce
  double slowest_us = 0;  // the slowest rank's median
};
std::vector<AllReduceTiming> time_all_reduce(const CudaGroupOptions& options, const std::vector<int64_t>& floats,
                                             int iters);

}  // namespace kiln::backend::cuda
