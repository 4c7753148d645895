// CudaOps against the CPU oracle (skipped without a usable GPU: CI has none).
//  - Every op on random inputs at several shapes (backend/cuda/self_check.h's compare_ops: tiny, odd sizes, the
//    397B's head / state sizes), fp32 paths at rel-L2 <= 1e-5; the startup self-check itself.
//  - Whole models through the generic Runner on both backends: every transformers reference fixture and kiln-tiny,
//    prefill + 20 greedy decode steps (identical greedy tokens, logits within 2e-4; also against transformers'
//    own logits), a batch of mixed lengths against each sequence alone, and batches of 1..64 copies of one
//    request giving identical greedy output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../model/reference_fixture.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/self_check.h"
#include "backend/device.h"
#include "format/model_dir.h"
#include "model/runner.h"
#include "cuda_test_util.h"

namespace kiln::backend::cuda {
namespace {

using ::kiln::cuda::test::ScopedEnv;

#define KILN_REQUIRE_CUDA_DEVICE()                                                        \
  do {                                                                                    \
    const CudaDeviceProbe probe_ = probe_cuda_device();                                   \
    if (!probe_.usable) GTEST_SKIP() << "no usable CUDA device: " << probe_.reason;       \
  } while (0)

// ---------------------------------------------------------------------------------------------------
// Ops

void expect_all_pass(const std::vector<OpCheck>& results, const std::string& label) {
  double worst = 0;
  for (const OpCheck& r : results) {
    std::printf("[ op       ] %s | %s%s\n", label.c_str(), r.str().c_str(), r.passed() ? "" : "  <-- FAIL");
    EXPECT_TRUE(r.passed()) << label << ": " << r.str();
    worst = std::max(worst, r.rel_err);
  }
  std::printf("[ ops      ] %s: %zu checks, worst rel error %.2e\n", label.c_str(), results.size(), worst);
}

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

TEST(CudaOps, EveryOpMatchesCpuAtQwen35HeadSizes) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
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
  expect_all_pass(compare_ops(gpu, *cpu, c), "qwen3.5 head sizes");
}

// The routed-expert kernels: NVFP4 experts on tensor cores with x split into 3 (default) or 2 bf16 parts, their block
// shapes (KILN_MOE_MT row tiles per block for decode-sized tiles, KILN_MOE_SUB token sub-tiles for prefill-sized
// ones, KILN_MOE_XSMEM the prefill kernel with x staged in shared memory, KILN_MOE_OCC the decode kernels' blocks per
// SM; all read when the backend starts), and the fp32 CUDA-core kernels (KILN_MOE_MMA=0), each against the CPU at
// shapes the tensor-core path takes (H, I multiples of 128; 1 to 20 rows per expert, so row tiles of 8 to 32 rows;
// 200 rows give row tiles of 16).
TEST(CudaOps, RoutedExpertsEveryPathMatchesCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  auto cpu = make_cpu_backend();
  struct Variant {
    const char* mma;
    const char* mt;
    const char* sub;
    const char* xsmem = nullptr;
    const char* occ = nullptr;
  };
  // XSMEM unset: the default (prefill tiles on the shared-memory kernel, 2 sub-tiles); XSMEM=0 (or SUB=4): the
  // register kernel.
  for (const Variant& v : {Variant{"3", nullptr, nullptr}, Variant{"2", nullptr, nullptr}, Variant{"3", "1,1", "4"},
                           Variant{"3", "4,8", nullptr}, Variant{"3", "8,2", nullptr},
                           Variant{"3", nullptr, nullptr, "0"}, Variant{"2", nullptr, nullptr, "0"},
                           Variant{"3", nullptr, nullptr, "2"}, Variant{"2", nullptr, nullptr, "2"},
                           Variant{"3", "1,2", nullptr, nullptr, "3,3"}, Variant{"3", "4,8", nullptr, nullptr, "4,4"},
                           Variant{"3", "2,4", nullptr, nullptr, "0,0"},
                           Variant{"0", nullptr, nullptr}}) {
    const ScopedEnv env({{"KILN_MOE_MMA", v.mma},
                         {"KILN_MOE_MT", v.mt},
                         {"KILN_MOE_SUB", v.sub},
                         {"KILN_MOE_XSMEM", v.xsmem},
                         {"KILN_MOE_OCC", v.occ}});
    CudaOps gpu;  // reads the knobs when it starts
    const std::string label = fmt::format("KILN_MOE_MMA={} MT={} SUB={} XSMEM={} OCC={}", v.mma, v.mt ? v.mt : "-",
                                          v.sub ? v.sub : "-", v.xsmem ? v.xsmem : "-", v.occ ? v.occ : "-");
    const bool mma = std::string(v.mma) != "0";
    EXPECT_EQ(gpu.describe().find("tensor cores off") == std::string::npos, mma) << gpu.describe();
    OpCheckConfig c;
    c.seed = 7;
    c.hidden = 256;
    c.expert_inter = 384;
    c.experts = 160;  // routing: 5 experts per lane
    c.top_k = 8;
    c.linear_rows = {1, 3, 8, 40, 200, 400};  // 200 x 8 / 160: 10 rows per expert, row tiles of 16
    std::vector<OpCheck> moe;
    for (const OpCheck& r : compare_ops(gpu, *cpu, c))
      if (r.op.rfind("moe_", 0) == 0) moe.push_back(r);
    // routing ids and weights, renormalised or not; 2 weight formats x (7 row counts + shared)
    EXPECT_EQ(moe.size(), 20u);
    expect_all_pass(moe, label);
  }
}

// Dense linears at 16..64 rows: the gemv for small weights (multi-linear launches included), cuBLASLt for large ones,
// and with KILN_CUDA_BLAS=0 everything on the fp32 kernels, against the CPU.
TEST(CudaOps, DenseLinearPathsMatchCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  auto cpu = make_cpu_backend();
  for (const char* mode : {"1", "0"}) {
    const ScopedEnv env({{"KILN_CUDA_BLAS", mode}});
    CudaOps gpu;
    OpCheckConfig c;
    c.seed = 8;
    c.hidden = 384;
    c.out_features = 96;
    c.linear_rows = {16, 24, 33, 64, 65};
    std::vector<OpCheck> lin;
    for (const OpCheck& r : compare_ops(gpu, *cpu, c))
      if (r.op.rfind("linear", 0) == 0) lin.push_back(r);
    EXPECT_GE(lin.size(), 40u);
    expect_all_pass(lin, std::string("KILN_CUDA_BLAS=") + mode);
  }
}

// The chunked delta rule on the GPU (KILN_DELTA_RULE=chunked: every multi-token step) against the CPU's token-by-token
// recurrence, at the Qwen3.5 head sizes (Dk = Dv = 128, partial chunks, several sequences, continuations from a
// carried state) and at odd sizes (Dk 40, Dv 40: padded keys, a masked value tile).
TEST(CudaOps, ChunkedDeltaRuleMatchesCpuRecurrence) {
  KILN_REQUIRE_CUDA_DEVICE();
  auto cpu = make_cpu_backend();
  const ScopedEnv env({{"KILN_DELTA_RULE", "chunked"}});
  CudaOps gpu;
  EXPECT_NE(gpu.describe().find("KILN_DELTA_RULE=chunked"), std::string::npos) << gpu.describe();
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

TEST(CudaOps, SelfCheckPasses) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
  EXPECT_NO_THROW(self_check(gpu, *cpu));
  // The factory path (resolve + self-check) too.
  const DeviceChoice choice = resolve_device("auto");
  EXPECT_EQ(choice.device, "cuda") << choice.reason;
  EXPECT_NO_THROW(make_ops("cuda", true));
}

TEST(CudaOps, DescribesTheDevice) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  std::printf("[ describe ] %s\n", gpu.describe().c_str());
  EXPECT_NE(gpu.describe().find("compute capability"), std::string::npos);
}

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
         model::LoadFormat load_format = model::LoadFormat::safetensors, int graph_max_batch = 256) {
    model::RunnerOptions ro;
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

TEST(CudaOps, RandomFillIsTheHostsBytes) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  struct Case {
    DType dtype;
    model::RandomFill fill;
  };
  std::vector<Case> cases;
  model::RandomFill f;
  f.kind = model::RandomFill::Kind::bytes;
  f.seed = 11;
  cases.push_back({DType::U8, f});
  f.byte_lo = 0x28;
  f.byte_hi = 0x48;
  f.random_sign = true;
  cases.push_back({DType::F8_E4M3, f});
  f = model::RandomFill();
  f.lo = -0.0383f;
  f.hi = 0.0383f;
  f.seed = 12;
  for (DType d : {DType::F32, DType::BF16, DType::F16}) cases.push_back({d, f});
  for (const Case& c : cases) {
    const int64_t n = 1000003;
    const TensorView dev = gpu.place_random(c.dtype, Shape{n}, c.fill);
    std::vector<uint8_t> got(n * dtype_size(c.dtype)), want(got.size());
    gpu.download(dev, got.data());
    model::fill_random_host(c.dtype, n, c.fill, want.data());
    EXPECT_EQ(got, want) << dtype_name(c.dtype);
  }
}

