// Every registered model family (src/model/families.cpp and the family files it registers) against transformers'
// logits, one named case per fixture (tests/fixtures/reference, made by tools/reference/make_fixtures.py:
// transformers 5.17 in float32 on the checkpoint's exact weights). The cases run the family's forward over the
// shared blocks through the CPU Runner (runner.h) and the CPU backend.
//
// With an F32 KV cache kiln computes the same fp32 maths, so differences are accumulation-order noise:
// tolerance kTolF32 on every logit, and greedy tokens must match wherever the reference's top-2 gap exceeds
// twice the tolerance. With the default BF16 KV cache keys/values are rounded to bf16; in the MoE models that
// perturbation can flip a near-tied expert choice, which moves some logits a lot: there the check is the mean
// per-row relative error (kMeanRelBf16Kv), a loose bound on the worst row, and >= 95% greedy agreement.
//
// Last, model::all_reduces_per_pass (family.h): against a count by hand from the shipped configs, and against the
// all-reduces a decode pass of a lone tensor-parallel rank really makes in every family.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>

#include "core/error.h"
#include "format/model_config.h"
#include "format/model_dir.h"
#include "format/quant_config.h"
#include "format/shard_plan.h"
#include "model/family.h"
#include "model/forwarding_ops.h"
#include "reference_fixture.h"

namespace kiln::testing {
namespace {

constexpr double kTolF32 = 2e-4;     // max |kiln - transformers| on a logit, F32 KV cache
constexpr double kMeanRelBf16Kv = 5e-3;  // BF16 KV cache: mean over rows of max|err| / max|logit|
constexpr double kMaxRelBf16Kv = 0.3;    // BF16 KV cache: worst row (an expert-routing flip)

struct FixtureResult {
  ErrorStats prefill, greedy;
  double rel_sum = 0;
  int rows = 0;
  double mean_rel() const { return rows ? rel_sum / rows : 0; }
  void row(const float* got, const float* want, int64_t n) {
    ErrorStats e;
    e.add(got, want, n);
    rel_sum += e.max_rel;
    ++rows;
  }
  int greedy_checked = 0, greedy_mismatch = 0, greedy_skipped_near_tie = 0;
};

// Prefill logits at every stored position (a one-shot prefill of each prefix), then the greedy continuation
// teacher-forced with the reference tokens (prefill once, decode one token per step).
FixtureResult check_fixture(const Fixture& fx, DType kv_dtype, double tol) {
  backend::LoadOptions opts;
  opts.kv_dtype = kv_dtype;
  opts.state_slots = 2;
  TestRunner tr(fx.model_dir, opts);
  EXPECT_EQ(tr.vocab(), fx.vocab);
  const int64_t V = fx.vocab;
  FixtureResult res;
  for (const Prompt& p : fx.prompts) {
    const int64_t L = static_cast<int64_t>(p.tokens.size());
    const int64_t rows = static_cast<int64_t>(p.prefill_logits.size()) / V;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = p.prefill_first_pos + r;
      std::vector<float> got = tr.run(0, std::span(p.tokens).first(pos + 1), 0);
      res.prefill.add(got.data(), &p.prefill_logits[r * V], V);
      res.row(got.data(), &p.prefill_logits[r * V], V);
    }
    const int64_t S = static_cast<int64_t>(p.greedy_tokens.size());
    std::vector<float> got = tr.run(1, p.tokens, 0);
    for (int64_t s = 0; s < S; ++s) {
      if (s > 0) got = tr.run(1, std::span(p.greedy_tokens).subspan(s - 1, 1), L + s - 1);
      const float* want = &p.greedy_logits[s * V];
      res.greedy.add(got.data(), want, V);
      res.row(got.data(), want, V);
      std::vector<float> sorted(want, want + V);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
      if (sorted[0] - sorted[1] <= 2 * tol) {
        ++res.greedy_skipped_near_tie;
        continue;
      }
      ++res.greedy_checked;
      if (argmax(got.data(), V) != p.greedy_tokens[s]) ++res.greedy_mismatch;
    }
  }
  return res;
}

class ReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceTest, LogitsMatchTransformersF32Kv) {
  const Fixture fx = Fixture::load(GetParam());
  const FixtureResult r = check_fixture(fx, DType::F32, kTolF32);
  std::printf("[reference] %-22s kv=f32  prefill max_abs %.2e max_rel %.2e | decode max_abs %.2e max_rel %.2e | "
              "greedy %d/%d match (%d near-ties skipped)\n",
              fx.name.c_str(), r.prefill.max_abs, r.prefill.max_rel, r.greedy.max_abs, r.greedy.max_rel,
              r.greedy_checked - r.greedy_mismatch, r.greedy_checked, r.greedy_skipped_near_tie);
  EXPECT_LT(r.prefill.max_abs, kTolF32) << fx.name;
  EXPECT_LT(r.greedy.max_abs, kTolF32) << fx.name;
  EXPECT_EQ(r.greedy_mismatch, 0) << fx.name;
  EXPECT_GT(r.greedy_checked, 0);
}

