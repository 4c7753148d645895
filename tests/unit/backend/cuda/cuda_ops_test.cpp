// CudaOps against the CPU oracle, every op on random inputs at several shapes (op_check.h's compare_ops: tiny, odd
// sizes, the 397B's head / state sizes), fp32 paths at rel-L2 <= 1e-5, and with --dtype bfloat16 (the tensor-core
// ops within the budgets of bf16 inputs, every other op still at 1e-5); the startup op check itself; describe().
// Then whole models through the generic Runner on CudaOps and on the CPU backend: every transformers reference fixture
// and kiln-tiny, prefill + 20 greedy decode steps (identical greedy tokens, logits within 2e-4; also against
// transformers' own logits), the same models with --dtype bfloat16 (prefill logits within rel-L2 2e-2), a batch of
// mixed lengths against each sequence alone, batches of 1..64 copies of one request giving identical greedy output,
// graph replay, dummy weights, device argmax and sampling. Skipped without a usable GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <array>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/device.h"
#include "backend/op_check.h"
#include "format/model_dir.h"
#include "model/runner.h"
#include "model/sampling.h"
#include "reference_fixture.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

using test::expect_all_pass;

TEST(CudaOps, EveryOpMatchesCpuSmall) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
  OpCheckConfig c;
  c.seed = 1;
  expect_all_pass(compare_ops(gpu, *cpu, c), "small");
}

TEST(CudaOps, EveryOpMatchesCpuOddShapes) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
  OpCheckConfig c;
  c.seed = 2;
  c.hidden = 48;        // K % 8 == 0 but not a multiple of 32 lanes * 8
  c.out_features = 50;  // N not a multiple of the 8 / 64 column tiles
  c.linear_rows = {1, 2, 7, 8, 9, 16, 17, 65, 130};
  c.prefill_lens = {2, 65, 1, 33, 129};
  c.q_heads = 6;
  c.kv_heads = 3;
  c.head_dim = 16;
  c.rotary_dim = 4;
  c.k_heads = 3;
  c.v_heads = 6;
  c.k_dim = 8;
  c.v_dim = 40;  // not a multiple of the 32 value columns of a block
  c.conv_kernel = 3;
  c.experts = 5;
  c.top_k = 3;
  c.expert_inter = 48;
  c.vocab = 77;
  c.page_size = 3;
  expect_all_pass(compare_ops(gpu, *cpu, c), "odd shapes");
}

OpCheckConfig qwen35_head_sizes() {
  OpCheckConfig c;  // 397B-A17B head / state sizes, fewer heads and a smaller hidden size
  c.seed = 3;
  c.hidden = 1024;
  c.out_features = 512;
  c.linear_rows = {1, 4, 24, 200};
  c.prefill_lens = {1, 70, 150};
  c.q_heads = 8;
  c.kv_heads = 2;
  c.head_dim = 256;
  c.rotary_dim = 64;
  c.k_heads = 2;
  c.v_heads = 4;
  c.k_dim = 128;
  c.v_dim = 128;
  c.experts = 64;
  c.top_k = 10;
  c.expert_inter = 128;
  c.vocab = 1000;
  c.page_size = 16;
  c.vision_tower_shapes = true;  // the vision encoder's ops at its sizes too (head_dim 72, one 1024-token segment)
  return c;
}

TEST(CudaOps, EveryOpMatchesCpuAtQwen35HeadSizes) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
  expect_all_pass(compare_ops(gpu, *cpu, qwen35_head_sizes()), "qwen3.5 head sizes");
}

// --dtype bfloat16 at the same shapes (dense linears of 24 / 200 rows through cuBLASLt, NVFP4 ones of 200 rows and
// the NVFP4 experts on the MMA kernels, prefill attention at head_dim 256 over bf16 / fp8 pools): the tensor-core ops
// within use_bf16_input_budgets, everything else at 1e-5.
TEST(CudaOps, EveryOpMatchesCpuAtQwen35HeadSizesWithBf16Inputs) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOptions o;
  o.dtype = CudaOptions::ActivationDtype::bfloat16;
  CudaOps gpu(o);
  auto cpu = make_cpu_backend();
  expect_all_pass(compare_ops(gpu, *cpu, use_bf16_input_budgets(qwen35_head_sizes())), "qwen3.5 head sizes, bf16 in");
}

// The fused decode ops (the default; --disable-fused-decode-ops: qk_norm_rope's kernel, linear_gated_input's gemv, the delta rule with
// its output norm in one kernel) against the CPU's composed ops, at the small and the Qwen3.5 head sizes.
TEST(CudaOps, FusedDecodeOpsMatchCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOptions o;
  o.fused_decode_ops = true;
  CudaOps gpu(o);
  auto cpu = make_cpu_backend();
  OpCheckConfig c;
  c.seed = 3;
  for (const auto& [config, label] : {std::pair{c, "small"}, std::pair{qwen35_head_sizes(), "qwen3.5 head sizes"}}) {
    const std::vector<OpCheck> all = compare_ops(gpu, *cpu, config);
    std::vector<OpCheck> fused = test::checks_of(all, "qk_norm_rope");
    for (const OpCheck& r : test::checks_of(all, "linear_gated_input")) fused.push_back(r);
    const std::vector<OpCheck> delta_norm = test::checks_of(all, "gated_delta_rule_norm");
    EXPECT_GE(delta_norm.size(), 6u) << label;
    fused.insert(fused.end(), delta_norm.begin(), delta_norm.end());
    EXPECT_GE(fused.size(), 28u) << label;
    expect_all_pass(fused, std::string("fused decode ops, ") + label);
  }
}

// copy_spans: many byte ranges in one launch, 16-byte aligned (words) and not (bytes), sizes from 1 byte to 2 MiB, the
// bytes between and after them untouched; checked against the same copies done on the host.
TEST(CudaOps, CopySpansMovesExactlyTheirBytes) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  const int64_t N = int64_t(6) << 20;
  std::vector<uint8_t> host(static_cast<size_t>(N));
  std::mt19937 rng(3);
  for (auto& b : host) b = static_cast<uint8_t>(rng());
  TensorView buf = gpu.upload(host.data(), DType::U8, Shape{N});
  char* base = static_cast<char*>(buf.data);
  // (src offset, dst offset, bytes): aligned rows as the state copies use, odd sizes and offsets, empty.
  const std::vector<std::array<int64_t, 3>> cases = {{0, 3 << 20, 2 << 20}, {(2 << 20) + 16, (5 << 20) + 32, 96 * 1024},
                                                      {17, (5 << 20) + 200000, 4099}, {1000, 5000, 1}, {64, 128, 0},
                                                      {(2 << 20) + 200000, (5 << 20) + 300001, 12345}};
  std::vector<model::Ops::CopySpan> spans;
  std::vector<uint8_t> want = host;
  for (const auto& c : cases) {
    spans.push_back({base + c[0], base + c[1], static_cast<size_t>(c[2])});
    std::memcpy(want.data() + c[1], host.data() + c[0], static_cast<size_t>(c[2]));
  }
  gpu.copy_spans(spans);
  std::vector<uint8_t> got(static_cast<size_t>(N));
  gpu.download(buf, got.data());
  EXPECT_TRUE(got == want);
}

TEST(CudaOps, SelfCheckPasses) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
  EXPECT_NO_THROW(startup_op_check(gpu, *cpu));
  // The factory path (resolve + self-check) too.
  const DeviceChoice choice = resolve_device("auto");
  EXPECT_EQ(choice.device, "cuda") << choice.reason;
  EXPECT_NO_THROW(make_ops("cuda", true));
  // --dtype bfloat16 through the factory: its self-check at the budgets of bf16 inputs.
  LoadOptions bf16;
  bf16.gpu.dtype = "bfloat16";
  std::unique_ptr<model::Ops> ops;
  EXPECT_NO_THROW(ops = make_ops("cuda", true, bf16));
  ASSERT_TRUE(ops);
  EXPECT_NE(ops->describe().find("dtype bfloat16"), std::string::npos) << ops->describe();
  EXPECT_NE(ops->describe().find("x rounded once to bf16"), std::string::npos) << ops->describe();
  CudaOptions o;
  o.dtype = CudaOptions::ActivationDtype::bfloat16;
  CudaOps gpu_bf16(o);
  EXPECT_NO_THROW(startup_op_check(gpu_bf16, *cpu, true));
}

