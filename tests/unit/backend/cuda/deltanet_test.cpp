// The token-by-token gated delta rule (deltanet.cu) through CudaOps against the CPU backend. Skipped without a
// usable GPU.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/op_check.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

using test::expect_all_pass;

// Key heads wider than 128 take the recurrent kernel with 32 state rows per thread (narrower ones 16).
TEST(CudaOps, RecurrentDeltaRuleWideKeyHeadsMatchCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
  for (int64_t d : {192, 256}) {
    OpCheckConfig c;
    c.seed = 11;
    c.k_dim = d;
    c.v_dim = 48;
    c.prefill_lens = {1, 7, 20};  // < 32 tokens: the recurrent kernel for the prefill step too
    std::vector<OpCheck> dr;
    for (const OpCheck& r : compare_ops(gpu, *cpu, c))
      if (r.op.rfind("gated_delta_rule", 0) == 0) dr.push_back(r);
    EXPECT_GE(dr.size(), 2u);
    expect_all_pass(dr, fmt::format("recurrent delta rule Dk={}", d));
  }
}

TEST(CudaOps, RecurrentDeltaRuleMatchesCpuChunkedPrefill) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
  OpCheckConfig c;
  c.seed = 4;
  c.k_dim = 64;
  c.v_dim = 64;
  c.prefill_lens = {3, 64, 100};
  c.chunked_reference = true;
  c.delta_rule_tol = 1e-4;
  expect_all_pass(compare_ops(gpu, *cpu, c), "chunked reference");
}

}  // namespace
}  // namespace kiln::backend::cuda
