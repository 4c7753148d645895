// The token-by-token gated delta rule (deltanet.cu) through CudaOps against the CPU backend, and the recurrent state
// kept in bf16 (CudaOptions::recurrent_state_bf16, --mamba-ssm-dtype bfloat16): the decode kernel over 64 steps at
// the 35B-A3B and 397B-A17B rank shapes, the chunked prefill kernel reading and writing a bf16 state, a state-slot
// snapshot and restore through the runner, and whole models against the CPU. Skipped without a usable GPU.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "reference_fixture.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/op_check.h"
#include "core/dtype.h"
#include "format/model_config.h"
#include "format/model_dir.h"
#include "format/quant_config.h"
#include "format/shard_plan.h"
#include "model/runner.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

using test::expect_all_pass;
using test::rel_err;
using test::set_state;
using test::state_on_host;
using test::step_on;

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

// ---------------------------------------------------------------------------------------------------
// The recurrent state in bf16
//
// Accuracy budget. A bf16 store rounds each state element to 8 significant bits, to nearest even: a relative error
// of at most 2^-9 and ~1.6e-3 RMS over values spread across octaves (op_check.h's figure for one rounding). The
// update S -> e^g (I - beta k k^T) S + beta k v^T never amplifies an error (e^g <= 1, |k| = 1, 0 < beta < 1), so
// after t steps the error is at most the sum of t independent roundings: ~1.6e-3 sqrt(t) RMS relative to the state
// (1.3e-2 after 64 steps) where nothing decays, less where the gates forget. The outputs q^T S inherit the state's
// relative error. Budget against the fp32 CPU reference: 2^-8 sqrt(t) (2.4x that estimate; 3.1e-2 at t = 64). A
// biased rounding (truncation: half an ulp per step in one direction) grows like t, not sqrt(t), and leaves it.
//
// Against an emulation (the CPU's fp32 recurrence with its state rounded to bf16 on the host after every step, which
// is what the kernels must compute: load bf16, fp32 maths, one round-to-nearest-even store) the only difference is
// the fp32 summation order (~1e-7 relative), which flips a rounding for ~1e-4 of the elements by one ulp: ~3e-5 rel-L2
// per step, ~3e-4 after 64 steps. Budget 1.5e-3; truncating instead of rounding is ~4e-3 from the first step.
constexpr double kBf16StateVsEmulationTol = 1.5e-3;
double bf16_state_budget(int steps) { return std::ldexp(1.0, -8) * std::sqrt(static_cast<double>(steps)); }

// One rank's linear-attention head counts and dims, from the bundled config and the shard plan the loader cuts by.
struct RankShape {
  std::string name;
  int64_t Hk = 0, Hv = 0, Dk = 0, Dv = 0;
};

RankShape rank_shape(const std::string& config, int tp) {
  const format::ModelDir dir = format::ModelDir::open(std::string(KILN_SOURCE_DIR) + "/configs/" + config);
  const format::ModelConfig full = format::load_model_config(dir);
  const format::ShardPlan plan = format::plan_shards(full, format::load_quant_config(dir), tp);
  const format::ModelConfig c = format::rank_config(full, plan.ranks.front());
  return {fmt::format("{} tp {}", config, tp), c.linear_num_key_heads, c.linear_num_value_heads,
          c.linear_key_head_dim, c.linear_value_head_dim};
}

std::vector<float> normal(std::mt19937& rng, size_t n, float sd, float mean = 0.0f) {
  std::normal_distribution<float> d(mean, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<float> bf16_rounded(const std::vector<float>& x) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = bf16_to_f32(f32_to_bf16(x[i]));
  return r;
}

// The gate parameters of a layer with Hv value heads, as trained models have them: A = exp(A_log) in [1, 16] and
// dt = softplus(a + dt_bias) around [1e-3, 1e-1] (decays e^g from ~0.2 to ~0.999: some heads remember for
// hundreds of steps, where rounding errors add up).
struct GateParams {
  std::vector<float> A_log, dt_bias;
};
GateParams gate_params(std::mt19937& rng, int64_t Hv) {
  GateParams p;
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int64_t h = 0; h < Hv; ++h) {
    p.A_log.push_back(std::log(1.0f + 15.0f * u(rng)));
    const float dt = std::exp(std::log(1e-3f) + u(rng) * (std::log(1e-1f) - std::log(1e-3f)));
    p.dt_bias.push_back(std::log(std::expm1(dt)));
  }
  return p;
}

