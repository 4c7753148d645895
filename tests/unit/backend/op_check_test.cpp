// The op-comparison harness (backend/op_check.h) without a GPU: the CPU backend against a second CPU backend is
// exact, with either delta-rule reference; the bf16-input budgets go to the tensor-core ops only.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/op_check.h"

namespace kiln::backend {
namespace {

// The comparison harness itself, without a GPU: the CPU backend against a second CPU backend is exact.
TEST(OpCompare, CpuAgainstCpuIsExact) {
  auto a = make_cpu_backend(), b = make_cpu_backend();
  for (bool chunked : {false, true}) {
    OpCheckConfig c;
    c.seed = 9;
    c.chunked_reference = chunked;
    const std::vector<OpCheck> results = compare_ops(*a, *b, c);
    EXPECT_GT(results.size(), 50u);
    for (const OpCheck& r : results) {
      EXPECT_TRUE(r.passed()) << r.str();
      EXPECT_EQ(r.rel_err, 0.0) << r.str();
    }
  }
}

// use_bf16_input_budgets (--dtype bfloat16) loosens exactly the ops a CUDA backend may run on tensor cores: dense
// BF16 (no bias, K % 8 == 0) and NVFP4 linears and linear_multi to 5e-3, NVFP4 experts and attention over bf16 / fp8
// pools to 1e-2; every other op keeps the fp32 tolerance.
TEST(OpCompare, Bf16InputBudgetsApplyToTheTensorCoreOpsOnly) {
  auto a = make_cpu_backend(), b = make_cpu_backend();
  OpCheckConfig c;
  c.seed = 10;
  c = use_bf16_input_budgets(c);
  EXPECT_EQ(c.tensor_core_linear_tol, kBf16InputLinearTol);
  EXPECT_EQ(c.tensor_core_tol, kBf16InputTol);
  const std::vector<OpCheck> results = compare_ops(*a, *b, c);
  auto starts = [](const std::string& s, const char* p) { return s.rfind(p, 0) == 0; };
  auto has = [](const std::string& s, const char* p) { return s.find(p) != std::string::npos; };
  int loosened = 0, other = 0;
  for (const OpCheck& r : results) {
    double want = c.tol;
    if (starts(r.op, "linear bf16 T=") || starts(r.op, "linear nvfp4 ") || starts(r.op, "linear_multi "))
      want = kBf16InputLinearTol;
    else if (starts(r.op, "moe_experts") && has(r.op, " nvfp4 "))
      want = kBf16InputTol;
    else if (starts(r.op, "attention kv=") && !starts(r.op, "attention kv=F32"))
      want = kBf16InputTol;
    else if (starts(r.op, "moe_route ids"))
      want = 0;  // integer outputs: exact
    EXPECT_EQ(r.tol, want) << r.op;
    (want > c.tol ? loosened : other) += 1;
  }
  EXPECT_GT(loosened, 10);
  EXPECT_GT(other, 40);
}

}  // namespace
}  // namespace kiln::backend
