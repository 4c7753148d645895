// Kernel launches of the CudaOps kernels: launch_kernel() launches in plain stream order and checks the launch.
//
// Programmatic dependent launch (overlapping a kernel's launch with the previous kernel's tail) was tried here and
// removed: with it on, `kiln serve` gave wrong tokens in some fresh-server smoke runs and the cause was never found
// (docs/perf/cuda-ops.md, "Tuning measurements behind the launch choices").
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace kiln::cuda::ops {

// kernel<<<grid, block, smem, stream>>>(args...); errors throw at the launch site as KILN_CUDA_CHECK does.
template <typename... Params, typename... Args>
inline void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Stream stream,
                          Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = nullptr;
  cfg.numAttrs = 0;
  KILN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
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
