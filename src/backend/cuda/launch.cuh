// Kernel launches of the CudaOps kernels (launch_kernel(): checked cudaLaunchKernelEx), with programmatic dependent
// launch (PDL, sm_90+) inside CUDA graph captures.
//
// Every kernel launched through launch_kernel() begins with dev::pdl_enter() as its FIRST statement, before any global
// load or store and before any early return (one exception: gemv_stream_kernel first asks L2 to prefetch its own
// weight rows, static memory no kernel writes, from the launch's parameters alone; a prefetch returns no data and
// cannot make anything stale: linear.cu, CudaOptions::weight_prefetch). With the PDL attribute, a kernel's blocks may be scheduled while the
// previous kernel is still running; griddepcontrol.wait then blocks until that kernel has completed and its memory is
// visible, so what overlaps is the launch and the block start-up. Because every such kernel waits before it exits,
// "completed" is transitive down the chain. After its wait a kernel calls griddepcontrol.launch_dependents, which lets
// the NEXT kernel's blocks be scheduled while this one runs (only once all of this grid's blocks have started).
//
// Where the attribute is set: only on launches recorded into a CUDA graph (the decode and verify steps) by a runtime
// with PDL on (CudaOptions::pdl; on by default, `--disable-pdl`), and only for grids of at most kPdlMaxBlocks blocks
// (griddepcontrol.wait costs every block ~1 us even when the previous kernel is long done; a grid of many waves would
// pay it per wave): the kernel's own wait uses the same rule on gridDim. In a graph a programmatic edge exists only
// between two kernel nodes; a copy, memset or library GEMM before the kernel keeps a full edge. An earlier version
// set the attribute on eager launches too, after copies made outside CudaOps, and served wrong tokens in some fresh
// servers (docs/perf/cuda-ops.md); eager launches now keep plain stream order.
//
// Non-coherent loads: nvcc reads a `const T* __restrict__` kernel argument through ld.global.nc, which assumes the
// memory does not change while the kernel runs; under PDL the kernel starts while the previous one still writes.
// argmax_chunk_kernel (sampling.cu), whose sixteen loads per thread depend on nothing but its arguments, read stale
// logits that way and gave wrong argmaxes in captured draft / verify chains, deterministically (found by giving the
// attribute to one launch of the graph at a time; H100, 2026-12-07; docs/perf/decode-latency.md). In the PTX its loads
// follow griddepcontrol.wait, so either ptxas scheduled them ahead of it or the non-coherent cache served lines from
// before it: which one was not determined. The sampling kernels now read the previous kernel's output with coherent
// loads (__ldcg, pointers without __restrict__), and test_cuda runs the captured-step tests with PDL on too, against
// eager launches bit for bit.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <utility>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace kiln::cuda::ops {

constexpr unsigned long long kPdlMaxBlocks = 1024;

namespace dev {
// Whether this grid may have been launched with the PDL attribute (see above): uniform over the grid.
__device__ __forceinline__ bool pdl_grid() {
  return static_cast<unsigned long long>(gridDim.x) * gridDim.y * gridDim.z <= kPdlMaxBlocks;
}
// First statement of every launch_kernel() kernel: wait for the previous kernel (a no-op without the attribute), then
// let the next one's blocks start.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (pdl_grid()) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
#endif
}
}  // namespace dev

// kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute where pdl_launches_now() (see above); errors
// throw at the launch site as KILN_CUDA_CHECK does.
template <typename... Params, typename... Args>
inline void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Stream stream,
                          Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  const unsigned long long blocks = static_cast<unsigned long long>(grid.x) * grid.y * grid.z;
  // The thread's flag, checked against the stream itself: never the attribute on an eager launch.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (pdl_launches_now() && blocks <= kPdlMaxBlocks) KILN_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  cfg.numAttrs = capture == cudaStreamCaptureStatusActive ? 1 : 0;
  KILN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// Raises `kernel`'s dynamic shared memory limit to `bytes`. The limit is a per-device attribute: set once per device
// (per kernel instantiation: `configured`, the caller's static set of devices done), so every GPU of a
// tensor-parallel group gets it.
template <typename... Params>
inline void set_dynamic_smem_once(void (*kernel)(Params...), size_t bytes, std::atomic<uint64_t>& configured) {
  int device = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit && (configured.load(std::memory_order_acquire) & bit)) return;
  KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  configured.fetch_or(bit, std::memory_order_release);
}

// Blocks for a grid-stride loop over n items, `block` threads each: at least 1, at most 65,536.
inline unsigned capped_grid(int64_t n, int block = 256) {
  const int64_t g = (n + block - 1) / block;
  return static_cast<unsigned>(g < 65536 ? (g > 0 ? g : 1) : 65536);
}

// Consecutive 256-byte-aligned pieces of one workspace; with a null base only the bytes are counted (a kernel family's
// workspace-size function runs the same carve as its launch).
struct WorkspaceCarve {
  char* base;
  size_t bytes = 0;
  explicit WorkspaceCarve(void* b) : base(static_cast<char*>(b)) {}
  void* take(size_t n) {
    void* p = base ? base + bytes : nullptr;
    bytes += (n + 255) / 256 * 256;
    return p;
  }
};

}  // namespace kiln::cuda::ops
