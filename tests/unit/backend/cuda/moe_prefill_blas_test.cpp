// The NVFP4 routed experts of large steps dequantised to bf16 + cuBLAS grouped GEMMs (moe_prefill_blas.cu through
// CudaOps::moe_experts(_shared)) against the CPU backend, at the real layer shapes: Qwen3.5-35B-A3B (H 2048, 256
// experts, top-8, I 512) and one rank of Qwen3.5-397B-A17B at TP 8 (H 4096, 512 experts, top-10, I 1024 / 8 = 128),
// steps of 256, 1024 and 4096 tokens; and the choice of path (cuda_options.h, moe_prefill_blas), host-only.
// The GPU tests skip without a usable GPU.
//
// Tolerance: --dtype bfloat16's expert budget (op_check.h, kBf16InputTol = 1e-2, the one the mma kernels' bf16 checks
// use), and above 2e-4 (the rounding happened). The path rounds x and silu(gate) * up to bf16 as the mma kernels do,
// and also stores gate / up and each expert's output in bf16 (~2^-9 RMS each, in parallel or averaged over the
// top-k): ~3-4e-3 expected against the CPU.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/moe_prefill_blas.h"
#include "moe_test_util.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

namespace kops = ::kiln::cuda::ops;
using model::ExpertWeights;
using test::HostExperts;
using test::LayerShape;
using test::make_experts;
using test::normal;
using test::place;
using test::read;
using test::rel_err;

// ---- which path (host-only)

TEST(MoePrefillChoice, PathPerStepDtypeArchFlagAndCapture) {
  constexpr int64_t kMin = kMoePrefillBlasMinTokens, kWg = kMoePrefillWgmmaMinTokens;
  constexpr auto mma = MoePrefillPath::mma, blas = MoePrefillPath::blas, wgmma = MoePrefillPath::wgmma;
  static_assert(kWg < kMin);
  // moe_prefill_path(mode, tokens, bf16 inputs, compute major, wgmma serves (sm_90 + shapes), capturing).
  // auto (by_step) on sm_90 where the wgmma path serves: wgmma from kWg tokens, not while capturing.
  EXPECT_EQ(moe_prefill_path(MoePrefill::by_step, kWg - 1, true, 9, true, false), mma);
  EXPECT_EQ(moe_prefill_path(MoePrefill::by_step, kWg, true, 9, true, false), wgmma);
  EXPECT_EQ(moe_prefill_path(MoePrefill::by_step, 8192, true, 9, true, false), wgmma);
  EXPECT_EQ(moe_prefill_path(MoePrefill::by_step, 8192, true, 9, true, true), mma);    // inside a graph capture
  EXPECT_EQ(moe_prefill_path(MoePrefill::by_step, 8192, false, 9, true, false), mma);  // --dtype float32: 3-part mma
  // auto where the wgmma path does not serve (other GPUs, other shapes): the dequantised path from kMin tokens.
  EXPECT_EQ(moe_prefill_path(MoePrefill::by_step, kMin - 1, true, 9, false, false), mma);
  EXPECT_EQ(moe_prefill_path(MoePrefill::by_step, kMin, true, 9, false, false), blas);
  EXPECT_EQ(moe_prefill_path(MoePrefill::by_step, 4096, true, 10, false, false), blas);
  EXPECT_EQ(moe_prefill_path(MoePrefill::by_step, 4096, true, 12, false, false), blas);
  EXPECT_EQ(moe_prefill_path(MoePrefill::by_step, 4096, false, 12, false, false), mma);
  EXPECT_EQ(moe_prefill_path(MoePrefill::by_step, 4096, true, 8, false, false), mma);   // before Hopper
  EXPECT_EQ(moe_prefill_path(MoePrefill::by_step, 4096, true, 12, false, true), mma);   // capturing
  // kiln-mma: never another path.
  EXPECT_EQ(moe_prefill_path(MoePrefill::mma, 4096, true, 9, true, false), mma);
  EXPECT_EQ(moe_prefill_path(MoePrefill::mma, kMin, true, 12, false, false), mma);
  // kiln-blas: every step size, still bf16 / sm_90+ / not capturing only, even where wgmma would serve.
  EXPECT_EQ(moe_prefill_path(MoePrefill::blas, 1, true, 9, true, false), blas);
  EXPECT_EQ(moe_prefill_path(MoePrefill::blas, 256, true, 9, false, false), blas);
  EXPECT_EQ(moe_prefill_path(MoePrefill::blas, 0, true, 9, false, false), mma);
  EXPECT_EQ(moe_prefill_path(MoePrefill::blas, 256, false, 9, false, false), mma);
  EXPECT_EQ(moe_prefill_path(MoePrefill::blas, 256, true, 8, false, false), mma);
  EXPECT_EQ(moe_prefill_path(MoePrefill::blas, 4096, true, 9, false, true), mma);
  // kiln-wgmma: every step size where it serves, captured steps included (nothing goes back to the host); elsewhere
  // the mma kernels.
  EXPECT_EQ(moe_prefill_path(MoePrefill::wgmma, 1, true, 9, true, false), wgmma);
  EXPECT_EQ(moe_prefill_path(MoePrefill::wgmma, 8, true, 9, true, true), wgmma);
  EXPECT_EQ(moe_prefill_path(MoePrefill::wgmma, 8192, true, 9, false, false), mma);
  EXPECT_EQ(moe_prefill_path(MoePrefill::wgmma, 8192, false, 9, true, false), mma);
  // The default options: by step.
  EXPECT_EQ(CudaOptions{}.moe_prefill, MoePrefill::by_step);
}