// One decode run: `steps` steps of one token per sequence through gated_delta_rule_with_gates on three Ops in
// lockstep: the GPU with a bf16 state, the CPU with an fp32 state (the reference), and the CPU with its state
// rounded to bf16 after every step (the emulation). Sequence s lives in slot B - s (slot 0 stays unused).
void decode_run(const RankShape& sh, int B, int steps, uint64_t seed) {
  CudaOptions o;
  o.recurrent_state_bf16 = true;
  CudaOps gpu(o);
  ASSERT_EQ(gpu.recurrent_state_dtype(), DType::BF16);
  auto ref = make_cpu_backend();
  auto emu = make_cpu_backend();
  ASSERT_EQ(ref->recurrent_state_dtype(), DType::F32);
  const int64_t Hk = sh.Hk, Hv = sh.Hv, Dk = sh.Dk, Dv = sh.Dv, T = B;
  const int slots = B + 1;
  const Shape state_shape{slots, Hv, Dk, Dv};
  TensorView s_gpu = gpu.allocate(DType::BF16, state_shape);
  TensorView s_ref = ref->allocate(DType::F32, state_shape);
  TensorView s_emu = emu->allocate(DType::F32, state_shape);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const GateParams gp = gate_params(rng, Hv);
  model::Ops* all[3] = {&gpu, ref.get(), emu.get()};
  TensorView A_log[3], dt_bias[3];
  for (int i = 0; i < 3; ++i) {
    A_log[i] = all[i]->place_weight(TensorView(const_cast<float*>(gp.A_log.data()), DType::F32, Shape{Hv}));
    dt_bias[i] = all[i]->place_weight(TensorView(const_cast<float*>(gp.dt_bias.data()), DType::F32, Shape{Hv}));
    all[i]->finish_weights();
  }
  std::vector<int> lens(B, 1), slot(B), start(B);
  for (int s = 0; s < B; ++s) slot[s] = B - s;
  double worst_ref = 0, worst_emu = 0;
  std::string trail;
  for (int t = 1; t <= steps; ++t) {
    for (int s = 0; s < B; ++s) start[s] = t - 1;
    const std::vector<float> q = normal(rng, T * Hk * Dk, 1.0f), k = normal(rng, T * Hk * Dk, 1.0f),
                             v = normal(rng, T * Hv * Dv, 1.0f), a = normal(rng, T * Hv, 0.5f),
                             b = normal(rng, T * Hv, 1.0f);
    std::vector<float> out[3];
    for (int i = 0; i < 3; ++i) {
      model::Ops& ops = *all[i];
      ops.reset_scratch();
      const model::StepLayout st = step_on(ops, lens, slot, start);
      const TensorView qv = ops.upload(q.data(), DType::F32, Shape{T, Hk, Dk});
      const TensorView kv = ops.upload(k.data(), DType::F32, Shape{T, Hk, Dk});
      const TensorView vv = ops.upload(v.data(), DType::F32, Shape{T, Hv, Dv});
      const TensorView av = ops.upload(a.data(), DType::F32, Shape{T, Hv});
      const TensorView bv = ops.upload(b.data(), DType::F32, Shape{T, Hv});
      TensorView g = ops.scratch(DType::F32, Shape{T, Hv}), beta = ops.scratch(DType::F32, Shape{T, Hv});
      TensorView o_view = ops.scratch(DType::F32, Shape{T, Hv, Dv});
      TensorView state = i == 0 ? s_gpu : i == 1 ? s_ref : s_emu;
      ops.gated_delta_rule_with_gates(qv, kv, vv, av, bv, A_log[i], dt_bias[i], g, beta, state, st,
                                      model::DeltaRuleMode::recurrent, o_view);
      out[i].resize(static_cast<size_t>(o_view.numel()));
      ops.download(o_view, out[i].data());
    }
    set_state(*emu, s_emu, bf16_rounded(state_on_host(*emu, s_emu)));  // the bf16 store, emulated
    const double out_ref = rel_err(out[0], out[1]), out_emu = rel_err(out[0], out[2]);
    double st_ref = 0, st_emu = 0;
    const bool check_state = t == 1 || t % 16 == 0 || t == steps;
    if (check_state) {
      const std::vector<float> sg = state_on_host(gpu, s_gpu);
      st_ref = rel_err(sg, state_on_host(*ref, s_ref));
      st_emu = rel_err(sg, state_on_host(*emu, s_emu));
      trail += fmt::format(" | t={} out {:.1e}/{:.1e} state {:.1e}/{:.1e}", t, out_ref, out_emu, st_ref, st_emu);
    }
    const double budget = bf16_state_budget(t);
    EXPECT_LE(out_ref, budget) << sh.name << " B=" << B << " step " << t;
    EXPECT_LE(out_emu, kBf16StateVsEmulationTol) << sh.name << " B=" << B << " step " << t;
    EXPECT_LE(st_ref, budget) << sh.name << " B=" << B << " step " << t;
    EXPECT_LE(st_emu, kBf16StateVsEmulationTol) << sh.name << " B=" << B << " step " << t;
    worst_ref = std::max({worst_ref, out_ref / budget, st_ref / budget});
    worst_emu = std::max({worst_emu, out_emu, st_emu});
  }
  std::printf("[ bf16 st ] %s (Hk %lld Hv %lld Dk %lld Dv %lld) B=%d: rel-L2 vs fp32 / vs emulation%s; worst %.2f of "
              "the fp32 budget, %.1e vs emulation\n",
              sh.name.c_str(), static_cast<long long>(Hk), static_cast<long long>(Hv), static_cast<long long>(Dk),
              static_cast<long long>(Dv), B, trail.c_str(), worst_ref, worst_emu);
}