// The self-check with the persistent MoE block on: it compares the fused op (also with the residual step folded in)
// with the CPU's unfused ops.
TEST(CudaOps, SelfCheckPassesWithThePersistentMoeBlock) {
  KILN_REQUIRE_CUDA_DEVICE();
  auto cpu = make_cpu_backend();
  for (bool bf16 : {false, true}) {
    CudaOptions o;
    o.moe_block_persistent = true;
    if (bf16) o.dtype = CudaOptions::ActivationDtype::bfloat16;
    CudaOps gpu(o);
    EXPECT_NO_THROW(startup_op_check(gpu, *cpu, bf16)) << (bf16 ? "bf16" : "fp32");
  }
}

TEST(CudaOps, DescribesTheDevice) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  std::printf("[ describe ] %s\n", gpu.describe().c_str());
  EXPECT_NE(gpu.describe().find("compute capability"), std::string::npos);
  EXPECT_NE(gpu.describe().find("dtype float32"), std::string::npos);  // the default (--dtype auto, for now)
  EXPECT_NE(gpu.describe().find("x split into 3 bf16 parts"), std::string::npos);
  EXPECT_EQ(gpu.describe().find("rounded once to bf16"), std::string::npos);
}


}  // namespace
}  // namespace kiln::backend::cuda

namespace kiln::backend::cuda {
namespace {

// ---------------------------------------------------------------------------------------------------
// Whole models

struct ModelCase {
  std::string name;
  std::string dir;
  std::vector<std::vector<int32_t>> prompts;
  const testing::Fixture* fixture = nullptr;  // transformers logits, when a reference fixture
};

// A Runner plus page bookkeeping: slot s owns pages [s * pages_per_slot, (s + 1) * pages_per_slot).
struct Engine {
  std::unique_ptr<model::Runner> runner;
  int64_t pages_per_slot = 0;
  std::vector<std::vector<int32_t>> page_tables;
  int64_t vocab = 0;