// The path's per-pass buffers come out of what the plan reserves for the routed experts (moe_workspace_bytes, the
// memory plan's ffn term): never more, at the shapes it runs.
TEST(MoePrefillChoice, WorkspaceWithinTheExpertsPlannedScratch) {
  for (const LayerShape& s : {LayerShape{"35B", 2048, 256, 512, 8}, LayerShape{"397B tp8", 4096, 512, 128, 10},
                              LayerShape{"small", 256, 160, 384, 8}})
    for (int64_t T : {1, 8, 256, 1024, 4096, 8192}) {
      const size_t blas = kops::moe_prefill_blas_workspace_bytes(T, s.top_k, s.experts, s.hidden, s.inter);
      const size_t mma = kops::moe_workspace_bytes(T, s.top_k, s.experts, s.hidden, s.inter);
      EXPECT_LE(blas, mma) << s.name << " T=" << T;
      EXPECT_GT(blas, static_cast<size_t>(T * s.top_k * (2 * s.hidden + 3 * s.inter) * 2)) << s.name << " T=" << T;
    }
  EXPECT_EQ(kops::moe_prefill_blas_expert_bytes(2048, 512), size_t(3) * 2048 * 512 * 2);
}

// Only NVFP4 experts with 16-byte aligned codes, no bias, H and I multiples of 16.
TEST(MoePrefillChoice, ServesNvfp4ExpertsOnly) {
  alignas(16) static uint8_t codes[64];
  std::vector<kops::WeightDesc> d(6);
  for (kops::WeightDesc& w : d) {
    w.kind = kops::WeightKind::nvfp4;
    w.data = codes;
  }
  EXPECT_TRUE(kops::moe_prefill_blas_supported(256, 128, 1, true, d.data(), 2));
  EXPECT_FALSE(kops::moe_prefill_blas_supported(256, 128, 0, true, d.data(), 2));   // bf16 experts
  EXPECT_FALSE(kops::moe_prefill_blas_supported(256, 128, 1, false, d.data(), 2));  // unaligned somewhere
  EXPECT_FALSE(kops::moe_prefill_blas_supported(256, 120, 1, true, d.data(), 2));   // I % 16
  d[4].bias = codes;
  EXPECT_FALSE(kops::moe_prefill_blas_supported(256, 128, 1, true, d.data(), 2));
  d[4].bias = nullptr;
  d[5].kind = kops::WeightKind::fp8_tensor;
  EXPECT_FALSE(kops::moe_prefill_blas_supported(256, 128, 1, true, d.data(), 2));
}