TEST(CudaRunner, GraphReplayGivesTheEagerLogitsBitForBit) {
  KILN_REQUIRE_CUDA_DEVICE();
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  std::vector<std::vector<int32_t>> prompts = {{3, 4, 5}, {77}, {500, 501, 502, 503, 504, 505, 506, 507, 508}};
  Engine eager(std::make_unique<CudaOps>(), dir, DType::BF16, 4, 256, model::LoadFormat::safetensors, 0);
  Engine graphed(std::make_unique<CudaOps>(), dir, DType::BF16, 4, 256);
  // 40 steps: positions cross page-bucket boundaries (16, 32 tokens) so graphs of several shapes are captured.
  const Generation a = generate(eager, prompts, 40);
  const Generation b = generate(graphed, prompts, 40);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(a.tokens[i], b.tokens[i]) << "sequence " << i;
    for (size_t s = 0; s < a.logits[i].size(); ++s) ASSERT_EQ(a.logits[i][s], b.logits[i][s]) << i << " step " << s;
  }
  auto& ops = dynamic_cast<CudaOps&>(graphed.runner->ops());
  EXPECT_GE(ops.graphs(), 2);
  EXPECT_EQ(dynamic_cast<CudaOps&>(eager.runner->ops()).graphs(), 0);
  std::printf("[ graphs   ] kiln-tiny, 3 sequences x 40 decode steps: graphed == eager bit for bit (%d graphs)\n",
              ops.graphs());
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

