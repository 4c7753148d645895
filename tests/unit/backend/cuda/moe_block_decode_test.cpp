// The one-kernel MoE block of steps of 1-4 tokens (moe_block_decode.cu through CudaOps::moe_block) against the CPU backend
// and against the unfused CUDA ops, where both run what model::moe runs: linear_multi (router, shared gate / up, shared
// expert gate), linear_gated_input (silu(g) * u into the shared down projection), moe_route_experts. Shapes: the
// Qwen3.5-35B-A3B layer (H 2048, 256 experts, top-8, I 512, shared 512), one rank of the 397B-A17B at TP 8 (H 4096,
// 512 experts, top-10, I and shared 1024 / 8) and at TP 2 (I and shared 512), and a small odd one (H 160: lanes past
// the row idle). Random BF16 router and shared expert (N(0, 1 / H)), random NVFP4 experts (moe_test_util.h). Skipped
// without a usable GPU.
//
// Tolerances:
//  - ids: the CPU's (the logits differ from linear_multi's only in fp32 summation order; the seeds give no near-ties).
//  - --dtype float32: fp32 products everywhere, only summation orders differ: rel-L2 1e-5 against the CPU, and against
//    the unfused CUDA ops 1e-5 plus their own error against the CPU (the 397B TP-2 shape's unfused ops are 1.1e-5 off
//    the CPU at T = 4, measured on an H100; the fused kernel 4.5e-7).
//  - --dtype bfloat16: x and silu(gate) * up rounded to bf16 where they enter the NVFP4 experts, as the tensor-core
//    path rounds them: against the CPU op_check's kBf16InputTol (1e-2); against the unfused CUDA ops (the same
//    roundings) 1e-3, as moe_decode_fused_test holds its kernels, where they rounded too (where they took the fp32
//    kernels, as at the small shape, 1e-2), plus their own error against the CPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_ops.h"
#include "core/dtype.h"
#include "moe_test_util.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

using model::ExpertWeights;
using model::LinearWeight;
using model::WeightFormat;
using test::HostExperts;
using test::LayerShape;
using test::make_experts;
using test::normal;
using test::place;
using test::read;
using test::rel_err;

struct BlockShape {
  LayerShape layer;
  int64_t shared_inter;
};
void PrintTo(const BlockShape& s, std::ostream* os) { *os << s.layer.name; }

// The router and the shared expert, dense BF16, on the host.
struct HostDense {
  std::vector<std::vector<uint16_t>> bytes;
  LinearWeight router, gate, up, down, shared_gate;
};
LinearWeight host_bf16(HostDense& h, std::mt19937_64& rng, int64_t N, int64_t K) {
  return test::random_bf16_weight(h.bytes, rng, N, K);
}
HostDense make_dense(const BlockShape& s, uint64_t seed) {
  HostDense h;
  h.bytes.reserve(5);
  std::mt19937_64 rng(seed);
  const int64_t H = s.layer.hidden, Is = s.shared_inter;
  h.router = host_bf16(h, rng, s.layer.experts, H);
  h.gate = host_bf16(h, rng, Is, H);
  h.up = host_bf16(h, rng, Is, H);
  h.down = host_bf16(h, rng, H, Is);
  h.shared_gate = host_bf16(h, rng, 1, H);
  return h;
}
HostDense place_dense(model::Ops& ops, const HostDense& host) {
  HostDense d;
  d.router = host.router;
  d.gate = host.gate;
  d.up = host.up;
  d.down = host.down;
  d.shared_gate = host.shared_gate;
  for (LinearWeight* w : {&d.router, &d.gate, &d.up, &d.down, &d.shared_gate}) w->weight = ops.place_weight(w->weight);
  ops.finish_weights();
  return d;
}

struct Outputs {
  std::vector<int32_t> ids;
  std::vector<float> out;
};