// The decode kernel with a bf16 state over 64 steps at every rank shape of the two target models at tp 1, 2 and 8,
// batch 1 (the kernel computing the gates itself) and 16 (the gates kernel first).
TEST(CudaOps, Bf16StateDecodeStaysWithinBudgetOver64StepsAtRankShapes) {
  KILN_REQUIRE_CUDA_DEVICE();
  uint64_t seed = 100;
  for (const char* config : {"qwen3.5-35b-a3b-nvfp4", "qwen3.5-397b-a17b-nvfp4"}) {
    for (int tp : {1, 2, 8}) {
      const RankShape sh = rank_shape(config, tp);
      // REFERENCE section 1: 16 key heads of 128, 32 (35B) or 64 (397B) value heads of 128, split over the ranks.
      EXPECT_EQ(sh.Hk * tp, 16) << sh.name;
      EXPECT_EQ(sh.Hv * tp, std::string(config).find("397b") != std::string::npos ? 64 : 32) << sh.name;
      EXPECT_EQ(sh.Dk, 128);
      EXPECT_EQ(sh.Dv, 128);
      for (int B : {1, 16}) decode_run(sh, B, 64, ++seed);
    }
  }
}

// The chunked prefill kernel with a bf16 state: it reads the state at the first chunk (a non-zero state, as after an
// earlier chunk of the prompt) and writes it once after the last. Against the CPU's fp32 recurrence from the same
// (bf16-representable) state: the outputs are fp32 maths on equal inputs (summation order only: 1e-4, the chunked
// kernel's own budget against the recurrence is 1e-5 at these lengths); the final state is the CPU's rounded once
// (kBf16StateVsEmulationTol) and within one rounding of the CPU's fp32 state (2^-8).
TEST(CudaOps, Bf16StateChunkedPrefillMatchesCpuRecurrence) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOptions o;
  o.recurrent_state_bf16 = true;
  o.delta_rule = CudaOptions::DeltaRule::chunked;
  CudaOps gpu(o);
  auto cpu = make_cpu_backend();
  uint64_t seed = 300;
  for (const RankShape& sh : {rank_shape("qwen3.5-35b-a3b-nvfp4", 2), rank_shape("qwen3.5-397b-a17b-nvfp4", 8)}) {
    const int64_t Hk = sh.Hk, Hv = sh.Hv, Dk = sh.Dk, Dv = sh.Dv;
    const std::vector<int> lens = {150, 1, 40, 64}, slot = {3, 0, 2, 4}, start = {20, 7, 100, 0};
    const int slots = 5;
    const Shape state_shape{slots, Hv, Dk, Dv};
    std::mt19937 rng(static_cast<uint32_t>(++seed));
    // The starting state: bf16 values (what a bf16 slot can hold), the same on both sides.
    const std::vector<float> s0 = bf16_rounded(normal(rng, static_cast<size_t>(state_shape.numel()), 0.3f));
    TensorView s_gpu = gpu.allocate(DType::BF16, state_shape);
    TensorView s_cpu = cpu->allocate(DType::F32, state_shape);
    set_state(gpu, s_gpu, s0);
    set_state(*cpu, s_cpu, s0);
    int64_t T = 0;
    for (int n : lens) T += n;
    const std::vector<float> q = normal(rng, T * Hk * Dk, 1.0f), k = normal(rng, T * Hk * Dk, 1.0f),
                             v = normal(rng, T * Hv * Dv, 1.0f);
    std::vector<float> g(T * Hv), beta(T * Hv);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (auto& x : g) x = -std::exp(std::log(1e-3f) + u(rng) * -std::log(1e-3f));  // in [-1, -1e-3]
    for (auto& x : beta) x = u(rng);
    std::vector<float> out[2];
    std::vector<float> state[2];
    model::Ops* all[2] = {&gpu, cpu.get()};
    for (int i = 0; i < 2; ++i) {
      model::Ops& ops = *all[i];
      ops.reset_scratch();
      const model::StepLayout st = step_on(ops, lens, slot, start);
      TensorView o_view = ops.scratch(DType::F32, Shape{T, Hv, Dv});
      ops.gated_delta_rule(ops.upload(q.data(), DType::F32, Shape{T, Hk, Dk}),
                           ops.upload(k.data(), DType::F32, Shape{T, Hk, Dk}),
                           ops.upload(v.data(), DType::F32, Shape{T, Hv, Dv}),
                           ops.upload(g.data(), DType::F32, Shape{T, Hv}),
                           ops.upload(beta.data(), DType::F32, Shape{T, Hv}), i == 0 ? s_gpu : s_cpu, st,
                           i == 0 ? model::DeltaRuleMode::chunked : model::DeltaRuleMode::recurrent, o_view);
      out[i].resize(static_cast<size_t>(o_view.numel()));
      ops.download(o_view, out[i].data());
      state[i] = state_on_host(ops, i == 0 ? s_gpu : s_cpu);
    }
    const double out_err = rel_err(out[0], out[1]);
    const double vs_rounded = rel_err(state[0], bf16_rounded(state[1])), vs_fp32 = rel_err(state[0], state[1]);
    // Slot 1 belongs to no sequence of the step: left exactly as it was.
    const size_t per_slot = static_cast<size_t>(Hv * Dk * Dv);
    const std::vector<float> slot1(state[0].begin() + per_slot, state[0].begin() + 2 * per_slot);
    const std::vector<float> slot1_before(s0.begin() + per_slot, s0.begin() + 2 * per_slot);
    std::printf("[ bf16 st ] chunked %s: out rel-L2 %.1e, state vs CPU rounded %.1e, vs CPU fp32 %.1e\n",
                sh.name.c_str(), out_err, vs_rounded, vs_fp32);
    EXPECT_LE(out_err, 1e-4) << sh.name;
    EXPECT_LE(vs_rounded, kBf16StateVsEmulationTol) << sh.name;
    EXPECT_LE(vs_fp32, std::ldexp(1.0, -8)) << sh.name;
    EXPECT_EQ(slot1, slot1_before) << sh.name;
  }
}