// Logits of several kinds: continuous, heavy ties (8 levels), -inf entries, one dominant token, all equal.
std::vector<float> sampling_test_row(std::mt19937_64& rng, int64_t V, int kind) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> l(static_cast<size_t>(V));
  for (auto& x : l) {
    switch (kind) {
      case 0: x = normal(rng); break;
      case 1: x = static_cast<float>(rng() % 8) * 0.5f; break;
      case 2: x = rng() % 4 == 0 ? -INFINITY : normal(rng); break;
      case 3: x = normal(rng) * 0.2f; break;
      default: x = 0.25f; break;
    }
  }
  if (kind == 2) l[static_cast<size_t>(rng() % static_cast<uint64_t>(V))] = 1.0f;  // a finite value
  if (kind == 3) l[static_cast<size_t>(rng() % static_cast<uint64_t>(V))] = 12.0f;
  return l;
}

struct SampleCase {
  std::vector<float> logits;  // [R, V]
  std::vector<model::RowSampling> rows;
};

// R rows of vocabulary V: parameters from the grid (every combination in turn), uniforms random.
SampleCase sampling_case(int64_t V, int R, uint64_t seed) {
  static const float temps[] = {0.0f, 0.3f, 0.7f, 1.0f, 1.3f, 2.0f};
  static const float top_ps[] = {1.0f, 0.9f, 0.5f, 0.01f};
  static const float min_ps[] = {0.0f, 0.05f};
  const int64_t top_ks[] = {0, 1, 5, 50, V};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  SampleCase c;
  c.logits.reserve(static_cast<size_t>(R * V));
  for (int r = 0; r < R; ++r) {
    int g = r;
    model::RowSampling rs;
    rs.temperature = temps[g % 6];
    g /= 6;
    rs.top_k = static_cast<int32_t>(top_ks[g % 5]);
    g /= 5;
    rs.top_p = top_ps[g % 4];
    g /= 4;
    rs.min_p = min_ps[g % 2];
    rs.u = uniform(rng);
    const std::vector<float> l = sampling_test_row(rng, V, static_cast<int>((r / 240 + r) % 5));
    c.logits.insert(c.logits.end(), l.begin(), l.end());
    c.rows.push_back(rs);
  }
  return c;
}

