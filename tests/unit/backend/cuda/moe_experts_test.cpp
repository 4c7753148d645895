// The routed experts (moe_experts.cu on tensor cores, linear.cu's kernels on CUDA cores) through CudaOps against
// the CPU backend. Skipped without a usable GPU.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/op_check.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

using test::expect_all_pass;

// The routed experts on each runner (--moe-runner-backend): NVFP4 experts on tensor cores (x split into 3 bf16 parts,
// or rounded once to bf16 with --dtype bfloat16; decode-sized row tiles on the register kernel at the block widths
// and occupancies the launch picks, prefill-sized ones on the kernel that stages x in shared memory) and on the fp32
// CUDA-core kernels, against the CPU at shapes the tensor-core path takes (H, I multiples of 128; 1 to 20 rows per
// expert, so row tiles of 8 to 32 rows; 200 rows give row tiles of 16). 3 parts and the CUDA cores: rel-L2 1e-5.
// 1 part: x and silu(gate) * up are rounded to bf16 in series, ~3e-3 expected (op_check.h): kBf16InputTol (1e-2),
// and above 2e-4 for the NVFP4 experts (the rounding happened: a path still in 3 parts would fail); BF16 experts
// always take the CUDA cores and keep 1e-5.
struct MoeRunner {
  const char* name;
  bool tensor_cores;
  bool bf16 = false;
};
// gtest prints the parameter by its name (not as bytes).
void PrintTo(const MoeRunner& p, std::ostream* os) { *os << p.name; }

class RoutedExperts : public ::testing::TestWithParam<MoeRunner> {};

TEST_P(RoutedExperts, MatchCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  auto cpu = make_cpu_backend();
  CudaOptions o;
  o.moe_tensor_cores = GetParam().tensor_cores;
  if (GetParam().bf16) o.dtype = CudaOptions::ActivationDtype::bfloat16;
  CudaOps gpu(o);
  EXPECT_EQ(gpu.describe().find("--moe-runner-backend kiln-grouped-fp32") == std::string::npos, o.moe_tensor_cores)
      << gpu.describe();
  OpCheckConfig c;
  if (GetParam().bf16) c = use_bf16_input_budgets(c);
  c.seed = 7;
  c.hidden = 256;
  c.expert_inter = 384;
  c.experts = 160;  // routing: 5 experts per lane
  c.top_k = 8;
  c.linear_rows = {1, 3, 8, 40, 200, 400};  // 200 x 8 / 160: 10 rows per expert, row tiles of 16
  std::vector<OpCheck> moe;
  for (const OpCheck& r : compare_ops(gpu, *cpu, c))
    if (r.op.rfind("moe_", 0) == 0) moe.push_back(r);
  // routing ids and weights, renormalised or not; 2 weight formats x (7 row counts + shared + routing and experts as
  // one op at the 3 row counts <= 8: ids and output)
  EXPECT_EQ(moe.size(), 32u);
  expect_all_pass(moe, GetParam().name);
  if (GetParam().bf16) {
    int rounded = 0;
    for (const OpCheck& r : moe)
      if (r.op.rfind("moe_experts", 0) == 0 && r.op.find(" nvfp4 ") != std::string::npos) {
        EXPECT_GE(r.rel_err, 2e-4) << r.str() << ": no sign of bf16 rounding";
        ++rounded;
      }
    EXPECT_EQ(rounded, 11);  // 7 row counts + shared + routed at 3 row counts (fused decode kernels)
  }
}

INSTANTIATE_TEST_SUITE_P(Runners, RoutedExperts,
                         ::testing::Values(MoeRunner{"TensorCores", true}, MoeRunner{"TensorCoresBf16", true, true},
                                           MoeRunner{"Fp32CudaCores", false}),
                         [](const ::testing::TestParamInfo<MoeRunner>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kiln::backend::cuda
