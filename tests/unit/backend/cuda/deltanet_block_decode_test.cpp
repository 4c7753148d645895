// The one-kernel Gated DeltaNet mixer of decode steps (deltanet_block_decode.cu through CudaOps::deltanet_block)
// against the CPU backend running what model::hybrid_mixer_output runs unfused: add_rms_norm (or rms_norm), the
// linear_multi of in_proj q/k/v, z, b, a, causal_conv1d_silu, gated_delta_rule_norm (the recurrence) and the out
// projection; and against the same unfused ops on the GPU. Three decode steps in a row (the conv state's window and the
// recurrent state carry over), 1, 2 and 4 sequences in scattered slots, at the rank shapes of the 35B-A3B (TP 1) and
// the 397B-A17B (TP 2 and 8), kiln-tiny's (64-wide heads) and a small one. Compared after every step: the output, the residual stream, the conv
// state and the recurrent state. Skipped without a usable GPU.
//
// Tolerances: fp32 products and sums everywhere, only summation orders differ (the projections' dot products, the
// delta rule's partial sums over 16 warps instead of 32): rel-L2 2e-5 against the CPU on the outputs and states (the
// unfused GPU ops hold 1e-5 each, over three chained ops); the conv state (the last inputs: projection outputs) the
// same. The residual stream: bitwise (one fp32 add per element).
// A bf16 recurrent state (--mamba-ssm-dtype bfloat16): against the unfused GPU ops with the same state, which round
// the same fp32 values once per step: 1.5e-3 (deltanet_test.cpp's budget against its emulation).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_ops.h"
#include "core/dtype.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

using model::LinearWeight;
using model::WeightFormat;
using test::rel_err;
using test::set_state;
using test::state_on_host;

struct Shape4 {
  const char* name;
  int64_t H, Hk, Hv;
  int64_t D = 128;  // Dk == Dv
};
void PrintTo(const Shape4& s, std::ostream* os) { *os << s.name; }