// ---------------------------------------------------------------------------------------------------
// Whole models with a bf16 state

// A runner on `ops`: slot s owns pages [s * pages_per_slot, (s + 1) * pages_per_slot).
struct TestModel {
  std::unique_ptr<model::Runner> runner;
  std::vector<std::vector<int32_t>> page_tables;
  TestModel(std::unique_ptr<model::Ops> ops, const std::string& dir, int slots) {
    model::RunnerOptions ro;
    ro.kv_dtype = DType::F32;
    ro.state_slots = slots;
    ro.max_context = 256;
    runner = std::make_unique<model::Runner>(std::move(ops), format::ModelDir::open(dir), ro);
    const auto cap = runner->capacity();
    const int64_t per = cap.kv_pages / cap.state_slots;
    for (int s = 0; s < cap.state_slots; ++s) {
      std::vector<int32_t> pt(per);
      for (int64_t p = 0; p < per; ++p) pt[p] = static_cast<int32_t>(s * per + p);
      page_tables.push_back(pt);
    }
  }
  // The logits of one chunk: `tokens` at positions [pos, pos + n) of the sequence in `slot` using `pages`.
  std::vector<float> run(const std::vector<int32_t>& tokens, int64_t pos, int slot, const std::vector<int32_t>& pages) {
    model::SeqChunk c;
    c.state_slot = slot;
    c.tokens = tokens;
    c.start_pos = pos;
    c.page_table = pages;
    std::vector<float> logits(static_cast<size_t>(runner->vocab_size()));
    runner->forward({&c, 1}, logits);
    return logits;
  }
};

