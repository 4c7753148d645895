// The fused decode path of the routed experts (moe_decode_fused.cu through CudaOps::moe_route_experts) against the
// CPU backend and against the grouped CUDA path (moe_route + moe_experts(_shared) on the same CudaOps), at the real
// layer shapes: Qwen3.5-35B-A3B (H 2048, 256 experts, top-8, I 512) and one rank of Qwen3.5-397B-A17B at TP 8
// (H 4096, 512 experts, top-10, I 1024 / 8 = 128; format/shard_plan.cpp), batches 1, 2, 4 and 8, NVFP4 experts.
// Skipped without a usable GPU.
//
// Tolerances (docs/perf/decode-latency.md, "Numerics"):
//  - ids: identical to the CPU's and to the grouped path's; weights: bitwise the grouped path's (the same softmax
//    sums), the CPU's to 1e-6.
//  - --dtype float32: fp32 products, only the summation order differs from the CPU and from the grouped path
//    (3 bf16 parts of x): rel-L2 1e-5 against both.
//  - --dtype bfloat16: x and silu(gate) * up rounded to bf16 as the grouped path rounds them: against the CPU
//    op_check's kBf16InputTol (1e-2), and above 2e-4 (the rounding happened); against the grouped path 1e-3: the
//    same roundings, except where a different summation order moves an activation across a bf16 rounding boundary
//    (a few per thousand values, each off by 2^-8).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/moe_decode_fused.h"
#include "core/dtype.h"
#include "moe_test_util.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

using model::ExpertWeights;
using model::LinearWeight;
using model::WeightFormat;
using test::rel_err;

using test::HostExperts;
using test::LayerShape;
using test::make_experts;
using test::normal;
using test::place;
using test::make_inputs;
using test::read;
using test::StepInputs;


struct Outputs {
  std::vector<int32_t> ids;
  std::vector<float> weights, out;
};