std::vector<float> normal(std::mt19937_64& rng, size_t n, float sd, float mean = 0.0f) {
  std::normal_distribution<float> d(mean, sd);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The layer's weights on the host: BF16 projections (N(0, 1/K)), conv, gates as trained models have them, norms.
struct HostLayer {
  std::vector<std::vector<uint16_t>> bf16;
  std::vector<std::vector<float>> f32;
  LinearWeight qkv, z, b, a, out;
  TensorView conv, A_log, dt_bias, norm, in_norm;
};
LinearWeight host_bf16(HostLayer& h, std::mt19937_64& rng, int64_t N, int64_t K) {
  return test::random_bf16_weight(h.bf16, rng, N, K);
}
TensorView host_f32(HostLayer& h, std::vector<float> v, Shape shape) {
  std::vector<float>& s = h.f32.emplace_back(std::move(v));
  return TensorView(s.data(), DType::F32, shape);
}
HostLayer make_layer(const Shape4& s, uint64_t seed) {
  HostLayer h;
  h.bf16.reserve(8);
  h.f32.reserve(8);
  std::mt19937_64 rng(seed);
  const int64_t H = s.H, C = 2 * s.Hk * s.D + s.Hv * s.D;
  h.qkv = host_bf16(h, rng, C, H);
  h.z = host_bf16(h, rng, s.Hv * s.D, H);
  h.b = host_bf16(h, rng, s.Hv, H);
  h.a = host_bf16(h, rng, s.Hv, H);
  h.out = host_bf16(h, rng, H, s.Hv * s.D);
  h.conv = host_f32(h, normal(rng, static_cast<size_t>(C * 4), 0.5f), Shape{C, 4});
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> A_log, dt_bias;
  for (int64_t i = 0; i < s.Hv; ++i) {
    A_log.push_back(std::log(1.0f + 15.0f * u(rng)));
    const float dt = std::exp(std::log(1e-3f) + u(rng) * (std::log(1e-1f) - std::log(1e-3f)));
    dt_bias.push_back(std::log(std::expm1(dt)));
  }
  h.A_log = host_f32(h, A_log, Shape{s.Hv});
  h.dt_bias = host_f32(h, dt_bias, Shape{s.Hv});
  h.norm = host_f32(h, normal(rng, static_cast<size_t>(s.D), 0.2f, 1.0f), Shape{s.D});
  h.in_norm = host_f32(h, normal(rng, static_cast<size_t>(H), 0.3f), Shape{H});
  return h;
}

// The layer placed on `ops`, as Ops::DeltaNetBlockWeights points at it.
struct PlacedLayer {
  LinearWeight qkv, z, b, a, out;
  TensorView conv, A_log, dt_bias, norm, in_norm;
  model::Ops::DeltaNetBlockWeights w(const Shape4& s) const {
    model::Ops::DeltaNetBlockWeights d;
    d.in_proj_qkv = &qkv;
    d.in_proj_z = &z;
    d.in_proj_b = &b;
    d.in_proj_a = &a;
    d.conv1d = conv;
    d.A_log = A_log;
    d.dt_bias = dt_bias;
    d.norm = norm;
    d.out_proj = &out;
    d.Hk = s.Hk;
    d.Hv = s.Hv;
    d.Dk = s.D;
    d.Dv = s.D;
    return d;
  }
};
PlacedLayer place(model::Ops& ops, const HostLayer& h) {
  PlacedLayer p{h.qkv, h.z, h.b, h.a, h.out, h.conv, h.A_log, h.dt_bias, h.norm, h.in_norm};
  for (LinearWeight* w : {&p.qkv, &p.z, &p.b, &p.a, &p.out}) w->weight = ops.place_weight(w->weight);
  for (TensorView* t : {&p.conv, &p.A_log, &p.dt_bias, &p.norm, &p.in_norm}) *t = ops.place_weight(*t);
  ops.finish_weights();
  return p;
}

// A decode step: one token per sequence, sequence s in slots[s], every token at position `pos`.
model::StepLayout decode_step(model::Ops& ops, const std::vector<int>& slots, int pos) {
  return test::step_on(ops, std::vector<int>(slots.size(), 1), slots, std::vector<int>(slots.size(), pos));
}

// One layer's recurrent state on one Ops: conv state F32 [slots, C, 3], recurrent state [slots, Hv, 128, 128].
struct States {
  TensorView conv, rec;
};

// model::hybrid_mixer_output's unfused ops for a Qwen3.5 DeltaNet layer (the input norm adds y when given).
std::vector<float> unfused(model::Ops& ops, const PlacedLayer& p, const Shape4& s, States st,
                           const model::StepLayout& step, TensorView hidden, const TensorView& y, float eps) {
  const int64_t T = step.num_tokens, H = s.H, Hk = s.Hk, Hv = s.Hv, C = 2 * Hk * s.D + Hv * s.D;
  const TensorView x = ops.scratch(DType::F32, Shape{T, H});
  if (y.data) ops.add_rms_norm(hidden, y, p.in_norm, eps, model::NormKind::zero_centred, x);
  else ops.rms_norm(hidden, p.in_norm, eps, model::NormKind::zero_centred, x);
  const TensorView mixed = ops.scratch(DType::F32, Shape{T, C}), z = ops.scratch(DType::F32, Shape{T, Hv * s.D});
  const TensorView b = ops.scratch(DType::F32, Shape{T, Hv}), a = ops.scratch(DType::F32, Shape{T, Hv});
  const LinearWeight* ws[] = {&p.qkv, &p.z, &p.b, &p.a};
  const TensorView outs[] = {mixed, z, b, a};
  ops.linear_multi(x, ws, outs);
  const TensorView conv = ops.scratch(DType::F32, Shape{T, C});
  ops.causal_conv1d_silu(mixed, p.conv, st.conv, step, conv);
  auto view = [&](int64_t off, int64_t heads) {
    TensorView v = conv;
    v.data = static_cast<float*>(conv.data) + off;
    v.shape = Shape{T, heads, s.D};
    v.strides = {C, s.D, 1};
    return v;
  };
  const TensorView q = view(0, Hk), k = view(Hk * s.D, Hk), v = view(2 * Hk * s.D, Hv);
  const TensorView g = ops.scratch(DType::F32, Shape{T, Hv}), beta = ops.scratch(DType::F32, Shape{T, Hv});
  const TensorView core = ops.scratch(DType::F32, Shape{T, Hv, s.D});
  const TensorView normed = ops.scratch(DType::F32, Shape{T * Hv, s.D});
  TensorView z2 = z;
  z2.shape = Shape{T * Hv, s.D};
  z2.strides = {s.D, 1};
  ops.gated_delta_rule_norm(q, k, v, a, b, p.A_log, p.dt_bias, g, beta, st.rec, step, model::DeltaRuleMode::recurrent,
                            z2, p.norm, eps, core, normed);
  TensorView nv = normed;
  nv.shape = Shape{T, Hv * s.D};
  nv.strides = {Hv * s.D, 1};
  const TensorView out = ops.scratch(DType::F32, Shape{T, H});
  ops.linear(nv, p.out, out);
  return state_on_host(ops, out);
}

class DeltaNetBlockDecode : public ::testing::TestWithParam<Shape4> {};

void run_case(const Shape4& s, bool bf16_state) {
  const int64_t H = s.H, C = 2 * s.Hk * s.D + s.Hv * s.D;
  const HostLayer host = make_layer(s, 41);
  const float eps = 1e-6f;
  const int slots = 6;
  CudaOptions o;
  o.deltanet_block_persistent = true;
  o.deltanet_block_max_tokens = 4;  // every step size the kernel serves
  o.recurrent_state_bf16 = bf16_state;
  CudaOps fused_gpu(o);
  CudaOptions ou;
  ou.recurrent_state_bf16 = bf16_state;
  CudaOps plain_gpu(ou);
  auto cpu = make_cpu_backend();
  const PlacedLayer pf = place(fused_gpu, host), pp = place(plain_gpu, host), pc = place(*cpu, host);
  const DType rec_dtype = bf16_state ? DType::BF16 : DType::F32;
  const Shape conv_shape{slots, C, 3}, rec_shape{slots, s.Hv, s.D, s.D};
  for (const std::vector<int>& seq_slots : std::vector<std::vector<int>>{{2}, {5, 1}, {3, 0, 5, 1}}) {
    const int64_t T = static_cast<int64_t>(seq_slots.size());
    std::mt19937_64 rng(700 + static_cast<uint64_t>(T) + (bf16_state ? 50 : 0));
    // Random starting states (as after earlier tokens), the same on all three.
    const std::vector<float> conv0 = normal(rng, static_cast<size_t>(slots * C * 3), 1.0f);
    const std::vector<float> rec0 = normal(rng, static_cast<size_t>(slots * s.Hv * s.D * s.D), 0.05f);
    States sf{fused_gpu.allocate(DType::F32, conv_shape), fused_gpu.allocate(rec_dtype, rec_shape)};
    States sp{plain_gpu.allocate(DType::F32, conv_shape), plain_gpu.allocate(rec_dtype, rec_shape)};
    States sc{cpu->allocate(DType::F32, conv_shape), cpu->allocate(DType::F32, rec_shape)};
    for (auto [ops, st] : {std::pair<model::Ops*, States>{&fused_gpu, sf}, {&plain_gpu, sp}, {cpu.get(), sc}}) {
      set_state(*ops, st.conv, conv0);
      set_state(*ops, st.rec, rec0);
    }
    for (int step = 0; step < 3; ++step) {
      const std::string label = std::string(s.name) + " T=" + std::to_string(T) + " step " + std::to_string(step) +
                                (bf16_state ? " bf16 state" : "");
      SCOPED_TRACE(label);
      const std::vector<float> hidden = normal(rng, static_cast<size_t>(T * H), 2.0f);
      const std::vector<float> y = normal(rng, static_cast<size_t>(T * H), 1.0f);
      const bool with_y = step != 1;  // step 1: no pending block output (the first layer's input norm)
      // The fused op.
      fused_gpu.reset_scratch();
      const model::StepLayout stf = decode_step(fused_gpu, seq_slots, 10 + step);
      const TensorView fh = fused_gpu.upload(hidden.data(), DType::F32, Shape{T, H});
      const TensorView fy = with_y ? fused_gpu.upload(y.data(), DType::F32, Shape{T, H}) : TensorView();
      const TensorView fout = fused_gpu.scratch(DType::F32, Shape{T, H});
      const model::ResidualNorm in{fh, fy, pf.in_norm, eps, model::NormKind::zero_centred};
      ASSERT_TRUE(fused_gpu.deltanet_block(in, pf.w(s), sf.conv, sf.rec, stf, eps, fout))
          << "the persistent kernel was not taken";
      const std::vector<float> got = state_on_host(fused_gpu, fout);
      const std::vector<float> got_hidden = state_on_host(fused_gpu, fh);
      // The unfused ops on the GPU and the CPU.
      std::vector<float> want[2], want_hidden[2];
      model::Ops* refs[2] = {&plain_gpu, cpu.get()};
      const PlacedLayer* pls[2] = {&pp, &pc};
      const States sts[2] = {sp, sc};
      for (int i = 0; i < 2; ++i) {
        model::Ops& ops = *refs[i];
        ops.reset_scratch();
        const model::StepLayout st = decode_step(ops, seq_slots, 10 + step);
        const TensorView h = ops.upload(hidden.data(), DType::F32, Shape{T, H});
        const TensorView yy = with_y ? ops.upload(y.data(), DType::F32, Shape{T, H}) : TensorView();
        want[i] = unfused(ops, *pls[i], s, sts[i], st, h, yy, eps);
        want_hidden[i] = state_on_host(ops, h);
      }
      EXPECT_EQ(got_hidden, want_hidden[1]) << "the residual stream";
      const double out_cpu = rel_err(got, want[1]), out_gpu = rel_err(got, want[0]);
      const double conv_cpu = rel_err(state_on_host(fused_gpu, sf.conv), state_on_host(*cpu, sc.conv));
      const double rec_cpu = rel_err(state_on_host(fused_gpu, sf.rec), state_on_host(*cpu, sc.rec));
      const double rec_gpu = rel_err(state_on_host(fused_gpu, sf.rec), state_on_host(plain_gpu, sp.rec));
      std::printf("[ delta blk] %s: out vs cpu %.2e vs unfused cuda %.2e (unfused cuda vs cpu %.2e) | conv state %.2e "
                  "| state vs cpu %.2e vs unfused cuda %.2e\n",
                  label.c_str(), out_cpu, out_gpu, rel_err(want[0], want[1]), conv_cpu, rec_cpu, rec_gpu);
      EXPECT_LE(conv_cpu, 2e-5) << "the conv state (the last inputs: projections, fp32 sums in another order)";
      if (bf16_state) {
        EXPECT_LE(out_gpu, 1.5e-3);
        EXPECT_LE(rec_gpu, 1.5e-3);
      } else {
        EXPECT_LE(out_cpu, 2e-5);
        EXPECT_LE(rec_cpu, 2e-5);
        EXPECT_LE(out_gpu, 2e-5);
      }
    }
  }
}

TEST_P(DeltaNetBlockDecode, MatchesCpuAndUnfusedOpsOverThreeSteps) {
  KILN_REQUIRE_CUDA_DEVICE();
  run_case(GetParam(), false);
}

INSTANTIATE_TEST_SUITE_P(Ranks, DeltaNetBlockDecode,
                         ::testing::Values(Shape4{"Qwen35B_A3B", 2048, 16, 32}, Shape4{"Qwen397B_Tp2Rank", 4096, 8, 32},
                                           Shape4{"Qwen397B_Tp8Rank", 4096, 2, 8}, Shape4{"Small", 256, 1, 2},
                                           Shape4{"KilnTiny", 256, 2, 4, 64}),
                         [](const ::testing::TestParamInfo<Shape4>& info) { return std::string(info.param.name); });

TEST(DeltaNetBlockDecodeBf16State, MatchesTheUnfusedOpsWithTheSameState) {
  KILN_REQUIRE_CUDA_DEVICE();
  run_case(Shape4{"Qwen35B_A3B", 2048, 16, 32}, true);
}

// Steps the kernel does not serve take the unfused ops: more than 4 sequences, a prefill (several tokens of one
// sequence), position checkpoints, the option off.
TEST(DeltaNetBlockDecodeFallback, DeclinesWhatItDoesNotServe) {
  KILN_REQUIRE_CUDA_DEVICE();
  const Shape4 s{"fallback", 256, 1, 2};
  const HostLayer host = make_layer(s, 43);
  for (bool option : {true, false}) {
    CudaOptions o;
    o.deltanet_block_persistent = option;
    o.deltanet_block_max_tokens = 4;
    CudaOps gpu(o);
    const PlacedLayer p = place(gpu, host);
    const int64_t C = 2 * s.Hk * s.D + s.Hv * s.D;
    const States st{gpu.allocate(DType::F32, Shape{8, C, 3}), gpu.allocate(DType::F32, Shape{8, s.Hv, s.D, s.D})};
    for (int n : {1, 4, 5}) {
      gpu.reset_scratch();
      std::vector<int> slots(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) slots[static_cast<size_t>(i)] = i;
      const model::StepLayout step = decode_step(gpu, slots, 3);
      std::vector<float> hv(static_cast<size_t>(n * 256), 0.5f);
      const TensorView h = gpu.upload(hv.data(), DType::F32, Shape{n, 256});
      const TensorView out = gpu.scratch(DType::F32, Shape{n, 256});
      const model::ResidualNorm in{h, TensorView(), p.in_norm, 1e-6f, model::NormKind::zero_centred};
      EXPECT_EQ(gpu.deltanet_block(in, p.w(s), st.conv, st.rec, step, 1e-6f, out), option && n <= 4)
          << "option " << option << " sequences " << n;
    }
    if (!option) continue;
    // Three tokens of one sequence (a prefill or a verify pass): declined.
    gpu.reset_scratch();
    const model::StepLayout pre = test::step_on(gpu, {3}, {0}, {0});
    std::vector<float> hv(3 * 256, 0.5f);
    const TensorView h = gpu.upload(hv.data(), DType::F32, Shape{3, 256});
    const TensorView out = gpu.scratch(DType::F32, Shape{3, 256});
    const model::ResidualNorm in{h, TensorView(), p.in_norm, 1e-6f, model::NormKind::zero_centred};
    EXPECT_FALSE(gpu.deltanet_block(in, p.w(s), st.conv, st.rec, pre, 1e-6f, out));
  }
}

}  // namespace
}  // namespace kiln::backend::cuda