std::string fixture_dir(const std::string& name) {
  return name == "kiln-tiny" ? std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny"
                             : testing::fixtures_root() + "/" + name + "/model";
}

// A prefix-cache snapshot (Runner::copy_state into a spare slot) and its restore with bf16 recurrent slots: the
// restored sequence continues exactly (bit for bit) where the snapshot was taken, after the source slot has moved on.
TEST(CudaRunner, Bf16StateSnapshotRestoresBitForBit) {
  KILN_REQUIRE_CUDA_DEVICE();
  for (const std::string name : {"qwen3_5_moe_bf16", "qwen3_next_bf16"}) {
    CudaOptions o;
    o.recurrent_state_bf16 = true;
    TestModel m(std::make_unique<CudaOps>(o), fixture_dir(name), 4);
    const format::ModelConfig& c = m.runner->config();
    ASSERT_GT(c.num_linear_attention_layers(), 0) << name;
    // The slots are bf16 and the runner counts them so.
    EXPECT_NE(m.runner->describe().find("BF16 recurrent"), std::string::npos) << m.runner->describe();
    const int64_t C = 2 * int64_t(c.linear_num_key_heads) * c.linear_key_head_dim +
                      int64_t(c.linear_num_value_heads) * c.linear_value_head_dim;
    EXPECT_EQ(m.runner->capacity().state_bytes_per_slot,
              c.num_linear_attention_layers() * (C * (c.linear_conv_kernel - 1) * 4 +
                                                 int64_t(c.linear_num_value_heads) * c.linear_key_head_dim *
                                                     c.linear_value_head_dim * 2));
    std::mt19937 rng(5);
    std::vector<int32_t> prompt(37);
    for (auto& t : prompt) t = std::uniform_int_distribution<int32_t>(0, 500)(rng);
    const int64_t n = static_cast<int64_t>(prompt.size());
    const std::vector<int32_t>& pages = m.page_tables[0];
    m.run(prompt, 0, 0, pages);
    m.runner->copy_state(0, 2);                               // the snapshot
    const std::vector<float> a = m.run({11}, n, 0, pages);    // the sequence goes on in slot 0 ...
    m.run({12}, n + 1, 0, pages);                             // ... and on
    m.runner->copy_state(2, 1);                               // the restore into another sequence's slot
    const std::vector<float> b = m.run({11}, n, 1, pages);    // the same token at the same position
    EXPECT_EQ(a, b) << name << ": the restored state gives other logits";
    // And the snapshot slot itself was not disturbed by the restore (a second restore gives the same again).
    m.runner->copy_state(2, 3);
    EXPECT_EQ(m.run({11}, n, 3, pages), a) << name;
    std::printf("[ bf16 st ] %s: snapshot / restore with bf16 state slots bit for bit\n", name.c_str());
  }
}