  Engine(std::unique_ptr<model::Ops> ops, const std::string& dir, DType kv, int slots, int64_t max_context,
         model::LoadFormat load_format = model::LoadFormat::safetensors, int graph_max_batch = 256, bool mtp = false) {
    model::RunnerOptions ro;
    ro.mtp = mtp;
    ro.graph_verify_passes = mtp;  // speculative verify passes captured too (--cuda-graph-verify)
    ro.load_format = load_format;
    ro.graph_max_batch = graph_max_batch;
    ro.kv_dtype = kv;
    ro.state_slots = slots;
    ro.max_context = max_context;
    runner = std::make_unique<model::Runner>(std::move(ops), format::ModelDir::open(dir), ro);
    const auto cap = runner->capacity();
    pages_per_slot = cap.kv_pages / cap.state_slots;
    for (int s = 0; s < cap.state_slots; ++s) {
      std::vector<int32_t> pt(pages_per_slot);
      for (int64_t p = 0; p < pages_per_slot; ++p) pt[p] = static_cast<int32_t>(s * pages_per_slot + p);
      page_tables.push_back(pt);
    }
    vocab = runner->vocab_size();
  }
};

// Greedy generation of several sequences together (sequence i in slot i): one prefill step with every prompt, then
// `steps` decode steps. tokens[i] = the greedy tokens (steps + 1 of them: the prefill's, then one per decode step),
// logits[i][s] = the logits that chose tokens[i][s].
struct Generation {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<std::vector<float>>> logits;
};

Generation generate(Engine& e, const std::vector<std::vector<int32_t>>& prompts, int steps) {
  const size_t n = prompts.size();
  const int64_t V = e.vocab;
  Generation g;
  g.tokens.resize(n);
  g.logits.resize(n);
  std::vector<float> out(n * V);
  std::vector<model::SeqChunk> chunks(n);
  std::vector<int32_t> last(n);
  std::vector<int64_t> pos(n);
  for (size_t i = 0; i < n; ++i) {
    chunks[i].state_slot = static_cast<int>(i);
    chunks[i].tokens = prompts[i];
    chunks[i].start_pos = 0;
    chunks[i].page_table = e.page_tables[i];
    pos[i] = static_cast<int64_t>(prompts[i].size());
  }
  for (int s = 0; s <= steps; ++s) {
    if (s > 0)
      for (size_t i = 0; i < n; ++i) {
        chunks[i].tokens = std::span<const int32_t>(&last[i], 1);
        chunks[i].start_pos = pos[i]++;
      }
    e.runner->forward(chunks, out);
    for (size_t i = 0; i < n; ++i) {
      const float* row = out.data() + i * V;
      last[i] = testing::argmax(row, V);
      g.tokens[i].push_back(last[i]);
      g.logits[i].emplace_back(row, row + V);
    }
  }
  return g;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

std::vector<ModelCase> model_cases(std::vector<testing::Fixture>& fixtures) {
  std::vector<ModelCase> cases;
  for (const std::string& name : testing::Fixture::all_names()) fixtures.push_back(testing::Fixture::load(name));
  for (const testing::Fixture& fx : fixtures) {
    ModelCase mc;
    mc.name = fx.name;
    mc.dir = fx.model_dir;
    for (const auto& p : fx.prompts) mc.prompts.push_back(p.tokens);
    mc.fixture = &fx;
    cases.push_back(mc);
  }
  ModelCase tiny;
  tiny.name = "kiln-tiny";
  tiny.dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  std::mt19937 rng(7);
  for (int len : {1, 6, 33, 90}) {
    std::vector<int32_t> p(len);
    for (auto& t : p) t = std::uniform_int_distribution<int32_t>(0, 2047)(rng);
    tiny.prompts.push_back(p);
  }
  cases.push_back(tiny);
  return cases;
}

constexpr int kDecodeSteps = 20;
constexpr double kLogitTol = 2e-4;  // max |cuda - cpu| on a logit, F32 KV cache (the CPU runner's own
                                    // tolerance against transformers)

TEST(CudaRunner, LogitsAndGreedyTokensMatchCpuOnEveryModel) {
  KILN_REQUIRE_CUDA_DEVICE();
  std::vector<testing::Fixture> fixtures;
  fixtures.reserve(32);
  const std::vector<ModelCase> cases = model_cases(fixtures);
  ASSERT_GE(cases.size(), 13u);
  for (const ModelCase& mc : cases) {
    Engine cpu(make_cpu_backend(), mc.dir, DType::F32, 4, 256);
    Engine gpu(std::make_unique<CudaOps>(), mc.dir, DType::F32, 4, 256);
    double prefill_err = 0, decode_err = 0, vs_transformers = 0;
    int identical = 0;
    for (size_t p = 0; p < mc.prompts.size(); ++p) {
      const Generation a = generate(gpu, {mc.prompts[p]}, kDecodeSteps);
      const Generation b = generate(cpu, {mc.prompts[p]}, kDecodeSteps);
      EXPECT_EQ(a.tokens[0], b.tokens[0]) << mc.name << " prompt " << p << ": greedy tokens differ";
      identical += a.tokens[0] == b.tokens[0];
      prefill_err = std::max(prefill_err, max_abs_diff(a.logits[0][0], b.logits[0][0]));
      for (int s = 1; s <= kDecodeSteps && a.tokens[0][s - 1] == b.tokens[0][s - 1]; ++s)
        decode_err = std::max(decode_err, max_abs_diff(a.logits[0][s], b.logits[0][s]));
      if (mc.fixture) {
        // transformers' greedy_logits row s = the logits after feeding greedy token s-1 (row 0: the prefill).
        const testing::Prompt& ref = mc.fixture->prompts[p];
        const int64_t V = mc.fixture->vocab;
        for (int s = 0; s <= kDecodeSteps && s < static_cast<int>(ref.greedy_tokens.size()); ++s) {
          if (s > 0 && a.tokens[0][s - 1] != ref.greedy_tokens[s - 1]) break;
          const std::vector<float> want(ref.greedy_logits.begin() + s * V, ref.greedy_logits.begin() + (s + 1) * V);
          vs_transformers = std::max(vs_transformers, max_abs_diff(a.logits[0][s], want));
        }
      }
    }
    std::printf("[ model    ] %-22s cuda vs cpu: prefill max|dlogit| %.2e, %d decode steps %.2e, greedy identical "
                "%d/%zu%s\n",
                mc.name.c_str(), prefill_err, kDecodeSteps, decode_err, identical, mc.prompts.size(),
                mc.fixture ? fmt::format("; cuda vs transformers {:.2e}", vs_transformers).c_str() : "");
    EXPECT_LT(prefill_err, kLogitTol) << mc.name;
    EXPECT_LT(decode_err, kLogitTol) << mc.name;
    if (mc.fixture) EXPECT_LT(vs_transformers, kLogitTol) << mc.name;
  }
}

// The fused decode ops keep every model's logits: they use the separate kernels' arithmetic, so greedy generation with
// them on equals generation with them off bit for bit (every fixture model, prefill and decode steps).
TEST(CudaRunner, FusedDecodeOpsGiveTheSameLogitsOnEveryModel) {
  KILN_REQUIRE_CUDA_DEVICE();
  std::vector<testing::Fixture> fixtures;
  fixtures.reserve(32);
  const std::vector<ModelCase> cases = model_cases(fixtures);
  CudaOptions fused_on, fused_off;
  fused_on.fused_decode_ops = true;
  fused_off.fused_decode_ops = false;
  for (const ModelCase& mc : cases) {
    Engine off(std::make_unique<CudaOps>(fused_off), mc.dir, DType::F32, 4, 256);
    Engine on(std::make_unique<CudaOps>(fused_on), mc.dir, DType::F32, 4, 256);
    for (size_t p = 0; p < mc.prompts.size(); ++p) {
      const Generation a = generate(on, {mc.prompts[p]}, kDecodeSteps);
      const Generation b = generate(off, {mc.prompts[p]}, kDecodeSteps);
      EXPECT_EQ(a.tokens[0], b.tokens[0]) << mc.name << " prompt " << p;
      EXPECT_EQ(a.logits[0], b.logits[0]) << mc.name << " prompt " << p;
    }
  }
}

// Every model with persistent decode kernels on (`o`), against the CPU: logits within kLogitTol, greedy tokens the
// CPU's. Each prompt decodes alone; with `batch3`, prompt 1 also beside two others (three sequences in different state
// slots in one step). kiln-tiny's first decode must have taken an op whose profile label starts with `label` (`what`
// names it in the report). Models a kernel does not serve run the unfused ops (the same check then holds trivially).
void expect_persistent_kernel_matches_cpu(const CudaOptions& o, const std::string& label, const char* what,
                                          bool batch3) {
  std::vector<testing::Fixture> fixtures;
  fixtures.reserve(32);
  const std::vector<ModelCase> cases = model_cases(fixtures);
  for (const ModelCase& mc : cases) {
    Engine cpu(make_cpu_backend(), mc.dir, DType::F32, 4, 256);
    auto ops = std::make_unique<CudaOps>(o);
    CudaOps* raw = ops.get();
    Engine gpu(std::move(ops), mc.dir, DType::F32, 4, 256);
    double decode_err = 0;
    int identical = 0, compared = 0;
    bool taken = false;
    for (size_t p = 0; p < mc.prompts.size(); ++p) {
      std::vector<std::vector<int32_t>> batch = {mc.prompts[p]};
      if (batch3 && p == 1)
        for (size_t q = 0; q < mc.prompts.size() && batch.size() < 3; ++q)
          if (q != p) batch.push_back(mc.prompts[q]);
      if (p == 0) EXPECT_TRUE(raw->profile_begin());
      const Generation a = generate(gpu, batch, kDecodeSteps);
      if (p == 0)
        for (const model::OpTime& r : raw->profile_end()) taken |= r.label.rfind(label, 0) == 0;
      const Generation b = generate(cpu, batch, kDecodeSteps);
      for (size_t s = 0; s < batch.size(); ++s) {
        EXPECT_EQ(a.tokens[s], b.tokens[s]) << mc.name << " prompt " << p << " seq " << s << ": greedy tokens differ";
        identical += a.tokens[s] == b.tokens[s];
        ++compared;
        for (int t = 1; t <= kDecodeSteps && a.tokens[s][t - 1] == b.tokens[s][t - 1]; ++t)
          decode_err = std::max(decode_err, max_abs_diff(a.logits[s][t], b.logits[s][t]));
      }
    }
    std::printf("[ model    ] %-22s persistent %s %s: decode max|dlogit| vs cpu %.2e, greedy identical %d/%d\n",
                mc.name.c_str(), what, taken ? "taken" : "not taken", decode_err, identical, compared);
    EXPECT_LT(decode_err, kLogitTol) << mc.name;
    if (mc.name == "kiln-tiny") EXPECT_TRUE(taken) << "kiln-tiny's decode steps did not take the persistent kernel";
  }
}

// The persistent MoE block kernel (CudaOptions::moe_block_persistent; the CLI's --enable-persistent-moe): decode steps
// at batch 1 take it wherever the layer has a BF16 router and shared expert and NVFP4 experts (kiln-tiny, the Qwen3.5
// MoE NVFP4 fixtures).
TEST(CudaRunner, PersistentMoeBlockMatchesCpuOnEveryModel) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOptions o;
  o.moe_block_persistent = true;
  expect_persistent_kernel_matches_cpu(o, "moe_block ", "MoE block", false);
}

// Both persistent decode kernels (also --enable-persistent-deltanet), at batch 1 and 3: kiln-tiny's decode steps must
// take the DeltaNet kernel (its projections are dense BF16).
TEST(CudaRunner, PersistentDeltaNetBlockMatchesCpuOnEveryModel) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOptions o;
  o.moe_block_persistent = true;
  o.deltanet_block_persistent = true;
  o.moe_block_max_tokens = 4;  // batch 3 takes them too
  o.deltanet_block_max_tokens = 4;
  expect_persistent_kernel_matches_cpu(o, "deltanet_block ", "DeltaNet mixer", true);
}

// --dtype bfloat16 on whole models (F32 KV cache, so that only the tensor-core inputs differ): the prefill logits
// against the CPU's. Each tensor-core op is off by ~1.7e-3 (linears) to ~3e-3 (experts, attention) relative to its
// output (op_check.h); summed over the fixtures' sublayers that predicts ~1e-2. Measured on the H200
// (docs/perf/dtype-h200.md): 2.1e-3 .. 1.2e-1, the largest on the NVFP4 MoE fixtures, whose random routers put
// experts within the rounding of each other (a changed top-k choice moves the output by a whole expert). So this
// bound is a wiring check, not the accuracy budget: a wrong kernel or a path left in 3 parts gives rel-L2 ~1 or
// exactly the float32 figure; the accuracy is what docs/perf records (the float32 path stays at kLogitTol above).
// Greedy tokens are reported, not required: they may differ where the two best logits lie within the error.
constexpr double kBf16LogitRelTol = 0.2;

TEST(CudaRunner, Bf16InputsLogitsNearCpuOnEveryModel) {
  KILN_REQUIRE_CUDA_DEVICE();
  std::vector<testing::Fixture> fixtures;
  fixtures.reserve(32);
  const std::vector<ModelCase> cases = model_cases(fixtures);
  CudaOptions o;
  o.dtype = CudaOptions::ActivationDtype::bfloat16;
  double worst = 0;
  for (const ModelCase& mc : cases) {
    Engine cpu(make_cpu_backend(), mc.dir, DType::F32, 4, 256);
    Engine gpu(std::make_unique<CudaOps>(o), mc.dir, DType::F32, 4, 256);
    double err = 0;
    int identical = 0;
    for (size_t p = 0; p < mc.prompts.size(); ++p) {
      const Generation a = generate(gpu, {mc.prompts[p]}, 4), b = generate(cpu, {mc.prompts[p]}, 4);
      err = std::max(err, test::rel_err(a.logits[0][0], b.logits[0][0]));
      identical += a.tokens[0] == b.tokens[0];
    }
    worst = std::max(worst, err);
    std::printf("[ model    ] %-22s --dtype bfloat16 cuda vs cpu: prefill logits rel-L2 %.2e (budget %.0e), 4 greedy "
                "steps identical %d/%zu\n",
                mc.name.c_str(), err, kBf16LogitRelTol, identical, mc.prompts.size());
    EXPECT_LE(err, kBf16LogitRelTol) << mc.name;
  }
  std::printf("[ model    ] --dtype bfloat16: worst prefill logits rel-L2 %.2e\n", worst);
}

// A pass of >= model::kLayerScratchReleaseMinTokens tokens frees each layer's scratch when the layer is done
// (Runner::pass_body): on CUDA its prefill logits equal the CPU's (same release path; float32, F32 KV) on every model,
// and its scratch peak stays well under a 256-token pass's, which holds every layer's buffers.
TEST(CudaRunner, LargePassesFreeLayerScratchAndMatchCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  std::vector<testing::Fixture> fixtures;
  fixtures.reserve(32);
  const std::vector<ModelCase> cases = model_cases(fixtures);
  auto prefill = [](Engine& e, std::span<const int32_t> p, size_t* peak) {
    model::SeqChunk c;
    c.state_slot = 0;
    c.tokens = p;
    c.start_pos = 0;
    c.page_table = e.page_tables[0];
    std::vector<float> out(static_cast<size_t>(e.vocab));
    e.runner->forward({&c, 1}, out);
    *peak = e.runner->ops().scratch_peak_bytes();
    return out;
  };
  for (const ModelCase& mc : cases) {
    Engine cpu(make_cpu_backend(), mc.dir, DType::F32, 1, 512);
    Engine gpu(std::make_unique<CudaOps>(), mc.dir, DType::F32, 1, 512);
    std::vector<int32_t> prompt(300);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 13) % std::min<int64_t>(gpu.vocab, 2000));
    size_t peak256 = 0, peak300 = 0, cpu_peak = 0;
    prefill(gpu, std::span(prompt).first(256), &peak256);
    const std::vector<float> got = prefill(gpu, prompt, &peak300);
    const std::vector<float> want = prefill(cpu, prompt, &cpu_peak);
    const double err = test::rel_err(got, want);
    std::printf("[ model    ] %-22s 300-token pass, layers freed: cuda vs cpu logits rel-L2 %.2e; cuda scratch peak "
                "%.2f MB (256-token pass: %.2f MB)\n",
                mc.name.c_str(), err, peak300 / 1e6, peak256 / 1e6);
    EXPECT_LT(err, 1e-4) << mc.name;
    EXPECT_EQ(testing::argmax(got.data(), gpu.vocab), testing::argmax(want.data(), cpu.vocab)) << mc.name;
    EXPECT_LT(peak300, peak256) << mc.name;
  }
}