// fused: Ops::moe_route_experts (the fused kernels where CudaOps takes them); else moe_route, then moe_experts or
// moe_experts_shared, each on its own.
Outputs run(model::Ops& ops, const std::vector<ExpertWeights>& experts, const LayerShape& s, const StepInputs& in,
            bool with_shared, bool renormalise, bool fused) {
  ops.reset_scratch();
  const int64_t T = in.T, H = s.hidden;
  const TensorView x = ops.upload(in.x.data(), DType::F32, Shape{T, H});
  const TensorView logits = ops.upload(in.logits.data(), DType::F32, Shape{T, s.experts});
  TensorView shared, gate;
  if (with_shared) {
    shared = ops.upload(in.shared.data(), DType::F32, Shape{T, H});
    gate = ops.upload(in.shared_gate.data(), DType::F32, Shape{T, 1});
  }
  const TensorView ids = ops.scratch(DType::I32, Shape{T, s.top_k});
  const TensorView weights = ops.scratch(DType::F32, Shape{T, s.top_k});
  const TensorView out = ops.scratch(DType::F32, Shape{T, H});
  if (fused) {
    ops.moe_route_experts(x, logits, s.top_k, renormalise, experts, shared, gate, ids, weights, out);
  } else {
    ops.moe_route(logits, s.top_k, renormalise, ids, weights);
    if (with_shared) ops.moe_experts_shared(x, ids, weights, experts, shared, gate, out);
    else ops.moe_experts(x, ids, weights, experts, out);
  }
  return {read<int32_t>(ops, ids), read<float>(ops, weights), read<float>(ops, out)};
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

// The profile rows of one fused call: the op's row and its two kernels' nested rows (kiln bench-engine --profile).
void expect_fused_profile(const std::vector<model::OpTime>& rows, bool fused) {
  int op = 0, up = 0, down = 0;
  for (const model::OpTime& r : rows) {
    const bool fused_op = r.label.rfind("moe_route+experts", 0) == 0 && r.label.size() > 6 &&
                          r.label.compare(r.label.size() - 6, 6, " fused") == 0;
    if (fused_op && !r.nested) op += static_cast<int>(r.calls);
    if (r.label == "  . route + gate/up (fused)" && r.nested) up += static_cast<int>(r.calls);
    if (r.label == "  . down + combine (fused)" && r.nested) down += static_cast<int>(r.calls);
  }
  EXPECT_EQ(op, fused ? 1 : 0);
  EXPECT_EQ(up, fused ? 1 : 0);
  EXPECT_EQ(down, fused ? 1 : 0);
}

constexpr double kFp32Tol = 1e-5;
constexpr double kBf16VsGroupedTol = 1e-3;

class MoeDecodeFused : public ::testing::TestWithParam<LayerShape> {};

TEST_P(MoeDecodeFused, MatchesCpuAndGroupedPath) {
  KILN_REQUIRE_CUDA_DEVICE();
  const LayerShape s = GetParam();
  const HostExperts host = make_experts(s, 11, 0, s.experts);
  auto cpu = make_cpu_backend();
  const std::vector<ExpertWeights> cpu_experts = place(*cpu, host.experts);
  for (bool bf16 : {false, true}) {
    CudaOptions o;
    if (bf16) o.dtype = CudaOptions::ActivationDtype::bfloat16;
    o.moe_decode_fused = true;  // --moe-runner-backend kiln-fused-decode
    CudaOps gpu(o);
    const std::vector<ExpertWeights> gpu_experts = place(gpu, host.experts);
    for (int64_t T : {1, 2, 4, 8}) {
      for (bool with_shared : {true, false}) {
        const bool renormalise = T != 2;  // one batch size routes without renormalising
        const StepInputs in = make_inputs(s, T, 100 + T);
        const std::string label = std::string(s.name) + (bf16 ? " bf16" : " fp32") + " T=" + std::to_string(T) +
                                  (with_shared ? " +shared" : "") + (renormalise ? "" : " no-renorm");
        SCOPED_TRACE(label);
        ASSERT_TRUE(gpu.profile_begin());
        const Outputs fused = run(gpu, gpu_experts, s, in, with_shared, renormalise, true);
        expect_fused_profile(gpu.profile_end(), true);
        const Outputs grouped = run(gpu, gpu_experts, s, in, with_shared, renormalise, false);
        const Outputs ref = run(*cpu, cpu_experts, s, in, with_shared, renormalise, false);

        EXPECT_EQ(fused.ids, grouped.ids);
        EXPECT_EQ(fused.ids, ref.ids);
        EXPECT_EQ(max_abs_diff(fused.weights, grouped.weights), 0.0) << "routing weights differ from moe_route's";
        EXPECT_LE(rel_err(fused.weights, ref.weights), 1e-6);
        const double vs_cpu = rel_err(fused.out, ref.out), vs_grouped = rel_err(fused.out, grouped.out);
        const double grouped_vs_cpu = rel_err(grouped.out, ref.out);
        std::printf("[ fused    ] %s: rel-L2 vs cpu %.2e (grouped path vs cpu %.2e), vs grouped %.2e\n", label.c_str(),
                    vs_cpu, grouped_vs_cpu, vs_grouped);
        if (bf16) {
          EXPECT_LE(vs_cpu, kBf16InputTol);
          EXPECT_GE(vs_cpu, 2e-4) << "no sign of the bf16 rounding";
          EXPECT_LE(vs_grouped, kBf16VsGroupedTol);
        } else {
          EXPECT_LE(vs_cpu, kFp32Tol);
          EXPECT_LE(vs_grouped, kFp32Tol);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layers, MoeDecodeFused,
                         ::testing::Values(LayerShape{"Qwen35B_A3B", 2048, 256, 512, 8},
                                           LayerShape{"Qwen397B_A17B_Tp8Rank", 4096, 512, 128, 10}),
                         [](const ::testing::TestParamInfo<LayerShape>& info) { return std::string(info.param.name); });

// An expert-parallel rank (experts [64, 128) of 256 held): pairs of the other experts contribute nothing, as on the
// CPU and on the grouped path (moe_local_ids).
TEST(MoeDecodeFusedExpertParallel, SkipsExpertsOfOtherRanks) {
  KILN_REQUIRE_CUDA_DEVICE();
  const LayerShape s{"ep", 2048, 256, 512, 8};
  const HostExperts host = make_experts(s, 12, 64, 128);
  auto cpu = make_cpu_backend();
  const std::vector<ExpertWeights> cpu_experts = place(*cpu, host.experts);
  CudaOptions o;
  o.moe_decode_fused = true;  // --moe-runner-backend kiln-fused-decode
  CudaOps gpu(o);
  const std::vector<ExpertWeights> gpu_experts = place(gpu, host.experts);
  for (int64_t T : {1, 8}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    const StepInputs in = make_inputs(s, T, 200 + T);
    ASSERT_TRUE(gpu.profile_begin());
    const Outputs fused = run(gpu, gpu_experts, s, in, true, true, true);
    expect_fused_profile(gpu.profile_end(), true);
    const Outputs grouped = run(gpu, gpu_experts, s, in, true, true, false);
    const Outputs ref = run(*cpu, cpu_experts, s, in, true, true, false);
    EXPECT_EQ(fused.ids, ref.ids);  // global ids, as moe_route writes them
    EXPECT_LE(rel_err(fused.out, ref.out), kFp32Tol);
    EXPECT_LE(rel_err(fused.out, grouped.out), kFp32Tol);
  }
}

// Steps of more than kMoeDecodeMaxTokens tokens, and --moe-runner-backend kiln-grouped (moe_decode_fused false), take
// the grouped path: the same bits as moe_route + moe_experts_shared, and no fused rows in the profile.
TEST(MoeDecodeFusedFallback, LargeStepsAndTheFlagTakeTheGroupedPath) {
  KILN_REQUIRE_CUDA_DEVICE();
  const LayerShape s{"fallback", 256, 64, 128, 4};
  const HostExperts host = make_experts(s, 13, 0, s.experts);
  for (bool flag : {true, false}) {
    CudaOptions o;
    o.moe_decode_fused = flag;
    CudaOps gpu(o);
    EXPECT_EQ(gpu.describe().find("fused kernels") != std::string::npos, flag) << gpu.describe();
    const std::vector<ExpertWeights> experts = place(gpu, host.experts);
    for (int64_t T : {int64_t{1}, ::kiln::cuda::ops::kMoeDecodeMaxTokens + 1}) {
      const bool fused_expected = flag && T <= ::kiln::cuda::ops::kMoeDecodeMaxTokens;
      SCOPED_TRACE("flag " + std::to_string(flag) + " T=" + std::to_string(T));
      const StepInputs in = make_inputs(s, T, 300 + T);
      ASSERT_TRUE(gpu.profile_begin());
      const Outputs a = run(gpu, experts, s, in, true, true, true);
      expect_fused_profile(gpu.profile_end(), fused_expected);
      const Outputs b = run(gpu, experts, s, in, true, true, false);
      EXPECT_EQ(a.ids, b.ids);
      if (fused_expected) {
        EXPECT_LE(rel_err(a.out, b.out), kFp32Tol);
      } else {
        EXPECT_EQ(max_abs_diff(a.out, b.out), 0.0);
        EXPECT_EQ(max_abs_diff(a.weights, b.weights), 0.0);
      }
    }
  }
}

}  // namespace
}  // namespace kiln::backend::cuda
