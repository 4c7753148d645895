// Dense NVFP4 linears with more rows than the gemv takes (prefill): on tensor cores (the routed-expert kernel with
// the weight as its only expert, x split into 3 bf16 parts) and, with KILN_CUDA_BLAS=0, on the fp32 gemm; both
// against the CPU backend at the op checks' tolerance (rel-L2 1e-5). Skipped without a usable GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/self_check.h"
#include "cuda_test_util.h"

namespace kiln::backend::cuda {
namespace {

using ::kiln::cuda::test::ScopedEnv;

TEST(CudaOps, NvFp4LinearManyRowsMatchesCpu) {
  const CudaDeviceProbe probe = probe_cuda_device();
  if (!probe.usable) GTEST_SKIP() << "no usable CUDA device: " << probe.reason;
  auto cpu = make_cpu_backend();
  for (const char* mode : {"1", "0"}) {
    const ScopedEnv env({{"KILN_CUDA_BLAS", mode}});
    CudaOps gpu;
    OpCheckConfig c;
    c.seed = 11;
    c.hidden = 384;        // K: 3 k-steps of 128
    c.out_features = 192;  // N: 3 blocks of 64 weight rows
    c.linear_rows = {129, 200, 517};  // partial 64-row tiles
    std::vector<OpCheck> lin;
    double worst = 0;
    for (const OpCheck& r : compare_ops(gpu, *cpu, c)) {
      if (r.op.rfind("linear nvfp4", 0) != 0) continue;
      lin.push_back(r);
      std::printf("[ op       ] KILN_CUDA_BLAS=%s | %s\n", mode, r.str().c_str());
      EXPECT_TRUE(r.passed()) << r.str();
      worst = std::max(worst, r.rel_err);
    }
    EXPECT_EQ(lin.size(), 3u);
    std::printf("[ ops      ] nvfp4 linear, many rows, KILN_CUDA_BLAS=%s: %zu checks, worst rel error %.2e\n", mode,
                lin.size(), worst);
  }
}

}  // namespace
}  // namespace kiln::backend::cuda