// Prefix-cache snapshots inside a prompt's chunk (SeqChunk::snapshots) on the GPU: a 33-token chunk writes them as
// position checkpoints from the recurrence and conv kernels in its one pass, a 90-token one copies the state at its
// first and writes the second in its short tail's pass, a 200-token one ends passes at both and copies the state. On every hybrid model (kiln-tiny with its MTP head: the head's last hidden state is part of the
// snapshot), a sequence restored from each snapshot continues to the whole prompt's logits, and those equal the CPU's.
TEST(CudaRunner, SnapshotsInsideAChunkHoldTheStateThere) {
  KILN_REQUIRE_CUDA_DEVICE();
  std::vector<testing::Fixture> fixtures;
  fixtures.reserve(32);
  int hybrid = 0;
  for (const ModelCase& mc : model_cases(fixtures)) {
    const bool mtp = mc.name == "kiln-tiny";
    Engine gpu(std::make_unique<CudaOps>(), mc.dir, DType::F32, 4, 256, model::LoadFormat::safetensors, 256, mtp);
    if (!gpu.runner->has_recurrent_state()) continue;
    ++hybrid;
    Engine cpu(make_cpu_backend(), mc.dir, DType::F32, 4, 256, model::LoadFormat::safetensors, 256, mtp);
    std::vector<int32_t> prompt(200);
    for (size_t i = 0; i < prompt.size(); ++i)
      prompt[i] = static_cast<int32_t>((i * 7919 + 13) % std::min<int64_t>(gpu.vocab - 1, 2000));
    for (const int64_t len : {int64_t{33}, int64_t{90}, int64_t{200}}) {
      const std::span<const int32_t> p = std::span<const int32_t>(prompt).first(static_cast<size_t>(len));
      const std::vector<int64_t> at = len == 33   ? std::vector<int64_t>{16, 32}
                                      : len == 90 ? std::vector<int64_t>{32, 80}
                                                  : std::vector<int64_t>{64, 128};
      auto whole = [&](Engine& e) {
        model::SeqChunk c;
        c.state_slot = 0;
        c.tokens = p;
        c.page_table = e.page_tables[0];
        c.snapshots = {{at[0], 1}, {at[1], 2}};
        std::vector<float> out(static_cast<size_t>(e.vocab));
        e.runner->forward({&c, 1}, out);
        return out;
      };
      const std::vector<float> want = whole(gpu), cpu_want = whole(cpu);
      const double vs_cpu = test::rel_err(want, cpu_want);
      EXPECT_LT(vs_cpu, 1e-4) << mc.name;
      for (size_t k = 0; k < at.size(); ++k) {
        gpu.runner->copy_state(static_cast<int>(k) + 1, 3);
        model::SeqChunk rest;
        rest.state_slot = 3;
        rest.tokens = p.subspan(static_cast<size_t>(at[k]));
        rest.start_pos = at[k];
        rest.page_table = gpu.page_tables[0];
        std::vector<float> got(static_cast<size_t>(gpu.vocab));
        gpu.runner->forward({&rest, 1}, got);
        const double err = test::rel_err(got, want);
        std::printf("[ model    ] %-22s %2lld-token chunk, snapshot after %2lld: continuation vs whole rel-L2 %.2e "
                    "(whole: cuda vs cpu %.2e)\n",
                    mc.name.c_str(), static_cast<long long>(len), static_cast<long long>(at[k]), err, vs_cpu);
        EXPECT_LT(err, 1e-4) << mc.name << " len " << len << " snapshot " << at[k];
        EXPECT_EQ(testing::argmax(got.data(), gpu.vocab), testing::argmax(want.data(), gpu.vocab)) << mc.name;
      }
    }
  }
  EXPECT_GE(hybrid, 3);
}

TEST(CudaRunner, Bf16KvCacheGreedyMatchesCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  // The serving default (BF16 KV): rounding to bf16 may differ in the last bit where the fp32 inputs differ by
  // rounding, so only the greedy tokens and a loose logit bound are checked.
  for (const std::string name : {"kiln-tiny", "qwen3_5_moe_nvfp4", "qwen3_next_bf16"}) {
    const std::string dir = name == "kiln-tiny" ? std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny"
                                                : testing::fixtures_root() + "/" + name + "/model";
    Engine cpu(make_cpu_backend(), dir, DType::BF16, 4, 256);
    Engine gpu(std::make_unique<CudaOps>(), dir, DType::BF16, 4, 256);
    std::mt19937 rng(11);
    std::vector<int32_t> prompt(40);
    for (auto& t : prompt) t = std::uniform_int_distribution<int32_t>(0, 500)(rng);
    const Generation a = generate(gpu, {prompt}, kDecodeSteps), b = generate(cpu, {prompt}, kDecodeSteps);
    const double err = max_abs_diff(a.logits[0][0], b.logits[0][0]);
    std::printf("[ model    ] %-22s kv=bf16 cuda vs cpu: prefill max|dlogit| %.2e, greedy identical %s\n",
                name.c_str(), err, a.tokens[0] == b.tokens[0] ? "yes" : "NO");
    EXPECT_EQ(a.tokens[0], b.tokens[0]) << name;
    EXPECT_LT(err, 1e-2) << name;
  }
}