// ---- the path on the GPU

using test::Inputs;
using test::make_inputs;
using test::Outputs;
using test::run;
using test::bf16_options;

// Nested profile rows of the dequantised path's stages (kiln bench-engine --profile shows them under moe_experts).
int dequant_rows(const std::vector<model::OpTime>& rows) {
  int n = 0;
  for (const model::OpTime& r : rows)
    if (r.nested && r.label.find("dequant") != std::string::npos) n += static_cast<int>(r.calls);
  return n;
}

class MoePrefillBlas : public ::testing::TestWithParam<LayerShape> {};

TEST_P(MoePrefillBlas, MatchesCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  const LayerShape s = GetParam();
  HostExperts host = make_experts(s, 21, 0, s.experts);
  // Every third expert's up projection gets its own scale_2: gate and up then run as two GEMM problems (the rest as
  // one [2I, H] problem with a shared alpha).
  for (int64_t e = 0; e < s.experts; e += 3) host.experts[static_cast<size_t>(e)].up.scale *= 1.5f;
  auto cpu = make_cpu_backend();
  const std::vector<ExpertWeights> cpu_experts = place(*cpu, host.experts);
  // kiln-blas (the path at every size) and auto (by step: the path from kMoePrefillBlasMinTokens); kiln-mma for
  // the printed comparison with the mma kernels.
  CudaOps blas(bf16_options(MoePrefill::blas)), by_step(bf16_options(MoePrefill::by_step)),
      mma(bf16_options(MoePrefill::mma));
  const std::vector<ExpertWeights> blas_experts = place(blas, host.experts), step_experts = place(by_step, host.experts),
                                   mma_experts = place(mma, host.experts);
  for (int64_t T : {256, 1024, 4096}) {
    for (bool with_shared : {true, false}) {
      if (!with_shared && T != 256) continue;
      const std::string label = std::string(s.name) + " T=" + std::to_string(T) + (with_shared ? " +shared" : "");
      SCOPED_TRACE(label);
      const Inputs in = make_inputs(s, T, 500 + T);
      ASSERT_TRUE(blas.profile_begin());
      const Outputs b = run(blas, blas_experts, s, in, with_shared);
      const int batches = dequant_rows(blas.profile_end());
      const Outputs ref = run(*cpu, cpu_experts, s, in, with_shared);
      const Outputs m = run(mma, mma_experts, s, in, with_shared);
      EXPECT_EQ(b.ids, ref.ids);
      // An expert is 3 MiB (397B rank) or 6 MiB (35B) in bf16: 256 MiB hold 85 / 42 of them per batch.
      const int64_t per_batch = static_cast<int64_t>(kMoePrefillWeightScratchBytes /
                                                     kops::moe_prefill_blas_expert_bytes(s.hidden, s.inter));
      EXPECT_GE(batches, 1);
      EXPECT_LE(batches, (s.experts + per_batch - 1) / per_batch);
      const double vs_cpu = rel_err(b.out, ref.out), mma_vs_cpu = rel_err(m.out, ref.out);
      std::printf("[ blas     ] %s: rel-L2 vs cpu %.2e (mma kernels vs cpu %.2e), vs mma %.2e, %d batches\n",
                  label.c_str(), vs_cpu, mma_vs_cpu, rel_err(b.out, m.out), batches);
      EXPECT_LE(vs_cpu, kBf16InputTol);
      EXPECT_GE(vs_cpu, 2e-4) << "no sign of the bf16 rounding";
      if (with_shared) {
        // auto: on sm_90 the wgmma path from kMoePrefillWgmmaMinTokens (moe_prefill_wgmma_test.cpp), never this one;
        // elsewhere this path (bitwise) from kMoePrefillBlasMinTokens; the mma kernels (bitwise kiln-mma) below both.
        const bool hopper = by_step.device().major == 9 && by_step.device().minor == 0;
        ASSERT_TRUE(by_step.profile_begin());
        const Outputs a = run(by_step, step_experts, s, in, with_shared);
        const bool taken = dequant_rows(by_step.profile_end()) > 0;
        EXPECT_EQ(taken, !hopper && T >= kMoePrefillBlasMinTokens);
        if (taken) EXPECT_EQ(a.out, b.out);
        if (T < (hopper ? kMoePrefillWgmmaMinTokens : kMoePrefillBlasMinTokens)) EXPECT_EQ(a.out, m.out);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layers, MoePrefillBlas,
                         ::testing::Values(LayerShape{"Qwen35B_A3B", 2048, 256, 512, 8},
                                           LayerShape{"Qwen397B_A17B_Tp8Rank", 4096, 512, 128, 10}),
                         [](const ::testing::TestParamInfo<LayerShape>& info) { return std::string(info.param.name); });

// An expert-parallel rank (experts [64, 128) of 256): pairs of the other experts contribute nothing, as on the CPU.
TEST(MoePrefillBlasExpertParallel, SkipsExpertsOfOtherRanks) {
  KILN_REQUIRE_CUDA_DEVICE();
  const LayerShape s{"ep", 2048, 256, 512, 8};
  const HostExperts host = make_experts(s, 22, 64, 128);
  auto cpu = make_cpu_backend();
  const std::vector<ExpertWeights> cpu_experts = place(*cpu, host.experts);
  CudaOps gpu(bf16_options(MoePrefill::blas));
  const std::vector<ExpertWeights> gpu_experts = place(gpu, host.experts);
  const Inputs in = make_inputs(s, 1024, 600);
  ASSERT_TRUE(gpu.profile_begin());
  const Outputs b = run(gpu, gpu_experts, s, in, true);
  EXPECT_EQ(dequant_rows(gpu.profile_end()), 2);  // 64 held experts of 6 MiB in bf16, 42 per 256 MiB: two batches
  const Outputs ref = run(*cpu, cpu_experts, s, in, true);
  EXPECT_EQ(b.ids, ref.ids);
  const double vs_cpu = rel_err(b.out, ref.out);
  std::printf("[ blas ep  ] rel-L2 vs cpu %.2e\n", vs_cpu);
  EXPECT_LE(vs_cpu, kBf16InputTol);
}

// A step captured into a CUDA graph never takes the path (it synchronises the stream): under kiln-blas the captured
// moe_experts runs the mma kernels, so the replayed graph gives kiln-mma's output bit for bit.
TEST(MoePrefillBlasCapture, CapturedStepsKeepTheMmaKernels) {
  KILN_REQUIRE_CUDA_DEVICE();
  const LayerShape s{"capture", 2048, 256, 512, 8};
  const HostExperts host = make_experts(s, 23, 0, s.experts);
  CudaOps gpu(bf16_options(MoePrefill::blas)), mma(bf16_options(MoePrefill::mma));
  const std::vector<ExpertWeights> gpu_experts = place(gpu, host.experts), mma_experts = place(mma, host.experts);
  const Inputs in = make_inputs(s, 256, 700);
  const Outputs want = run(mma, mma_experts, s, in, false);
  const Outputs eager = run(gpu, gpu_experts, s, in, false);  // builds the expert table outside the capture
  EXPECT_NE(eager.out, want.out) << "kiln-blas took the mma kernels eagerly";
  EXPECT_EQ(test::run_captured(gpu, gpu_experts, s, in), want.out);
}

}  // namespace
}  // namespace kiln::backend::cuda