// Whole models, --dtype float32 (so that the state's rounding is the only difference) with a bf16 recurrent state
// against the CPU (fp32 state): prefill then 32 decode steps fed the CPU's greedy tokens (teacher forcing, so one
// changed token does not end the comparison). Reported: the worst logits rel-L2 and the steps whose argmax differs.
// The bound is a wiring check: a state read or written in the wrong layout is off by O(1) (~1.4 for unrelated logits);
// the accuracy itself is the per-op budget above and the numbers printed. On an H100 (2026-12-05) the random-weight
// qwen3_5_moe_bf16 fixture (and the mtp fixture sharing its weights) drifted to 0.244, the others 5.6e-4 to 3.3e-2,
// past the 0.2 this test first had: its undamped random recurrence, recorded in docs/perf/decode-latency.md; the bf16
// state is opt-in (--mamba-ssm-dtype bfloat16), not the default, for that reason and for no measured speed gain.
TEST(CudaRunner, Bf16StateLogitsNearCpuOnModelsWithDeltaNet) {
  KILN_REQUIRE_CUDA_DEVICE();
  std::vector<std::string> names = {"kiln-tiny"};
  for (const std::string& n : testing::Fixture::all_names()) names.push_back(n);
  int models = 0;
  for (const std::string& name : names) {
    const std::string dir = fixture_dir(name);
    if (format::load_model_config(format::ModelDir::open(dir)).num_linear_attention_layers() == 0) continue;
    ++models;
    CudaOptions o;
    o.recurrent_state_bf16 = true;
    TestModel gpu(std::make_unique<CudaOps>(o), dir, 2);
    TestModel cpu(make_cpu_backend(), dir, 2);
    std::mt19937 rng(21);
    std::vector<int32_t> prompt(48);
    for (auto& t : prompt) t = std::uniform_int_distribution<int32_t>(0, 500)(rng);
    std::vector<float> lg = gpu.run(prompt, 0, 0, gpu.page_tables[0]), lc = cpu.run(prompt, 0, 0, cpu.page_tables[0]);
    double worst = rel_err(lg, lc);
    int differ = 0;
    int64_t pos = static_cast<int64_t>(prompt.size());
    for (int s = 0; s < 32; ++s, ++pos) {
      const int32_t next = testing::argmax(lc.data(), static_cast<int64_t>(lc.size()));
      differ += testing::argmax(lg.data(), static_cast<int64_t>(lg.size())) != next;
      lg = gpu.run({next}, pos, 0, gpu.page_tables[0]);
      lc = cpu.run({next}, pos, 0, cpu.page_tables[0]);
      worst = std::max(worst, rel_err(lg, lc));
    }
    std::printf("[ bf16 st ] %-22s --dtype float32, bf16 state vs cpu: worst logits rel-L2 %.2e over prefill + 32 "
                "decode steps, argmax differs on %d of 33\n",
                name.c_str(), worst, differ);
    EXPECT_LE(worst, 0.5) << name;
  }
  EXPECT_GT(models, 0);
}

}  // namespace
}  // namespace kiln::backend::cuda