TEST(CudaRunner, MixedBatchMatchesEachSequenceAlone) {
  KILN_REQUIRE_CUDA_DEVICE();
  std::vector<testing::Fixture> fixtures;
  fixtures.reserve(32);
  const std::vector<ModelCase> cases = model_cases(fixtures);
  for (const ModelCase& mc : cases) {
    Engine batch(std::make_unique<CudaOps>(), mc.dir, DType::F32, 8, 256);
    Engine alone(std::make_unique<CudaOps>(), mc.dir, DType::F32, 8, 256);
    // Every prompt of the case plus a reversed copy of the longest: mixed lengths 1..90 in one prefill step.
    std::vector<std::vector<int32_t>> prompts = mc.prompts;
    prompts.emplace_back(mc.prompts.back().rbegin(), mc.prompts.back().rend());
    const Generation together = generate(batch, prompts, kDecodeSteps);
    double worst = 0;
    int identical = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const Generation single = generate(alone, {prompts[i]}, kDecodeSteps);
      identical += single.tokens[0] == together.tokens[i];
      EXPECT_EQ(single.tokens[0], together.tokens[i]) << mc.name << " sequence " << i;
      for (int s = 0; s <= kDecodeSteps && single.tokens[0][s] == together.tokens[i][s]; ++s)
        worst = std::max(worst, max_abs_diff(single.logits[0][s], together.logits[i][s]));
    }
    std::printf("[ batch    ] %-22s mixed batch of %zu vs alone: greedy identical %d/%zu, max|dlogit| %.2e\n",
                mc.name.c_str(), prompts.size(), identical, prompts.size(), worst);
    EXPECT_LT(worst, kLogitTol) << mc.name;
  }
}

TEST(CudaRunner, BatchesOfOneRequestGiveIdenticalGreedyOutput) {
  KILN_REQUIRE_CUDA_DEVICE();
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  Engine gpu(std::make_unique<CudaOps>(), dir, DType::BF16, 64, 64);
  std::mt19937 rng(5);
  std::vector<int32_t> prompt(24);
  for (auto& t : prompt) t = std::uniform_int_distribution<int32_t>(0, 2047)(rng);
  const Generation one = generate(gpu, {prompt}, kDecodeSteps);
  int bad_batches = 0;
  double worst = 0;
  for (int B = 1; B <= 64; ++B) {
    const Generation g = generate(gpu, std::vector<std::vector<int32_t>>(B, prompt), kDecodeSteps);
    bool same = true;
    for (int i = 0; i < B; ++i) {
      same = same && g.tokens[i] == one.tokens[0];
      for (int s = 0; s <= kDecodeSteps && g.tokens[i][s] == one.tokens[0][s]; ++s)
        worst = std::max(worst, max_abs_diff(g.logits[i][s], one.logits[0][s]));
    }
    bad_batches += !same;
    EXPECT_TRUE(same) << "batch of " << B << " copies: greedy output differs from batch 1";
  }
  std::printf("[ batch    ] kiln-tiny kv=bf16: batches of 1..64 copies of one request: %d batch sizes differ; max "
              "|dlogit| vs batch 1 %.2e\n",
              bad_batches, worst);
}

// generate() on the CPU backend against transformers' greedy tokens (the harness, without a GPU).
TEST(CudaRunner, GenerateHarnessReproducesTransformersOnCpu) {
  const testing::Fixture fx = testing::Fixture::load("qwen3_5_moe_nvfp4");
  Engine cpu(make_cpu_backend(), fx.model_dir, DType::F32, 4, 256);
  const Generation g = generate(cpu, {fx.prompts[2].tokens, fx.prompts[1].tokens}, kDecodeSteps);
  for (int i = 0; i < 2; ++i) {
    const testing::Prompt& p = fx.prompts[2 - i];
    ASSERT_EQ(g.tokens[i].size(), static_cast<size_t>(kDecodeSteps + 1));
    EXPECT_EQ(std::vector<int32_t>(g.tokens[i].begin(), g.tokens[i].end()),
              std::vector<int32_t>(p.greedy_tokens.begin(), p.greedy_tokens.begin() + kDecodeSteps + 1));
  }
}

TEST(CudaRunner, DeviceFlagResolution) {
  // Runs everywhere: without a GPU, auto resolves to cpu and an explicit cuda is a clear error.
  const CudaDeviceProbe probe = probe_cuda_device();
  const DeviceChoice autod = resolve_device("auto");
  EXPECT_EQ(autod.device, probe.usable ? "cuda" : "cpu");
  EXPECT_EQ(resolve_device("cpu").device, "cpu");
  if (!probe.usable) {
    try {
      resolve_device("cuda");
      ADD_FAILURE() << "--device cuda without a GPU must fail";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--device cuda"), std::string::npos) << e.what();
      std::printf("[ device   ] %s\n", e.what());
    }
  }
  EXPECT_THROW(resolve_device("tpu"), Error);
}

// ---------------------------------------------------------------------------------------------------
// --load-format dummy, CUDA graphs, device argmax
TEST(CudaRunner, GraphReplayGivesTheEagerLogitsBitForBit) {
  KILN_REQUIRE_CUDA_DEVICE();
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  std::vector<std::vector<int32_t>> prompts = {{3, 4, 5}, {77}, {500, 501, 502, 503, 504, 505, 506, 507, 508}};
  Engine eager(std::make_unique<CudaOps>(), dir, DType::BF16, 4, 256, model::LoadFormat::safetensors, 0);
  CudaOptions plain, po;
  plain.pdl = false;
  po.pdl = true;  // programmatic dependent launch between the captured kernels (sm_90+)
  Engine graphed(std::make_unique<CudaOps>(plain), dir, DType::BF16, 4, 256);
  Engine graphed_pdl(std::make_unique<CudaOps>(po), dir, DType::BF16, 4, 256);
  // 40 steps: positions cross page-bucket boundaries (16, 32 tokens) so graphs of several shapes are captured.
  const Generation a = generate(eager, prompts, 40);
  const Generation b = generate(graphed, prompts, 40);
  const Generation c = generate(graphed_pdl, prompts, 40);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(a.tokens[i], b.tokens[i]) << "sequence " << i;
    EXPECT_EQ(a.tokens[i], c.tokens[i]) << "sequence " << i << " (PDL)";
    for (size_t s = 0; s < a.logits[i].size(); ++s) {
      ASSERT_EQ(a.logits[i][s], b.logits[i][s]) << i << " step " << s;
      ASSERT_EQ(a.logits[i][s], c.logits[i][s]) << i << " step " << s << " (PDL)";
    }
  }
  auto& ops = dynamic_cast<CudaOps&>(graphed.runner->ops());
  EXPECT_GE(ops.graphs(), 2);
  EXPECT_EQ(dynamic_cast<CudaOps&>(eager.runner->ops()).graphs(), 0);
  std::printf("[ graphs   ] kiln-tiny, 3 sequences x 40 decode steps: graphed == eager bit for bit (%d graphs)\n",
              ops.graphs());
}

// Speculative decoding as the engine runs it (greedy): the MTP head drafts K tokens per sequence, one verify pass
// keeps position checkpoints, each sequence accepts while the drafts are the target's argmax, and keep_verified sets
// its state to the last accepted token. Generated tokens equal plain greedy decoding; the verify passes replayed as
// CUDA graphs give the eager logits bit for bit.
struct SpecRun {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> verify_logits;  // per step, every sequence's K + 1 rows
  int accepted = 0, drafted = 0;
};