TEST(CudaOps, SampleRowsAreTheHostsTokens) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  int checked = 0, drawn = 0;
  for (auto [V, R] : {std::pair<int64_t, int>{1, 60}, {7, 480}, {1000, 960}, {50000, 480}, {248320, 240}}) {
    const SampleCase c = sampling_case(V, R, 1000 + static_cast<uint64_t>(V));
    gpu.reset_scratch();
    const TensorView logits = gpu.upload(c.logits.data(), DType::F32, Shape{R, V});
    std::vector<int32_t> ids(static_cast<size_t>(R), -2), again(static_cast<size_t>(R), -2);
    gpu.sample_rows(logits, c.rows, ids);
    gpu.sample_rows(logits, c.rows, again);
    EXPECT_EQ(ids, again) << "V " << V << ": the same inputs, the same tokens";
    model::SampleScratch scratch;
    int bad = 0;
    for (int r = 0; r < R; ++r) {
      const model::RowSampling& rs = c.rows[static_cast<size_t>(r)];
      const int32_t want = model::sample_row_host(c.logits.data() + r * V, V, rs, scratch);
      if (ids[static_cast<size_t>(r)] != want && ++bad <= 10)
        ADD_FAILURE() << "V " << V << " row " << r << ": device " << ids[static_cast<size_t>(r)] << ", host " << want
                      << " (T " << rs.temperature << " top_k " << rs.top_k << " top_p " << rs.top_p << " min_p "
                      << rs.min_p << " u " << rs.u << ")";
      ++checked;
      drawn += rs.temperature >= 1e-6f;
    }
    EXPECT_EQ(bad, 0) << "V " << V;
  }
  std::printf("[ sample   ] %d rows (%d drawn, the rest greedy): device tokens == host tokens\n", checked, drawn);
}

TEST(CudaOps, SampleRowsEdgeCases) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  const int64_t V = 4;
  const float l3 = std::log(3.0f);
  struct Row {
    std::vector<float> logits;
    model::RowSampling rs;
    int32_t want;
  };
  auto rs = [](float t, int k, float p, float m, double u) { return model::RowSampling{t, k, p, m, u}; };
  const std::vector<Row> rows = {
      {{1, 3, 3, 2}, rs(0, 0, 1, 0, 0), 1},                    // greedy: lowest id of the tie
      {{-0.0f, 0.0f, -1, -2}, rs(0, 0, 1, 0, 0), 0},           // -0 ties +0
      {{-INFINITY, -INFINITY, -INFINITY, -INFINITY}, rs(1, 0, 1, 0, 0.5), -1},
      {{-INFINITY, -INFINITY, -INFINITY, -INFINITY}, rs(0, 0, 1, 0, 0.5), -1},
      {{0, INFINITY, 0, 0}, rs(1, 0, 1, 0, 0.5), -1},
      {{0, 0, 0, 0}, rs(1, 0, 1, 0, 0.2499), 0},               // the draw walks ascending ids
      {{0, 0, 0, 0}, rs(1, 0, 1, 0, 0.25), 1},
      {{0, 0, 0, 0}, rs(1, 0, 1, 0, 0.99), 3},
      {{5, 1, 5, 5}, rs(1, 1, 1, 0, 0.5), 2},                  // top-k keeps the ties with the k-th
      {{0, 0, 0, 0}, rs(1, 0, 0.5f, 0, 0.99), 1},              // top-p: the lower ids of a tie
      {{0, 0, 0, 0}, rs(1, 0, 0.6f, 0, 0.99), 2},              // the crossing token is kept
      {{0, l3, l3, l3}, rs(1, 0, 0.5f, 0, 0.6), 2},
      {{0, l3, l3, l3}, rs(1, 0, 0.5f, 0, 0.999), 2},
      {{0, std::log(0.5f), std::log(0.04f), -INFINITY}, rs(1, 0, 1, 0.05f, 0.999), 1},  // min-p
      {{0, std::log(0.5f), std::log(0.04f), -INFINITY}, rs(1, 0, 1, 0, 0.999), 2},
  };
  std::vector<float> logits;
  std::vector<model::RowSampling> params;
  for (const Row& r : rows) {
    logits.insert(logits.end(), r.logits.begin(), r.logits.end());
    params.push_back(r.rs);
  }
  const int R = static_cast<int>(rows.size());
  const TensorView view = gpu.upload(logits.data(), DType::F32, Shape{R, V});
  std::vector<int32_t> ids(static_cast<size_t>(R));
  gpu.sample_rows(view, params, ids);
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(model::sample_row_host(rows[r].logits.data(), V, rows[r].rs), rows[r].want) << "host, row " << r;
    EXPECT_EQ(ids[static_cast<size_t>(r)], rows[r].want) << "device, row " << r;
  }
}

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

