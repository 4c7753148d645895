// The chunked gated delta rule (deltanet_chunked.cu) through CudaOps against the CPU backend. Skipped without a
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


// The chunked delta rule on the GPU (CudaOptions::DeltaRule::chunked: every multi-token step) against the CPU's token-by-token
// recurrence, at the Qwen3.5 head sizes (Dk = Dv = 128, partial chunks, several sequences, continuations from a
// carried state) and at odd sizes (Dk 40, Dv 40: padded keys, a masked value tile).
TEST(CudaOps, ChunkedDeltaRuleMatchesCpuRecurrence) {
  KILN_REQUIRE_CUDA_DEVICE();
  auto cpu = make_cpu_backend();
  CudaOptions o;
  o.delta_rule = CudaOptions::DeltaRule::chunked;
  CudaOps gpu(o);
  EXPECT_NE(gpu.describe().find("wherever supported [every step]"), std::string::npos) << gpu.describe();
  for (int64_t d : {128, 40}) {
    OpCheckConfig c;
    c.seed = 9;
    c.k_heads = 2;
    c.v_heads = 4;
    c.k_dim = d;
    c.v_dim = d;
    c.prefill_lens = {1, 70, 150, 600};
    std::vector<OpCheck> dr;
    for (const OpCheck& r : compare_ops(gpu, *cpu, c))
      if (r.op.rfind("gated_delta_rule", 0) == 0) dr.push_back(r);
    EXPECT_GE(dr.size(), 4u);
    expect_all_pass(dr, fmt::format("chunked delta rule Dk=Dv={}", d));
  }
}

}  // namespace
}  // namespace kiln::backend::cuda