// carry: the steps run forward_argmax_carry and each chain starts from the carried first draft (the engine's default
// with greedy rows); no logits are kept then.
// defer (with carry, K >= 2): the chain after the carried first draft stays on the device for the verify
// (draft_deferred, SeqChunk::device_draft_row).
SpecRun speculate(Engine& e, const std::vector<std::vector<int32_t>>& prompts, int K, int min_tokens,
                  bool carry = false, bool defer = false) {
  defer = defer && carry && K >= 2;
  const size_t n = prompts.size();
  const int64_t V = e.vocab;
  SpecRun r;
  r.tokens.resize(n);
  std::vector<float> out(n * V);
  std::vector<model::SeqChunk> chunks(n);
  std::vector<int64_t> pos(n);
  for (size_t i = 0; i < n; ++i) {
    chunks[i].state_slot = static_cast<int>(i);
    chunks[i].tokens = prompts[i];
    chunks[i].page_table = e.page_tables[i];
    pos[i] = static_cast<int64_t>(prompts[i].size());
  }
  std::vector<int32_t> first(n), carried_row(n, 0), ids(n * (K + 1)), next(n * (K + 1));
  if (carry) {
    e.runner->forward_argmax_carry(chunks, ids, next);
    for (size_t i = 0; i < n; ++i) {
      r.tokens[i].push_back(ids[i]);
      first[i] = next[i];
    }
  } else {
    e.runner->forward(chunks, out);
    for (size_t i = 0; i < n; ++i) r.tokens[i].push_back(testing::argmax(out.data() + i * V, V));
  }
  std::vector<std::vector<int32_t>> verify(n);
  auto done = [&] {
    for (const auto& t : r.tokens)
      if (static_cast<int>(t.size()) < min_tokens) return false;
    return true;
  };
  while (!done()) {
    std::vector<model::DraftSeq> seqs(n);
    for (size_t i = 0; i < n; ++i) {
      seqs[i].state_slot = static_cast<int>(i);
      seqs[i].token = r.tokens[i].back();
      seqs[i].pos = pos[i];  // the pending token's position (the engine's tokens.size() - 1)
      seqs[i].page_table = e.page_tables[i];
      if (carry) {
        seqs[i].carried_row = carried_row[i];
        seqs[i].first_draft = first[i];
      }
    }
    std::vector<int32_t> drafted(n * K);
    if (defer) {
      e.runner->draft_deferred(seqs, K);
      for (size_t i = 0; i < n; ++i) {
        std::fill(drafted.begin() + i * K, drafted.begin() + (i + 1) * K, r.tokens[i].back());  // placeholders
        drafted[i * K] = first[i];
      }
    } else {
      e.runner->draft(seqs, K, drafted, {});
    }
    for (size_t i = 0; i < n; ++i) {
      verify[i] = {r.tokens[i].back()};
      verify[i].insert(verify[i].end(), drafted.begin() + i * K, drafted.begin() + (i + 1) * K);
      chunks[i].device_draft_row = defer ? static_cast<int>(i) : -1;
      chunks[i].tokens = verify[i];
      chunks[i].start_pos = pos[i];
      chunks[i].logits_tokens = K + 1;
      chunks[i].checkpoint_positions = true;
    }
    std::vector<float> logits(carry ? 0 : n * (K + 1) * V);
    if (carry) {
      std::vector<int32_t> chain(defer ? n * (K - 1) : 0);
      e.runner->forward_argmax_carry(chunks, ids, next, chain);
      for (size_t i = 0; defer && i < n; ++i)  // the chain's drafts, as the verify read them
        for (int k = 0; k + 1 < K; ++k) verify[i][static_cast<size_t>(k) + 2] = chain[i * (K - 1) + k];
    } else {
      e.runner->forward(chunks, logits);
      r.verify_logits.push_back(logits);
    }
    for (size_t i = 0; i < n; ++i) {
      int m = 0;  // drafts accepted
      for (int j = 0; j <= K; ++j) {
        const size_t row = i * (K + 1) + static_cast<size_t>(j);
        const int32_t target = carry ? ids[row] : testing::argmax(logits.data() + row * V, V);
        if (carry) {
          first[i] = next[row];
          carried_row[i] = j;
        }
        r.tokens[i].push_back(target);
        if (j == K || target != verify[i][static_cast<size_t>(j) + 1]) break;
        ++m;
      }
      r.accepted += m;
      r.drafted += K;
      e.runner->keep_verified(static_cast<int>(i), m + 1);
      pos[i] += m + 1;
    }
  }
  return r;
}

// With pdl, the graphed runner chains its captured kernels by programmatic dependent launch (--enable-pdl).
void check_speculative_graphs(bool pdl) {
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";  // ships a trained MTP head
  std::vector<std::vector<int32_t>> prompts = {{3, 4, 5}, {77}, {500, 501, 502, 503, 504, 505, 506, 507, 508}};
  constexpr int kTokens = 40;
  Engine plain(std::make_unique<CudaOps>(), dir, DType::F32, 4, 256);
  const Generation want = generate(plain, prompts, kTokens + 8);
  CudaOptions go;
  go.pdl = pdl;
  for (int K : {1, 3}) {
    // 12 state slots: as many position checkpoints, and 3 sequences of K = 3 drafts keep 9.
    Engine eager(std::make_unique<CudaOps>(), dir, DType::F32, 12, 256, model::LoadFormat::safetensors, 0, true);
    Engine graphed(std::make_unique<CudaOps>(go), dir, DType::F32, 12, 256, model::LoadFormat::safetensors, 256, true);
    ASSERT_GE(graphed.runner->position_checkpoints(), static_cast<int>(prompts.size()) * K);
    const SpecRun a = speculate(eager, prompts, K, kTokens);
    const SpecRun b = speculate(graphed, prompts, K, kTokens);
    EXPECT_GT(a.accepted, 0) << "K = " << K;
    EXPECT_LT(a.accepted, a.drafted) << "K = " << K;  // some rejected: keep_verified took a checkpoint
    for (size_t i = 0; i < prompts.size(); ++i) {
      const size_t n = std::min(a.tokens[i].size(), want.tokens[i].size());
      EXPECT_EQ(std::vector<int32_t>(a.tokens[i].begin(), a.tokens[i].begin() + n),
                std::vector<int32_t>(want.tokens[i].begin(), want.tokens[i].begin() + n))
          << "K = " << K << " sequence " << i;
      EXPECT_EQ(a.tokens[i], b.tokens[i]) << "K = " << K << " sequence " << i << (pdl ? " (PDL)" : "");
    }
    // Graphed and eager verify passes run the same kernels, but not always the same cuBLASLt algorithm (measured on an
    // H100: logits equal in their leading digits, not bit for bit at every step); the tokens above are the check,
    // the logits must agree to fp32 summation order.
    ASSERT_EQ(a.verify_logits.size(), b.verify_logits.size());
    double worst = 0;
    for (size_t s = 0; s < a.verify_logits.size(); ++s) {
      ASSERT_EQ(a.verify_logits[s].size(), b.verify_logits[s].size());
      double scale = 1e-30, diff = 0;
      for (size_t i = 0; i < a.verify_logits[s].size(); ++i) {
        scale = std::max(scale, std::fabs(static_cast<double>(a.verify_logits[s][i])));
        diff = std::max(diff, std::fabs(static_cast<double>(a.verify_logits[s][i]) - b.verify_logits[s][i]));
      }
      worst = std::max(worst, diff / scale);
    }
    EXPECT_LT(worst, 1e-5) << "K = " << K << (pdl ? " (PDL)" : "");
    std::printf("[ spec     ] K = %d%s: graphed vs eager verify logits, worst max |diff| / max |logit| %.2e\n", K,
                pdl ? " (PDL)" : "", worst);
    EXPECT_GE(dynamic_cast<CudaOps&>(graphed.runner->ops()).graphs(), 1) << "K = " << K;
    EXPECT_EQ(dynamic_cast<CudaOps&>(eager.runner->ops()).graphs(), 0);
    std::printf("[ spec     ] kiln-tiny K = %d, 3 sequences: %d of %d drafts accepted; verify graphs == eager tokens; "
                "tokens == plain greedy\n",
                K, a.accepted, a.drafted);
    // The same with carried first drafts (forward_argmax_carry, eager and graphed): plain greedy tokens, eager ==
    // graphed, and about the acceptance of the chain above (its drafts are the same up to the rounding of the head's
    // first entry, which ran in a pass of K + 2 entries instead of one).
    Engine ceager(std::make_unique<CudaOps>(), dir, DType::F32, 12, 256, model::LoadFormat::safetensors, 0, true);
    Engine cgraphed(std::make_unique<CudaOps>(go), dir, DType::F32, 12, 256, model::LoadFormat::safetensors, 256, true);
    // K = 3: the chain after the first draft stays on the device for the verify (draft_deferred), as the engine runs it.
    const SpecRun c = speculate(ceager, prompts, K, kTokens, /*carry=*/true, /*defer=*/true);
    const SpecRun d = speculate(cgraphed, prompts, K, kTokens, /*carry=*/true, /*defer=*/true);
    for (size_t i = 0; i < prompts.size(); ++i) {
      const size_t n = std::min(c.tokens[i].size(), want.tokens[i].size());
      EXPECT_EQ(std::vector<int32_t>(c.tokens[i].begin(), c.tokens[i].begin() + n),
                std::vector<int32_t>(want.tokens[i].begin(), want.tokens[i].begin() + n))
          << "carry K = " << K << " sequence " << i;
      EXPECT_EQ(c.tokens[i], d.tokens[i]) << "carry K = " << K << " sequence " << i << (pdl ? " (PDL)" : "");
    }
    EXPECT_EQ(c.accepted, d.accepted) << "carry K = " << K;
    EXPECT_GE(c.accepted * 10, a.accepted * 9) << "carry K = " << K;
    EXPECT_GE(dynamic_cast<CudaOps&>(cgraphed.runner->ops()).graphs(), 1) << "carry K = " << K;
    std::printf("[ spec     ] kiln-tiny K = %d, carried first drafts: %d of %d drafts accepted (chain: %d); graphs == "
                "eager tokens; tokens == plain greedy\n",
                K, c.accepted, c.drafted, a.accepted);
  }
}

