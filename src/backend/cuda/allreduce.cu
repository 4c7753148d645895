// The one-shot all-reduce over peer memory (comm_cuda.h's peer group): every rank copies its piece into its own
// exchange buffer, tells every peer it is there, waits for all peers' notices, then sums all ranks' pieces in rank
// order into its own data. No host involvement, so it is captured inside the decode CUDA graphs.
//
// Synchronisation, per block index b (every launch has kPeerBlocks blocks, so block b's counter advances once per
// call on every rank, and every rank is at the same call number):
//  - epoch = ++counter[b] (the rank's own device memory, touched only by its block b);
//  - block b copies its range into exchange[epoch & 1], fences at system scope, then thread p writes epoch into
//    peer p's flag [b][this rank];
//  - threads p wait until the rank's own flag [b][p] reaches epoch (peer p's block b has published its range);
//  - the sum reads every rank's exchange[epoch & 1] over the range.
// Reuse of exchange[epoch & 1] two calls later is safe: passing call epoch + 1's wait means every peer has started
// its call epoch + 1 kernel, and stream order put that after its whole call-epoch kernel (all blocks, all reads).
// A peer that never arrives: the wait gives up after timeout_ns (0: never) or when the host sets *abort, and traps
// (the CUDA error then surfaces at the next synchronisation) instead of hanging the GPU.
#include <algorithm>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace kiln::cuda::ops {
namespace {

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

constexpr int kThreads = 512;

__global__ void __launch_bounds__(kThreads) peer_all_reduce_kernel(PeerAllReduceArgs a, float* __restrict__ data,
                                                                   int64_t n) {
  __shared__ uint32_t s_epoch;
  const int b = blockIdx.x, tid = threadIdx.x;
  if (tid == 0) {
    const uint32_t e = a.counter[b] + 1;
    a.counter[b] = e;
    s_epoch = e;
  }
  __syncthreads();
  const uint32_t epoch = s_epoch;
  const int parity = static_cast<int>(epoch & 1u);
  // This block's range, whole float4s except possibly the last block's tail.
  const int64_t per = ((n + kPeerBlocks - 1) / kPeerBlocks + 3) / 4 * 4;
  const int64_t begin = min(n, int64_t(b) * per), end = min(n, begin + per);
  float* mine = a.exchange[a.rank] + parity * a.capacity;
  for (int64_t i = begin + tid; i < end; i += kThreads) mine[i] = data[i];
  __threadfence_system();
  __syncthreads();
  if (tid < a.nranks) {
    store_release_sys(a.flags[tid] + b * kPeerMaxRanks + a.rank, epoch);
    const uint32_t* flag = a.flags[a.rank] + b * kPeerMaxRanks + tid;
    const uint64_t start = a.timeout_ns ? global_ns() : 0;
    uint32_t spins = 0;
    while (static_cast<int32_t>(load_acquire_sys(flag) - epoch) < 0) {
      if ((++spins & 1023u) == 0) {
        if (*reinterpret_cast<volatile const uint32_t*>(a.abort)) __trap();
        if (a.timeout_ns && global_ns() - start > a.timeout_ns) __trap();
      }
    }
  }
  __syncthreads();
  for (int64_t i = begin + tid; i < end; i += kThreads) {
    float s = __ldcg(a.exchange[0] + parity * a.capacity + i);
    for (int r = 1; r < a.nranks; ++r) s += __ldcg(a.exchange[r] + parity * a.capacity + i);
    data[i] = s;
  }
}

__global__ void sum_rank_buffers_kernel(PeerInputs a, int64_t n, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float s = a.in[0][i];
    for (int r = 1; r < a.nranks; ++r) s += a.in[r][i];
    out[i] = s;
  }
}

}  // namespace

void preload_all_reduce_kernels() {
  // With lazy module loading (CUDA's default) a kernel's code is loaded at its first launch, and loading may wait
  // for the device's running kernels: a rank's first launch could then wait for a peer's all-reduce that waits for
  // this rank. Querying the attributes loads them now, before any rank launches one.
  cudaFuncAttributes attr;
  KILN_CUDA_CHECK(cudaFuncGetAttributes(&attr, peer_all_reduce_kernel));
  KILN_CUDA_CHECK(cudaFuncGetAttributes(&attr, sum_rank_buffers_kernel));
}

void sum_rank_buffers(const PeerInputs& inputs, int64_t n, float* out, Stream stream) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 1024);
  sum_rank_buffers_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(inputs, n, out);
  KILN_CUDA_CHECK_LAUNCH();
}

void peer_all_reduce(const PeerAllReduceArgs& args, float* data, int64_t n, Stream stream) {
  if (n <= 0) return;
  if (n > args.capacity) cuda_fail("peer all-reduce: {} floats exceed the exchange buffer's {}", {n, args.capacity});
  if (args.nranks < 1 || args.nranks > kPeerMaxRanks) cuda_fail("peer all-reduce: {} ranks", {int64_t(args.nranks)});
  peer_all_reduce_kernel<<<kPeerBlocks, kThreads, 0, stream>>>(args, data, n);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda::ops