// The unfused ops (model::moe's sequence); ids from moe_route_experts.
// x: T rows of H.
Outputs unfused(model::Ops& ops, const HostDense& w, const std::vector<ExpertWeights>& experts, const BlockShape& s,
                const std::vector<float>& xh, bool renormalise) {
  ops.reset_scratch();
  const int64_t H = s.layer.hidden, Is = s.shared_inter, E = s.layer.experts;
  const int64_t T = static_cast<int64_t>(xh.size()) / H;
  const TensorView x = ops.upload(xh.data(), DType::F32, Shape{T, H});
  const TensorView logits = ops.scratch(DType::F32, Shape{T, E});
  const TensorView g = ops.scratch(DType::F32, Shape{T, Is}), u = ops.scratch(DType::F32, Shape{T, Is});
  const TensorView sg = ops.scratch(DType::F32, Shape{T, 1});
  const LinearWeight* ws[] = {&w.router, &w.gate, &w.up, &w.shared_gate};
  const TensorView outs[] = {logits, g, u, sg};
  ops.linear_multi(x, ws, outs);
  const TensorView shared = ops.scratch(DType::F32, Shape{T, H});
  ops.linear_gated_input(g, u, model::InputAct::silu_mul, w.down, shared);
  const TensorView ids = ops.scratch(DType::I32, Shape{T, s.layer.top_k});
  const TensorView weights = ops.scratch(DType::F32, Shape{T, s.layer.top_k});
  const TensorView out = ops.scratch(DType::F32, Shape{T, H});
  ops.moe_route_experts(x, logits, s.layer.top_k, renormalise, experts, shared, sg, ids, weights, out);
  return {read<int32_t>(ops, ids), read<float>(ops, out)};
}

// CudaOps::moe_block: must take the fused kernel.
std::vector<float> fused(CudaOps& gpu, const HostDense& w, const std::vector<ExpertWeights>& experts,
                         const BlockShape& s, const std::vector<float>& xh, bool renormalise) {
  gpu.reset_scratch();
  const int64_t H = s.layer.hidden, T = static_cast<int64_t>(xh.size()) / H;
  const TensorView x = gpu.upload(xh.data(), DType::F32, Shape{T, H});
  const TensorView out = gpu.scratch(DType::F32, Shape{T, H});
  EXPECT_TRUE(gpu.moe_block(x, nullptr, w.router, w.gate, w.up, w.down, w.shared_gate, experts, s.layer.top_k, renormalise,
                            out))
      << "the persistent kernel was not taken";
  return read<float>(gpu, out);
}

CudaOptions persistent_options(bool bf16) {
  CudaOptions o;
  o.moe_block_persistent = true;
  o.moe_block_max_tokens = 4;  // every step size the kernel serves
  if (bf16) o.dtype = CudaOptions::ActivationDtype::bfloat16;
  return o;
}

constexpr double kFp32Tol = 1e-5;
constexpr double kBf16VsUnfusedTol = 1e-3;
constexpr double kBf16VsCpuTol = 1e-2;

class MoeBlockDecode : public ::testing::TestWithParam<BlockShape> {};