TEST(CudaRunner, SpeculativeVerifyWithPositionCheckpointsEqualsGreedyAndGraphsEqualEager) {
  KILN_REQUIRE_CUDA_DEVICE();
  check_speculative_graphs(false);
}

// The same with programmatic dependent launch between the captured kernels (sm_90+; elsewhere the option is off and
// this repeats the test above). It failed until the sampling kernels stopped reading the lm_head's output through
// non-coherent loads (launch.cuh).
TEST(CudaRunner, SpeculativeVerifyGraphsWithPdlEqualEager) {
  KILN_REQUIRE_CUDA_DEVICE();
  check_speculative_graphs(true);
}

// The MTP draft chain without host round trips (Runner::draft without logits: each step's argmax stays on the device
// and feeds the next step, the ids come back in one download, the whole chain a CUDA graph per shape). Three kiln-tiny
// runners (its trained head, F32 KV) in lockstep over S sequences: `cpu` (the reference; it drafts through the host
// chain, logits asked for, so its margins are known), `eager` and `graphed`. Five rounds: all three draft K tokens from
// the same pending token and position, then run the same 3 tokens (new tokens, positions and page counts for the next
// chain; prompts of 34-40 tokens keep every chain's pages in one graph bucket: round 0 runs eagerly, round 1 captures,
// rounds 2-4 replay). eager's and graphed's tokens must be identical, and the target's logits after each chain too; the
// CPU's are compared step by step until a step whose own best two logits are within 2 kLogitTol (the backends' rounding
// may then pick the other; the chains part there).
struct DraftChainCheck {
  int drafts = 0;      // tokens each runner drafted
  int cpu_equal = 0;   // of them compared with the CPU's and equal
  int near_ties = 0;   // chains that parted from the CPU's at a near tie
};

DraftChainCheck check_draft_chains(Engine& cpu, Engine& eager, Engine& graphed, int S, int K) {
  const int64_t V = cpu.vocab;
  std::mt19937 rng(static_cast<uint32_t>(100 * S + K));
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(V) - 1);
  const int lengths[] = {34, 36, 40};
  std::vector<std::vector<int32_t>> inputs(static_cast<size_t>(S));
  for (int i = 0; i < S; ++i) {
    inputs[static_cast<size_t>(i)].resize(static_cast<size_t>(lengths[i]));
    for (int32_t& t : inputs[static_cast<size_t>(i)]) t = tok(rng);
  }
  std::vector<int64_t> pos(static_cast<size_t>(S), 0);
  Engine* engines[] = {&cpu, &eager, &graphed};
  DraftChainCheck c;
  for (int round = 0; round < 5; ++round) {
    // The step: every engine runs the same tokens; the pending tokens are the CPU's argmax.
    std::vector<std::vector<float>> logits(3, std::vector<float>(static_cast<size_t>(S * V)));
    for (int e = 0; e < 3; ++e) {
      std::vector<model::SeqChunk> chunks(static_cast<size_t>(S));
      for (int i = 0; i < S; ++i) {
        model::SeqChunk& ch = chunks[static_cast<size_t>(i)];
        ch.state_slot = i;
        ch.tokens = inputs[static_cast<size_t>(i)];
        ch.start_pos = pos[static_cast<size_t>(i)];
        ch.page_table = engines[e]->page_tables[static_cast<size_t>(i)];
      }
      engines[e]->runner->forward(chunks, logits[static_cast<size_t>(e)]);
    }
    EXPECT_EQ(logits[1], logits[2]) << "S " << S << " K " << K << " round " << round << ": eager vs graphed target";
    std::vector<model::DraftSeq> seqs(static_cast<size_t>(S));
    for (int i = 0; i < S; ++i) {
      pos[static_cast<size_t>(i)] += static_cast<int64_t>(inputs[static_cast<size_t>(i)].size());
      seqs[static_cast<size_t>(i)].state_slot = i;
      seqs[static_cast<size_t>(i)].token = testing::argmax(logits[0].data() + i * V, V);
      seqs[static_cast<size_t>(i)].pos = pos[static_cast<size_t>(i)];
    }
    // The chains.
    std::vector<std::vector<int32_t>> drafted(3, std::vector<int32_t>(static_cast<size_t>(S * K), -1));
    std::vector<float> cpu_logits(static_cast<size_t>(S * K * V));
    for (int e = 0; e < 3; ++e) {
      std::vector<model::DraftSeq> mine = seqs;
      for (int i = 0; i < S; ++i) mine[static_cast<size_t>(i)].page_table = engines[e]->page_tables[static_cast<size_t>(i)];
      engines[e]->runner->draft(mine, K, drafted[static_cast<size_t>(e)],
                                e == 0 ? std::span<float>(cpu_logits) : std::span<float>());
    }
    EXPECT_EQ(drafted[1], drafted[2]) << "S " << S << " K " << K << " round " << round << ": eager vs graphed chain";
    for (int i = 0; i < S; ++i) {
      for (int k = 0; k < K; ++k) {
        const size_t r = static_cast<size_t>(i * K + k);
        const float* row = cpu_logits.data() + r * V;
        const int32_t want = drafted[0][r];
        if (drafted[2][r] == want) {
          ++c.cpu_equal;
          continue;
        }
        float second = -INFINITY;
        for (int64_t v = 0; v < V; ++v)
          if (v != want) second = std::max(second, row[v]);
        const double margin = static_cast<double>(row[want]) - second;
        EXPECT_LE(margin, 2 * kLogitTol) << "S " << S << " K " << K << " round " << round << " sequence " << i
                                         << " step " << k << ": cuda drafted " << drafted[2][r] << ", cpu " << want;
        ++c.near_ties;
        break;  // the chains part here
      }
    }
    c.drafts += S * K;
    // The next step's inputs: the pending token and two more.
    for (int i = 0; i < S; ++i) inputs[static_cast<size_t>(i)] = {seqs[static_cast<size_t>(i)].token, tok(rng), tok(rng)};
  }
  return c;
}