TEST_P(ReferenceTest, LogitsMatchTransformersBf16Kv) {
  const Fixture fx = Fixture::load(GetParam());
  const FixtureResult r = check_fixture(fx, DType::BF16, 1e-2);
  std::printf("[reference] %-22s kv=bf16 prefill max_abs %.2e max_rel %.2e | decode max_abs %.2e max_rel %.2e | "
              "mean row rel %.2e | greedy %d/%d match (%d near-ties skipped)\n",
              fx.name.c_str(), r.prefill.max_abs, r.prefill.max_rel, r.greedy.max_abs, r.greedy.max_rel,
              r.mean_rel(), r.greedy_checked - r.greedy_mismatch, r.greedy_checked, r.greedy_skipped_near_tie);
  EXPECT_LT(r.mean_rel(), kMeanRelBf16Kv) << fx.name;
  EXPECT_LT(std::max(r.prefill.max_rel, r.greedy.max_rel), kMaxRelBf16Kv) << fx.name;
  EXPECT_LE(r.greedy_mismatch, r.greedy_checked / 20) << fx.name;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ReferenceTest, ::testing::ValuesIn(Fixture::all_names()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(ReferenceFixtures, AllFamiliesPresent) {
  const auto names = Fixture::all_names();
  for (const char* want : {"qwen3_5_moe_bf16", "qwen3_5_moe_nvfp4", "qwen3_5_moe_nvfp4all", "qwen3_5_moe_mixed",
                           "qwen3_5_bf16", "qwen3_next_bf16", "qwen3_next_nvfp4", "qwen3_moe_bf16",
                           "qwen3_moe_nvfp4", "qwen3_bf16"})
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
}

// ---- model::all_reduces_per_pass: the all-reduces of one forward pass on each rank of a tensor-parallel group.

// Counted by hand from the shipped config.json files (num_hidden_layers): one for the vocabulary-parallel embedding
// lookup, two per decoder layer (attention / DeltaNet output, MoE output), three more with the MTP head (its
// embedding lookup and its one layer). One device has none.
TEST(AllReducesPerPass, HandCountOfTheShippedConfigs) {
  const auto config = [](const char* name) {
    return format::load_model_config(format::ModelDir::open(std::string(KILN_SOURCE_DIR) + "/configs/" + name));
  };
  const format::ModelConfig a3b = config("qwen3.5-35b-a3b-nvfp4"), big = config("qwen3.5-397b-a17b-nvfp4");
  ASSERT_EQ(a3b.num_layers, 40);
  ASSERT_EQ(big.num_layers, 60);
  for (int tp : {2, 4, 8}) {
    EXPECT_EQ(model::all_reduces_per_pass(a3b, tp, false), 81) << tp;   // 1 + 40 x 2
    EXPECT_EQ(model::all_reduces_per_pass(a3b, tp, true), 84) << tp;    // + 1 + 2
    EXPECT_EQ(model::all_reduces_per_pass(big, tp, false), 121) << tp;  // 1 + 60 x 2
    EXPECT_EQ(model::all_reduces_per_pass(big, tp, true), 124) << tp;
  }
  EXPECT_EQ(model::all_reduces_per_pass(a3b, 1, false), 0);
  EXPECT_EQ(model::all_reduces_per_pass(big, 1, true), 0);
}

// Watches the model's all-reduces (the CPU backend's own is a no-op without a communicator).
class CountingAllReduce final : public model::ForwardingOps {
 public:
  using ForwardingOps::ForwardingOps;
  void all_reduce(TensorView x) override {
    sizes.push_back(x.numel());
    ForwardingOps::all_reduce(x);
  }
  std::vector<int64_t> sizes;  // numel of each call
};

// The calls one decode pass of 3 sequences really makes on rank 0 of TP 2 run alone (bench-engine --single-rank's
// runner, on the CPU), in every family and with an MTP head: as many as the function says, and by hand (each fixture
// has 4 layers: 1 + 4 x 2 = 9, 12 with the head), each of 3 x hidden floats.
TEST(AllReducesPerPass, EqualsTheCallsOfADecodePassOnEachFamily) {
  for (const char* name :
       {"qwen3_5_moe_bf16", "qwen3_5_moe_nvfp4", "qwen3_next_nvfp4", "qwen3_5_bf16", "qwen3_moe_bf16", "qwen3_bf16",
        "qwen3_5_moe_mtp"}) {
    SCOPED_TRACE(name);
    const format::ModelDir dir = format::ModelDir::open(fixtures_root() + "/" + name + "/model");
    const format::ModelConfig config = format::load_model_config(dir);
    ASSERT_EQ(config.num_layers, 4);
    const bool mtp = config.has_mtp();
    model::RunnerOptions ro;
    ro.kv_dtype = DType::F32;
    ro.state_slots = 3;
    ro.max_context = 32;
    ro.shard = format::plan_shards(config, format::load_quant_config(dir), 2).ranks[0];
    ro.lone_rank = true;
    ro.mtp = mtp;
    auto counting = std::make_unique<CountingAllReduce>(backend::make_cpu_backend());
    CountingAllReduce& seen = *counting;
    model::Runner runner(std::move(counting), dir, ro);
    ASSERT_EQ(runner.mtp_layers() > 0, mtp);
    const auto cap = runner.capacity();
    const int64_t pages = cap.kv_pages / cap.state_slots;
    std::vector<std::vector<int32_t>> tables(3), prompts(3, std::vector<int32_t>{5, 7}), next(3, {11});
    std::vector<model::SeqChunk> chunks(3);
    for (int b = 0; b < 3; ++b) {
      for (int64_t p = 0; p < pages; ++p) tables[b].push_back(static_cast<int32_t>(b * pages + p));
      chunks[b].state_slot = b;
      chunks[b].page_table = tables[b];
      chunks[b].tokens = prompts[b];
      chunks[b].start_pos = 0;
    }
    std::vector<int32_t> ids(3);
    runner.forward_argmax(chunks, ids);  // the prompts (a prefill pass; not counted)
    for (int b = 0; b < 3; ++b) {
      chunks[b].tokens = next[b];
      chunks[b].start_pos = 2;
    }
    seen.sizes.clear();
    runner.forward_argmax(chunks, ids);  // one decode pass
    const int64_t by_hand = mtp ? 12 : 9;
    EXPECT_EQ(static_cast<int64_t>(seen.sizes.size()), by_hand);
    EXPECT_EQ(model::all_reduces_per_pass(config, 2, mtp), by_hand);
    for (int64_t n : seen.sizes) EXPECT_EQ(n, 3 * config.hidden_size);
  }
}

}  // namespace
}  // namespace kiln::testing