// ---------------------------------------------------------------------------------------------------
// Prefill attention (backend/cuda/cuda_ops_attention_prefill.h): the flash-style kernel for prefill-shaped steps,
// called directly on the device inputs of CudaOps, against the CPU oracle and against the split-over-keys kernel
// (ops::attention) on the same inputs; CudaOps::attention (whichever path it takes) against the CPU too. Prefills
// from scratch, second chunks over a cached prefix, mixed prefill + decode steps, page sizes that tiles and lengths do
// not line up with, GQA ratios 1 to 16, head_dim 64 / 128 / 256, f32 (declined: the fallback's business), bf16 and
// e4m3 pools (k / v scales != 1). fp32-class accuracy: rel-L2 <= 1e-5.

#include <cuda_runtime_api.h>

#include <numeric>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops_args.h"
#include "backend/cuda/cuda_ops_attention_prefill.h"
#include "backend/cuda/cuda_ops_kernels.h"
#include "cuda_test_util.h"

namespace kiln::backend::cuda {
namespace {

namespace kops = ::kiln::cuda::ops;

constexpr double kPrefillTol = 1e-5;  // the op checks' fp32 tolerance

struct PrefillSeq {
  int cached = 0;  // tokens already in the pool (positions 0 .. cached - 1), stored by an earlier step
  int fresh = 0;   // this step's tokens (positions cached .. cached + fresh - 1)
};

struct PrefillCase {
  std::vector<PrefillSeq> seqs;
  int64_t q_heads = 16, kv_heads = 2, head_dim = 256;
  int page_size = 16;
  DType kv = DType::BF16;
  std::string str() const {
    std::string s = std::string(dtype_name(kv)) + " heads " + std::to_string(q_heads) + "/" + std::to_string(kv_heads) +
                    " D " + std::to_string(head_dim) + " page " + std::to_string(page_size) + " seqs";
    for (const PrefillSeq& q : seqs) s += " " + std::to_string(q.cached) + "+" + std::to_string(q.fresh);
    return s;
  }
};

std::vector<float> prefill_normal(std::mt19937& rng, size_t n, float stddev) {
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The pools and the query step of a case, built identically on `a` and `b` (b may be null: a alone): sequences get
// shuffled pages (page tables one entry wider than needed, the extra entry -1), an earlier step stores the cached
// tokens' K / V, the query step stores its own, then q. e4m3 scales come from the data (max |x| / 448, != 1).
struct PrefillSetup {
  HostStep now;
  model::KvLayerView cache_a, cache_b;
  model::StepLayout layout_a, layout_b;
  TensorView q_a, q_b;
};

PrefillSetup prefill_setup(model::Ops& a, model::Ops* b, const PrefillCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int S = static_cast<int>(c.seqs.size());
  const int64_t Hq = c.q_heads, Hkv = c.kv_heads, D = c.head_dim;
  const int ps = c.page_size;
  int max_pages = 1, total_pages = 1;  // one page no sequence uses
  std::vector<int> n_pages(S);
  for (int s = 0; s < S; ++s) {
    n_pages[s] = (c.seqs[s].cached + c.seqs[s].fresh + ps - 1) / ps;
    max_pages = std::max(max_pages, n_pages[s] + 1);
    total_pages += n_pages[s];
  }
  std::vector<int32_t> perm(total_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::vector<int32_t>> tables(S, std::vector<int32_t>(max_pages, -1));
  for (int s = 0, next = 0; s < S; ++s)
    for (int p = 0; p < n_pages[s]; ++p) tables[s][p] = perm[next++];

  HostStep hist;
  PrefillSetup st;
  hist.page_size = st.now.page_size = ps;
  hist.max_pages = st.now.max_pages = max_pages;
  for (int s = 0; s < S; ++s) {
    if (c.seqs[s].cached > 0) hist.add_seq(0, c.seqs[s].cached, s, tables[s]);
    st.now.add_seq(c.seqs[s].cached, c.seqs[s].fresh, s, tables[s]);
  }
  const int64_t Th = hist.num_tokens(), T = st.now.num_tokens();
  const std::vector<float> hk = prefill_normal(rng, Th * Hkv * D, 1.5f), hv = prefill_normal(rng, Th * Hkv * D, 1.0f);
  const std::vector<float> nk = prefill_normal(rng, T * Hkv * D, 1.5f), nv = prefill_normal(rng, T * Hkv * D, 1.0f);
  const std::vector<float> q = prefill_normal(rng, T * Hq * D, 1.0f);
  float k_scale = 1.0f, v_scale = 1.0f;
  if (c.kv == DType::F8_E4M3) {
    float km = 0, vm = 0;
    for (float x : hk) km = std::max(km, std::fabs(x));
    for (float x : nk) km = std::max(km, std::fabs(x));
    for (float x : hv) vm = std::max(vm, std::fabs(x));
    for (float x : nv) vm = std::max(vm, std::fabs(x));
    k_scale = km / 448.0f;
    v_scale = vm / 448.0f;
  }
  auto build = [&](model::Ops& ops, model::KvLayerView& cache, model::StepLayout& layout, TensorView& qv) {
    ops.reset_scratch();
    cache.k = ops.allocate(c.kv, Shape{total_pages, ps, Hkv, D});
    cache.v = ops.allocate(c.kv, Shape{total_pages, ps, Hkv, D});
    cache.k_scale = k_scale;
    cache.v_scale = v_scale;
    if (Th > 0) {
      const model::StepLayout lh = layout_on(ops, hist);
      ops.kv_store(ops.upload(hk.data(), DType::F32, Shape{Th, Hkv, D}),
                   ops.upload(hv.data(), DType::F32, Shape{Th, Hkv, D}), cache, lh);
    }
    layout = layout_on(ops, st.now);
    ops.kv_store(ops.upload(nk.data(), DType::F32, Shape{T, Hkv, D}), ops.upload(nv.data(), DType::F32, Shape{T, Hkv, D}),
                 cache, layout);
    qv = ops.upload(q.data(), DType::F32, Shape{T, Hq, D});
  };
  build(a, st.cache_a, st.layout_a, st.q_a);
  if (b) build(*b, st.cache_b, st.layout_b, st.q_b);
  return st;
}

// attention_prefill on the GPU setup's device inputs into a NaN-poisoned output (stream 0, synchronised). Returns
// whether it ran; `out` holds its result then.
bool run_attention_prefill(CudaOps& gpu, const PrefillSetup& st, const PrefillCase& c, float scale,
                           std::vector<float>& out) {
  const int64_t T = st.now.num_tokens(), Hq = c.q_heads, D = c.head_dim;
  const TensorView o = gpu.allocate(DType::F32, Shape{T, Hq, D});
  gpu.synchronize();
  KILN_CUDA_CHECK(cudaMemset(o.data, 0xff, o.nbytes()));
  const bool ran = kops::attention_prefill(st.q_a.ptr<const float>(), Hq, pool_args(st.cache_a),
                                           step_args(st.layout_a), scale,
                                           o.ptr<float>(), nullptr);
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  if (ran) {
    out.resize(static_cast<size_t>(o.numel()));
    gpu.download(o, out.data());
  }
  return ran;
}

// ops::attention (the split-over-keys kernels) on the same inputs.
std::vector<float> run_attention_split(CudaOps& gpu, const PrefillSetup& st, const PrefillCase& c, float scale) {
  const int64_t T = st.now.num_tokens(), Hq = c.q_heads, D = c.head_dim;
  const TensorView o = gpu.allocate(DType::F32, Shape{T, Hq, D});
  const kops::StepArgs sa = step_args(st.layout_a);
  ::kiln::cuda::DeviceBuffer ws(kops::attention_workspace_bytes(T, Hq, D, sa));
  gpu.synchronize();
  kops::attention(st.q_a.ptr<const float>(), Hq, pool_args(st.cache_a), sa, scale, o.ptr<float>(),
                  ws.data(), nullptr);
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> out(static_cast<size_t>(o.numel()));
  gpu.download(o, out.data());
  return out;
}

// Whether attention_prefill must serve `c` on this device (H100 / H200 class: every supported shape fits).
bool prefill_expected(const PrefillCase& c, int max_seq_tokens) {
  if (c.kv == DType::F32 || max_seq_tokens < kops::kAttentionPrefillMinTokens) return false;
  if (c.head_dim != 64 && c.head_dim != 128 && c.head_dim != 256) return false;
  return probe_cuda_device().major == 9;
}

// One case against the CPU: CudaOps::attention, attention_prefill (when it serves the case) and the split kernel.
// Returns whether attention_prefill ran.
bool check_prefill_case(CudaOps& gpu, model::Ops& cpu, const PrefillCase& c, uint32_t seed) {
  const std::string label = c.str();
  const PrefillSetup st = prefill_setup(gpu, &cpu, c, seed);
  const int64_t T = st.now.num_tokens(), Hq = c.q_heads, D = c.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));

  std::vector<float> want(static_cast<size_t>(T * Hq * D)), got(want.size());
  const TensorView out_r = cpu.allocate(DType::F32, Shape{T, Hq, D});
  cpu.attention(st.q_b, st.cache_b, st.layout_b, scale, out_r);
  cpu.download(out_r, want.data());
  const TensorView out_t = gpu.allocate(DType::F32, Shape{T, Hq, D});
  gpu.attention(st.q_a, st.cache_a, st.layout_a, scale, out_t);
  gpu.download(out_t, got.data());
  const double e_ops = ::kiln::cuda::test::rel_err(got, want);
  EXPECT_LE(e_ops, kPrefillTol) << "CudaOps::attention " << label;

  std::vector<float> pre;
  const bool ran = run_attention_prefill(gpu, st, c, scale, pre);
  EXPECT_EQ(ran, prefill_expected(c, st.now.max_seq_tokens)) << label;
  double e_pre = -1, e_split = -1;
  if (ran) {
    e_pre = ::kiln::cuda::test::rel_err(pre, want);
    EXPECT_LE(e_pre, kPrefillTol) << "attention_prefill vs cpu " << label;
    e_split = ::kiln::cuda::test::rel_err(pre, run_attention_split(gpu, st, c, scale));
    EXPECT_LE(e_split, kPrefillTol) << "attention_prefill vs ops::attention " << label;
  }
  std::printf("[ prefill  ] %-62s ops %.2e | prefill %s\n", label.c_str(), e_ops,
              ran ? (fmt::format("{:.2e} (vs split {:.2e})", e_pre, e_split)).c_str() : "declined");
  return ran;
}

TEST(CudaAttentionPrefill, MatchesCpuAcrossShapesAndPools) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
  struct Heads {
    int64_t q_heads, kv_heads, head_dim;
    int page_size;
  };
  const std::vector<Heads> heads = {
      {2, 2, 128, 16},   // GQA 1
      {8, 2, 256, 16},   // GQA 4
      {16, 2, 256, 16},  // GQA 8: the 397B's shape per KV head
      {8, 1, 128, 32},   // GQA 8, pages of 32 (a 64-key tile spans two)
      {6, 2, 64, 8},     // GQA 3: a block's 64 rows straddle tokens; pages of 8
      {16, 1, 128, 16},  // GQA 16: 4 tokens per block
  };
  const std::vector<std::vector<PrefillSeq>> layouts = {
      {{0, 300}},                    // one prefill from scratch
      {{40, 1}, {0, 70}, {17, 1}},   // mixed: a 70-token prefill between two decoding sequences
      {{100, 37}},                   // a second chunk: 100 cached tokens, positions 100 .. 136
  };
  int ran = 0, cases = 0;
  uint32_t seed = 100;
  for (DType kv : {DType::F32, DType::BF16, DType::F8_E4M3})
    for (const Heads& h : heads)
      for (const auto& seqs : layouts) {
        PrefillCase c;
        c.seqs = seqs;
        c.q_heads = h.q_heads;
        c.kv_heads = h.kv_heads;
        c.head_dim = h.head_dim;
        c.page_size = h.page_size;
        c.kv = kv;
        ran += check_prefill_case(gpu, *cpu, c, ++seed) ? 1 : 0;
        ++cases;
      }
  std::printf("[ prefill  ] attention_prefill served %d of %d cases\n", ran, cases);
}

TEST(CudaAttentionPrefill, LongPromptsMatchCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
  for (DType kv : {DType::BF16, DType::F8_E4M3}) {
    PrefillCase c;
    c.kv = kv;
    c.seqs = {{0, 1000}};  // 125 blocks per KV head, up to 32 tiles of keys each
    check_prefill_case(gpu, *cpu, c, 7);
    c.seqs = {{700, 333}, {0, 16}, {5, 1}};  // a long second chunk, the shortest prefill the rule takes, a decode
    check_prefill_case(gpu, *cpu, c, 8);
  }
}

// 4096-token prompts (the CPU oracle would take too long): attention_prefill against the split-over-keys kernel.
TEST(CudaAttentionPrefill, FourThousandTokenPromptMatchesSplitKernel) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  for (DType kv : {DType::BF16, DType::F8_E4M3}) {
    PrefillCase c;
    c.kv = kv;
    c.seqs = {{0, 4096}};
    const PrefillSetup st = prefill_setup(gpu, nullptr, c, 11);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    std::vector<float> pre;
    const bool ran = run_attention_prefill(gpu, st, c, scale, pre);
    EXPECT_EQ(ran, prefill_expected(c, st.now.max_seq_tokens)) << c.str();
    if (!ran) continue;
    const double e = ::kiln::cuda::test::rel_err(pre, run_attention_split(gpu, st, c, scale));
    EXPECT_LE(e, kPrefillTol) << c.str();
    std::printf("[ prefill  ] %s: vs split kernel %.2e\n", c.str().c_str(), e);
  }
}