void check_draft_chain_graphs(bool pdl) {
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";  // ships a trained MTP head
  CudaOptions go;
  go.pdl = pdl;
  for (int S : {1, 3}) {
    for (int K = 1; K <= 4; ++K) {
      Engine cpu(make_cpu_backend(), dir, DType::F32, 4, 256, model::LoadFormat::safetensors, 0, true);
      Engine eager(std::make_unique<CudaOps>(), dir, DType::F32, 4, 256, model::LoadFormat::safetensors, 0, true);
      Engine graphed(std::make_unique<CudaOps>(go), dir, DType::F32, 4, 256, model::LoadFormat::safetensors, 256, true);
      ASSERT_EQ(graphed.runner->mtp_layers(), 1);
      const DraftChainCheck c = check_draft_chains(cpu, eager, graphed, S, K);
      // One graph: the draft chain's (the steps of 3 tokens with one logits row are not captured).
      EXPECT_EQ(dynamic_cast<CudaOps&>(graphed.runner->ops()).graphs(), 1) << "S " << S << " K " << K;
      EXPECT_EQ(dynamic_cast<CudaOps&>(eager.runner->ops()).graphs(), 0);
      EXPECT_GT(c.cpu_equal, c.drafts / 2) << "S " << S << " K " << K;
      std::printf("[ draft    ] kiln-tiny S = %d K = %d%s: graphed chain == eager chain (%d tokens over 5 calls); %d "
                  "equal to the CPU's, %d chains parted at a near tie\n",
                  S, K, pdl ? " (PDL)" : "", c.drafts, c.cpu_equal, c.near_ties);
    }
  }
}

TEST(CudaRunner, DraftChainAsOneGraphEqualsTheEagerChainAndTheCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  check_draft_chain_graphs(false);
}

// The same with programmatic dependent launch between the captured kernels (sm_90+), as the test above.
TEST(CudaRunner, DraftChainGraphWithPdlEqualsTheEagerChain) {
  KILN_REQUIRE_CUDA_DEVICE();
  check_draft_chain_graphs(true);
}

// The same harness with three CPU runners (no GPU needed): the bookkeeping above, and the CPU's device chain (no logits)
// against its host chain.
TEST(CudaRunner, DraftChainHarnessOnCpu) {
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  for (int S : {1, 3}) {
    const int K = S == 1 ? 4 : 2;
    Engine a(make_cpu_backend(), dir, DType::F32, 4, 256, model::LoadFormat::safetensors, 0, true);
    Engine b(make_cpu_backend(), dir, DType::F32, 4, 256, model::LoadFormat::safetensors, 0, true);
    Engine c(make_cpu_backend(), dir, DType::F32, 4, 256, model::LoadFormat::safetensors, 256, true);
    const DraftChainCheck r = check_draft_chains(a, b, c, S, K);
    EXPECT_EQ(r.drafts, 5 * S * K);
    EXPECT_EQ(r.cpu_equal, r.drafts);
    EXPECT_EQ(r.near_ties, 0);
  }
}

TEST(CudaRunner, DummyWeightsGiveTheCpusLogits) {
  KILN_REQUIRE_CUDA_DEVICE();
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  Engine cpu(make_cpu_backend(), dir, DType::F32, 2, 128, model::LoadFormat::dummy);
  Engine gpu(std::make_unique<CudaOps>(), dir, DType::F32, 2, 128, model::LoadFormat::dummy);
  const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4, 5, 6, 7, 8}, {1000, 20}};
  const Generation a = generate(gpu, prompts, 8);
  const Generation b = generate(cpu, prompts, 8);
  double worst = 0, scale = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(a.tokens[i], b.tokens[i]) << "sequence " << i;
    for (size_t s = 0; s < a.logits[i].size() && a.tokens[i][s] == b.tokens[i][s]; ++s) {
      worst = std::max(worst, max_abs_diff(a.logits[i][s], b.logits[i][s]));
      for (float v : b.logits[i][s]) scale = std::max(scale, std::fabs(static_cast<double>(v)));
    }
  }
  EXPECT_LE(worst, 1e-5 * std::max(1.0, scale));
  std::printf("[ dummy    ] kiln-tiny config, dummy weights: cuda vs cpu max |dlogit| %.2e (max |logit| %.2f)\n",
              worst, scale);
}

// Two kiln-tiny runners on the GPU and the same 4-prompt prefill step for each: one gives the logits, the other the
// tokens picked on the device.
struct TinyPair {
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  Engine a{std::make_unique<CudaOps>(), dir, DType::BF16, 4, 128};
  Engine b{std::make_unique<CudaOps>(), dir, DType::BF16, 4, 128};
  const std::vector<std::vector<int32_t>> prompts = {{10, 11}, {12}, {13, 14, 15}, {16}};
  std::vector<model::SeqChunk> ca = std::vector<model::SeqChunk>(4), cb = std::vector<model::SeqChunk>(4);
  TinyPair() {
    for (int i = 0; i < 4; ++i) {
      ca[i].state_slot = cb[i].state_slot = i;
      ca[i].tokens = cb[i].tokens = prompts[i];
      ca[i].page_table = a.page_tables[i];
      cb[i].page_table = b.page_tables[i];
    }
  }
};

TEST(CudaRunner, DeviceArgmaxIsTheHostArgmax) {
  KILN_REQUIRE_CUDA_DEVICE();
  TinyPair t;
  Engine &a = t.a, &b = t.b;
  std::vector<model::SeqChunk>& ca = t.ca;
  std::vector<model::SeqChunk>& cb = t.cb;
  std::vector<float> logits(4 * a.vocab);
  std::vector<int32_t> ids(4);
  a.runner->forward(ca, logits);
  b.runner->forward_argmax(cb, ids);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(ids[i], testing::argmax(logits.data() + i * a.vocab, a.vocab)) << i;
}

// ---------------------------------------------------------------------------------------------------
// Device sampling (CudaOps::sample_rows, Runner::forward_sample) against model::sample_row_host.
//
// The device sums the probabilities in another order than the host (trees and per-thread segments there, running
// sums here), so in principle a token could differ when a uniform or a top-p / min-p threshold lands within ~1e-12
// (relative) of a boundary. With these random inputs that does not happen: the tokens must be identical, row by row.

TEST(CudaRunner, DeviceSamplingIsTheHostSampling) {
  KILN_REQUIRE_CUDA_DEVICE();
  TinyPair t;
  Engine &a = t.a, &b = t.b;
  std::vector<model::SeqChunk>& ca = t.ca;
  std::vector<model::SeqChunk>& cb = t.cb;
  std::vector<model::RowSampling> rows(4);
  rows[0].temperature = 0.0f;
  rows[1].temperature = 0.8f;
  rows[1].top_p = 0.9f;
  rows[1].u = 0.37;
  rows[2].temperature = 1.0f;
  rows[2].top_k = 20;
  rows[2].u = 0.91;
  rows[3].temperature = 1.5f;
  rows[3].min_p = 0.05f;
  rows[3].u = 0.05;
  std::vector<float> logits(4 * a.vocab);
  std::vector<int32_t> ids(4);
  a.runner->forward(ca, logits);
  b.runner->forward_sample(cb, rows, ids);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(ids[i], model::sample_row_host(logits.data() + i * a.vocab, a.vocab, rows[i])) << i;
}


}  // namespace
}  // namespace kiln::backend::cuda
