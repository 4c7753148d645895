// Kernel launches of the CudaOps kernels with programmatic dependent launch (PDL, sm_90+).
//
// Every CudaOps kernel is launched through launch_kernel() and begins with dev::pdl_wait() as its FIRST statement
// (before any global load or store, before any early return). With PDL on, a kernel's blocks may be scheduled
// while the previous kernel in the stream is still running; pdl_wait() (griddepcontrol.wait) blocks until that
// kernel has completed and its memory is visible, so the only thing that overlaps is the launch itself and the
// block start-up. Because every kernel waits before it exits, "completed" is transitive down the stream: kernel
// N + 2 waits for N + 1, which could not finish before N did. After its wait a kernel calls dev::pdl_trigger()
// (griddepcontrol.launch_dependents), which lets the NEXT kernel's blocks be scheduled while this one runs.
// Kernels launched another way (cuBLASLt, memcpy / memset nodes) are ordered as usual: the attribute only relaxes
// kernel -> kernel edges, and a waiting kernel still waits for a library kernel to complete.
//
// Only grids of at most kPdlMaxBlocks blocks take part: griddepcontrol.wait costs every block about a microsecond
// even when the previous kernel is long done, so a kernel of many waves of short blocks pays it once per wave. The
// launch sets the attribute and the kernel waits under the same rule (the grid's size, known to both sides); larger
// grids launch in plain stream order and skip both instructions.
//
// The attribute is set only when the stream's previous operation was also a launch_kernel() kernel: CudaOps and
// CudaRuntime mark every copy, memset, graph launch and cuBLASLt call (pdl_note_other_op), after which the next
// launch keeps plain stream order (with the attribute after copies / memsets too, serving gave wrong tokens).
//
// OFF by default; --enable-pdl (CudaOptions::pdl) turns it on, as an experiment: with it on, `kiln serve` on kiln-tiny
// has given wrong tokens in some fresh-server smoke runs (tools/gpu/smoke_loop.sh) while every CUDA test passed, and
// the cause is not known (docs/perf/cuda-ops.md has the runs). Without the attribute the kernels' wait instructions
// return at once.
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace kiln::cuda::ops {

constexpr unsigned long long kPdlMaxBlocks = 1024;

namespace dev {
// Whether this grid was launched with the PDL attribute (see above): uniform over the grid.
__device__ __forceinline__ bool pdl_grid() {
  return static_cast<unsigned long long>(gridDim.x) * gridDim.y * gridDim.z <= kPdlMaxBlocks;
}
// First statement of every CudaOps kernel (see above).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel in the stream start its blocks early (they wait in pdl_wait()).
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Both, in order, for grids launched with the attribute: the usual kernel prologue.
__device__ __forceinline__ void pdl_enter() {
  if (pdl_grid()) {
    pdl_wait();
    pdl_trigger();
  }
}
}  // namespace dev

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute when pdl_enabled(); errors throw at the
// launch site as KILN_CUDA_CHECK does.
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
  // The attribute only between two of our kernels adjacent in the stream (after a copy, memset or library GEMM the
  // launch keeps plain stream order). A small grid launched without it still waits, which returns at once.
  const bool after_kernel = pdl_previous_was_kernel_and_mark();
  cfg.numAttrs = pdl_enabled() && after_kernel && blocks <= kPdlMaxBlocks ? 1 : 0;
  KILN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace kiln::cuda::ops