TEST_P(MoeBlockDecode, MatchesCpuAndUnfusedOps) {
  KILN_REQUIRE_CUDA_DEVICE();
  const BlockShape s = GetParam();
  const HostExperts host = make_experts(s.layer, 21, 0, s.layer.experts);
  const HostDense dense = make_dense(s, 22);
  auto cpu = make_cpu_backend();
  const std::vector<ExpertWeights> cpu_experts = place(*cpu, host.experts);
  for (bool bf16 : {false, true}) {
    CudaOps gpu(persistent_options(bf16));
    const std::vector<ExpertWeights> gpu_experts = place(gpu, host.experts);
    const HostDense gpu_dense = place_dense(gpu, dense);
    int trial = 0;
    for (int T : {1, 1, 2, 3, 4}) {
      ++trial;
      const bool renormalise = T != 2;
      std::mt19937_64 rng(500 + trial);
      const std::vector<float> x = normal(rng, static_cast<size_t>(T * s.layer.hidden), 1.0f);
      const std::string label = std::string(s.layer.name) + (bf16 ? " bf16" : " fp32") + " T=" + std::to_string(T) +
                                " trial " + std::to_string(trial) + (renormalise ? "" : " no-renorm");
      SCOPED_TRACE(label);
      const std::vector<float> got = fused(gpu, gpu_dense, gpu_experts, s, x, renormalise);
      const Outputs ref = unfused(*cpu, dense, cpu_experts, s, x, renormalise);
      const Outputs base = unfused(gpu, gpu_dense, gpu_experts, s, x, renormalise);
      ASSERT_EQ(base.ids, ref.ids) << "the unfused CUDA ops route otherwise than the CPU: a near-tie; change the seed";
      const double vs_cpu = rel_err(got, ref.out), vs_unfused = rel_err(got, base.out);
      std::printf("[ moe block] %s: rel-L2 vs cpu %.2e (unfused cuda vs cpu %.2e), vs unfused cuda %.2e\n",
                  label.c_str(), vs_cpu, rel_err(base.out, ref.out), vs_unfused);
      // Against the unfused CUDA ops: where they took fp32 kernels (small shapes: nothing rounded to bf16, they equal
      // the CPU to ~1e-7) the bf16 budget is the CPU's; and their own error against the CPU counts on top of ours.
      const double unfused_err = rel_err(base.out, ref.out);
      if (bf16) {
        EXPECT_LE(vs_cpu, kBf16VsCpuTol);
        EXPECT_LE(vs_unfused, (unfused_err < kFp32Tol ? kBf16VsCpuTol : kBf16VsUnfusedTol) + unfused_err);
      } else {
        EXPECT_LE(vs_cpu, kFp32Tol);
        EXPECT_LE(vs_unfused, kFp32Tol + unfused_err);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layers, MoeBlockDecode,
                         ::testing::Values(BlockShape{{"Qwen35B_A3B", 2048, 256, 512, 8}, 512},
                                           BlockShape{{"Qwen397B_A17B_Tp8Rank", 4096, 512, 128, 10}, 128},
                                           BlockShape{{"Qwen397B_A17B_Tp2Rank", 4096, 512, 512, 10}, 512},
                                           BlockShape{{"Small", 160, 24, 64, 4}, 40}),
                         [](const ::testing::TestParamInfo<BlockShape>& info) {
                           return std::string(info.param.layer.name);
                         });

// The residual step before the block folded into the kernel (model::moe_after_residual): hidden += y, the block's
// input rms_norm(hidden) * (1 + w). Against the CPU's add_rms_norm then the unfused ops: the residual stream bitwise
// (one fp32 add per element on both), the output within the tolerances above.
TEST(MoeBlockDecodeResidualNorm, FoldsTheResidualStepBeforeTheBlock) {
  KILN_REQUIRE_CUDA_DEVICE();
  for (const BlockShape& s : {BlockShape{{"Qwen35B_A3B", 2048, 256, 512, 8}, 512},
                              BlockShape{{"Qwen397B_A17B_Tp8Rank", 4096, 512, 128, 10}, 128}}) {
    const int64_t H = s.layer.hidden;
    const HostExperts host = make_experts(s.layer, 31, 0, s.layer.experts);
    const HostDense dense = make_dense(s, 32);
    std::mt19937_64 wrng(33);
    std::vector<uint16_t> norm_w;
    for (float v : normal(wrng, static_cast<size_t>(H), 0.3f)) norm_w.push_back(f32_to_bf16(v));
    auto cpu = make_cpu_backend();
    const std::vector<ExpertWeights> cpu_experts = place(*cpu, host.experts);
    for (bool bf16 : {false, true}) {
      CudaOps gpu(persistent_options(bf16));
      const std::vector<ExpertWeights> gpu_experts = place(gpu, host.experts);
      const HostDense gpu_dense = place_dense(gpu, dense);
      for (int T : {1, 4}) {
        const std::string label = std::string(s.layer.name) + (bf16 ? " bf16" : " fp32") + " T=" + std::to_string(T);
        SCOPED_TRACE(label);
        std::mt19937_64 rng(900 + T);
        const std::vector<float> hidden = normal(rng, static_cast<size_t>(T * H), 2.0f);
        const std::vector<float> y = normal(rng, static_cast<size_t>(T * H), 1.0f);
        // The reference: the CPU's add_rms_norm, then the unfused ops on its output.
        cpu->reset_scratch();
        const TensorView ch = cpu->upload(hidden.data(), DType::F32, Shape{T, H});
        const TensorView cy = cpu->upload(y.data(), DType::F32, Shape{T, H});
        const TensorView cw = cpu->upload(norm_w.data(), DType::BF16, Shape{H});
        const TensorView cx = cpu->scratch(DType::F32, Shape{T, H});
        cpu->add_rms_norm(ch, cy, cw, 1e-6f, model::NormKind::zero_centred, cx);
        const std::vector<float> want_hidden = read<float>(*cpu, ch), xn = read<float>(*cpu, cx);
        const Outputs ref = unfused(*cpu, dense, cpu_experts, s, xn, true);
        // The fused op.
        gpu.reset_scratch();
        const TensorView gh = gpu.upload(hidden.data(), DType::F32, Shape{T, H});
        const TensorView gy = gpu.upload(y.data(), DType::F32, Shape{T, H});
        const TensorView gw = gpu.upload(norm_w.data(), DType::BF16, Shape{H});
        const TensorView out = gpu.scratch(DType::F32, Shape{T, H});
        const model::ResidualNorm pre{gh, gy, gw, 1e-6f, model::NormKind::zero_centred};
        ASSERT_TRUE(gpu.moe_block(TensorView(), &pre, gpu_dense.router, gpu_dense.gate, gpu_dense.up, gpu_dense.down,
                                  gpu_dense.shared_gate, gpu_experts, s.layer.top_k, true, out))
            << "the persistent kernel was not taken";
        EXPECT_EQ(read<float>(gpu, gh), want_hidden) << "the residual stream after the fold";
        const double err = rel_err(read<float>(gpu, out), ref.out);
        std::printf("[ moe block] %s with the residual step: rel-L2 vs cpu %.2e\n", label.c_str(), err);
        EXPECT_LE(err, bf16 ? kBf16VsCpuTol : kFp32Tol);
      }
    }
  }
}

// An expert-parallel rank (experts [64, 128) of 256 held): slots routed to other ranks' experts contribute nothing,
// as on the CPU.
TEST(MoeBlockDecodeExpertParallel, SkipsExpertsOfOtherRanks) {
  KILN_REQUIRE_CUDA_DEVICE();
  const BlockShape s{{"ep", 2048, 256, 512, 8}, 512};
  const HostExperts host = make_experts(s.layer, 23, 64, 128);
  const HostDense dense = make_dense(s, 24);
  auto cpu = make_cpu_backend();
  const std::vector<ExpertWeights> cpu_experts = place(*cpu, host.experts);
  CudaOps gpu(persistent_options(false));
  const std::vector<ExpertWeights> gpu_experts = place(gpu, host.experts);
  const HostDense gpu_dense = place_dense(gpu, dense);
  std::mt19937_64 rng(600);
  const std::vector<float> x = normal(rng, 2048, 1.0f);
  const std::vector<float> got = fused(gpu, gpu_dense, gpu_experts, s, x, true);
  const Outputs ref = unfused(*cpu, dense, cpu_experts, s, x, true);
  EXPECT_LE(rel_err(got, ref.out), kFp32Tol);
}

// Replayed from a CUDA graph (programmatic dependent launch on, as in decode steps) many times in a row: the barrier
// words left by one launch serve the next, and every replay gives the eager launch's bits.
TEST(MoeBlockDecodeGraph, ReplaysEqualTheEagerLaunch) {
  KILN_REQUIRE_CUDA_DEVICE();
  const BlockShape s{{"graph", 2048, 256, 512, 8}, 512};
  const HostExperts host = make_experts(s.layer, 25, 0, s.layer.experts);
  const HostDense dense = make_dense(s, 26);
  CudaOps gpu(persistent_options(true));
  const std::vector<ExpertWeights> experts = place(gpu, host.experts);
  const HostDense w = place_dense(gpu, dense);
  std::mt19937_64 rng(700);
  const std::vector<float> xh = normal(rng, 2048, 1.0f);
  // Eagerly first (this also builds the expert table outside the capture): x -> want -> want2.
  const std::vector<float> want = fused(gpu, w, experts, s, xh, true);
  const std::vector<float> want2 = fused(gpu, w, experts, s, want, true);
  gpu.reset_scratch();
  const TensorView x = gpu.upload(xh.data(), DType::F32, Shape{1, 2048});
  const TensorView mid = gpu.scratch(DType::F32, Shape{1, 2048});
  const TensorView out = gpu.scratch(DType::F32, Shape{1, 2048});
  gpu.synchronize();
  ASSERT_TRUE(gpu.graph_capture_begin());
  // Two launches back to back in one graph, the second reading the first's output: x -> mid -> out.
  ASSERT_TRUE(gpu.moe_block(x, nullptr, w.router, w.gate, w.up, w.down, w.shared_gate, experts, 8, true, mid));
  ASSERT_TRUE(gpu.moe_block(mid, nullptr, w.router, w.gate, w.up, w.down, w.shared_gate, experts, 8, true, out));
  const int graph = gpu.graph_capture_end();
  ASSERT_GE(graph, 0) << "the capture failed";
  for (int replay = 0; replay < 20; ++replay) {
    ASSERT_TRUE(gpu.graph_launch(graph)) << "replay " << replay;
    ASSERT_EQ(read<float>(gpu, mid), want) << "replay " << replay;
    ASSERT_EQ(read<float>(gpu, out), want2) << "replay " << replay;
  }
}

// Steps of more than 4 tokens, a CudaOps without the option, and weights the kernel does not read (an FP32 router)
// are declined: moe_block returns false and the caller runs the unfused ops.
TEST(MoeBlockDecodeFallback, DeclinesWhatItDoesNotServe) {
  KILN_REQUIRE_CUDA_DEVICE();
  const BlockShape s{{"fallback", 256, 64, 128, 4}, 64};
  const HostExperts host = make_experts(s.layer, 27, 0, s.layer.experts);
  const HostDense dense = make_dense(s, 28);
  for (bool option : {true, false}) {
    CudaOptions o;
    o.moe_block_persistent = option;
    o.moe_block_max_tokens = 4;
    CudaOps gpu(o);
    const std::vector<ExpertWeights> experts = place(gpu, host.experts);
    const HostDense w = place_dense(gpu, dense);
    for (int64_t T : {1, 4, 5}) {
      gpu.reset_scratch();
      std::mt19937_64 rng(800);
      const std::vector<float> xh = normal(rng, static_cast<size_t>(T * 256), 1.0f);
      const TensorView x = gpu.upload(xh.data(), DType::F32, Shape{T, 256});
      const TensorView out = gpu.scratch(DType::F32, Shape{T, 256});
      EXPECT_EQ(gpu.moe_block(x, nullptr, w.router, w.gate, w.up, w.down, w.shared_gate, experts, 4, true, out),
                option && T <= 4)
          << "option " << option << " T=" << T;
    }
    if (!option) continue;
    // An FP32 router: declined.
    std::vector<float> r32(static_cast<size_t>(64 * 256), 0.01f);
    LinearWeight router = w.router;
    router.weight = gpu.place_weight(TensorView(r32.data(), DType::F32, Shape{64, 256}));
    gpu.reset_scratch();
    std::vector<float> xh(256, 1.0f);
    const TensorView x = gpu.upload(xh.data(), DType::F32, Shape{1, 256});
    const TensorView out = gpu.scratch(DType::F32, Shape{1, 256});
    EXPECT_FALSE(gpu.moe_block(x, nullptr, router, w.gate, w.up, w.down, w.shared_gate, experts, 4, true, out));
  }
}

}  // namespace
}  // namespace kiln::backend::cuda