// The rule: steps, pools and shapes attention_prefill declines (host checks only: no device needed).
TEST(CudaAttentionPrefill, DeclinesWhatItDoesNotServe) {
  alignas(16) static float dummy[64];
  kops::KvPoolArgs pool;
  pool.k = pool.v = dummy;
  pool.elem = kops::ElemType::bf16;
  pool.kv_heads = 2;
  pool.head_dim = 256;
  kops::StepArgs step;
  step.num_tokens = 3;
  step.num_seqs = 3;
  step.max_pages = 4;
  step.page_size = 16;
  step.max_seq_tokens = 1;  // decode only
  EXPECT_FALSE(kops::attention_prefill(dummy, 16, pool, step, 0.0625f, dummy, nullptr));
  step.max_seq_tokens = kops::kAttentionPrefillMinTokens - 1;
  EXPECT_FALSE(kops::attention_prefill(dummy, 16, pool, step, 0.0625f, dummy, nullptr));
  step.num_tokens = step.max_seq_tokens = 300;
  step.num_seqs = 1;
  kops::KvPoolArgs f32 = pool;
  f32.elem = kops::ElemType::f32;
  EXPECT_FALSE(kops::attention_prefill(dummy, 16, f32, step, 0.0625f, dummy, nullptr));
  for (int32_t d : {32, 96, 512}) {
    kops::KvPoolArgs odd = pool;
    odd.head_dim = d;
    EXPECT_FALSE(kops::attention_prefill(dummy, 16, odd, step, 0.0625f, dummy, nullptr)) << "head_dim " << d;
  }
  EXPECT_FALSE(kops::attention_prefill(dummy, 15, pool, step, 0.0625f, dummy, nullptr));  // 15 heads over 2
  EXPECT_FALSE(kops::attention_prefill(dummy, 16, pool, step, 0.0625f, dummy + 1, nullptr));  // misaligned out
}

}  // namespace
}  // namespace kiln::backend::cuda
