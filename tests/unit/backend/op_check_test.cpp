// The op-comparison harness (backend/op_check.h) without a GPU: the CPU backend against a second CPU backend is
// exact, with either delta-rule reference; a CPU backend with one op slightly wrong fails that op and only that op;
// an empty list of checks is a failure; the bf16-input budgets go to the tensor-core ops only.
#include "backend/op_check.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"
#include "model/forwarding_ops.h"

namespace kiln::backend {
namespace {

// The comparison harness itself, without a GPU: the CPU backend against a second CPU backend is exact (the second
// run with the vision tower's shapes too).
TEST(OpCompare, CpuAgainstCpuIsExact) {
  auto a = make_cpu_backend(), b = make_cpu_backend();
  for (bool chunked : {false, true}) {
    OpCheckConfig c;
    c.seed = 9;
    c.chunked_reference = chunked;
    c.vision_tower_shapes = chunked;
    const std::vector<OpCheck> results = compare_ops(*a, *b, c);
    EXPECT_GT(results.size(), 50u);
    int vision = 0, tower = 0;
    for (const OpCheck& r : results) {
      EXPECT_TRUE(r.passed()) << r.str();
      EXPECT_EQ(r.rel_err, 0.0) << r.str();
      for (const char* op : {"layer_norm ", "gelu ", "rope_cos_sin ", "attention_segments ", "weighted_embedding "})
        if (r.op.rfind(op, 0) == 0) ++vision;
      tower += r.op == "attention_segments heads 2 D=72 segments 1,0,17,300,1024";
    }
    // 4 layer_norm, 4 gelu, 2 weighted_embedding, rope_cos_sin, attention_segments per shape
    EXPECT_EQ(vision, chunked ? 24 : 12);
    EXPECT_EQ(tower, chunked ? 1 : 0);
  }
}

// The startup check covers the routed experts of a prefill-sized step too (where a GPU backend takes its large-step
// path: the wgmma GEMMs on sm_90 from 1024 tokens), CPU against CPU exact.
TEST(OpCompare, StartupCheckCoversALargeExpertStep) {
  auto a = make_cpu_backend(), b = make_cpu_backend();
  for (bool bf16 : {false, true}) {
    const OpCheckConfig c = startup_op_check_config(bf16);
    EXPECT_EQ(c.large_step_rows, 1024);
    const std::vector<OpCheck> results = compare_ops(*a, *b, c);
    int large = 0;
    for (const OpCheck& r : results) {
      EXPECT_TRUE(r.passed()) << r.str();
      large += r.op.rfind("moe_experts ", 0) == 0 && r.op.find(" T=1024 ") != std::string::npos;
    }
    EXPECT_EQ(large, 2) << "nvfp4 and bf16 experts at T=1024";
  }
}

// The CPU backend with silu_mul's output scaled by (1 + 1e-3): a small error, 100x the fp32 tolerance, that only a
// working harness notices.
class PerturbedSiluMul final : public kiln::model::ForwardingOps {
 public:
  using ForwardingOps::ForwardingOps;
  void silu_mul(const TensorView& gate, const TensorView& up, TensorView out) override {
    ForwardingOps::silu_mul(gate, up, out);
    ASSERT_EQ(out.dtype, DType::F32);
    float* o = static_cast<float*>(out.data);  // the CPU backend's tensors are host memory
    for (int64_t i = 0; i < out.numel(); ++i) o[i] *= 1.001f;
  }
};

TEST(OpCompare, PerturbedOpFailsTheHarnessAndOnlyThatOp) {
  PerturbedSiluMul wrong(make_cpu_backend());
  auto ref = make_cpu_backend();
  OpCheckConfig c;
  c.seed = 11;
  const std::vector<OpCheck> results = compare_ops(wrong, *ref, c);
  int failed = 0;
  for (const OpCheck& r : results) {
    const bool perturbed = r.op.rfind("silu_mul", 0) == 0;
    EXPECT_EQ(r.passed(), !perturbed) << r.str();
    if (perturbed) {
      EXPECT_NEAR(r.rel_err, 1e-3, 1e-4) << r.str();
      ++failed;
    }
  }
  EXPECT_GE(failed, 1);
  EXPECT_THAT(op_check_failures(results),
              ::testing::AllOf(::testing::HasSubstr(fmt::format("{} of {} op checks disagree", failed, results.size())),
                               ::testing::HasSubstr("silu_mul")));
  // The startup check refuses the backend, naming the op.
  EXPECT_THAT([&] { startup_op_check(wrong, *ref); },
              ::testing::ThrowsMessage<Error>(::testing::AllOf(::testing::HasSubstr("self-check failed"),
                                                               ::testing::HasSubstr("silu_mul"))));
}

TEST(OpCompare, NoChecksIsAFailure) {
  EXPECT_EQ(op_check_failures({}), "no op was checked");
  OpCheck ok;
  ok.op = "add";
  ok.tol = 1e-5;
  EXPECT_EQ(op_check_failures({ok}), "");
  OpCheck nan = ok;
  nan.finite = false;
  EXPECT_THAT(op_check_failures({ok, nan}), ::testing::HasSubstr("1 of 2 op checks disagree (add: NaN or inf"));
}

// use_bf16_input_budgets (--dtype bfloat16) loosens exactly the ops a CUDA backend may run on tensor cores: dense
// BF16 (with or without a bias, K % 8 == 0) and NVFP4 linears, linear_multi and linear_gated_input to 5e-3, NVFP4 experts,
// attention over bf16 / fp8 pools and attention within segments to 1e-2; every other op keeps the fp32 tolerance.
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
    if (starts(r.op, "linear bf16 T=") || starts(r.op, "linear bf16+bias T=") || starts(r.op, "linear nvfp4 ") ||
        starts(r.op, "linear_multi ") || starts(r.op, "linear_gated_input "))
      want = kBf16InputLinearTol;
    else if (starts(r.op, "moe_experts") && has(r.op, " nvfp4 "))
      want = kBf16InputTol;
    else if (starts(r.op, "attention kv=") && !starts(r.op, "attention kv=F32"))
      want = kBf16InputTol;
    else if (starts(r.op, "attention_segments "))
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
