// Runner consistency on the tiny fixtures (no reference needed: the engine against itself, F32 KV cache so only
// accumulation order differs): chunked prefill == one-shot prefill, prefill n + decode == prefill n+1, a mixed
// batch == each sequence alone, chunked delta rule == recurrence; plus FP8 KV scales and load-time errors.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "core/error.h"
#include "reference_fixture.h"

namespace kiln::testing {
namespace {

constexpr double kSelfTol = 5e-5;  // same maths, different summation order / chunking

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

backend::LoadOptions f32_kv() {
  backend::LoadOptions o;
  o.kv_dtype = DType::F32;
  return o;
}

// Hybrid (linear + full attention) and attention-only families.
const char* kModels[] = {"qwen3_5_moe_bf16", "qwen3_next_nvfp4", "qwen3_5_bf16", "qwen3_moe_bf16", "qwen3_bf16"};

TEST(Runner, ChunkedPrefillEqualsOneShot) {
  for (const char* name : kModels) {
    const Fixture fx = Fixture::load(name);
    const std::vector<int32_t>& prompt = fx.prompts[3].tokens;  // 90 tokens
    TestRunner one(fx.model_dir, f32_kv());
    const std::vector<float> want = one.run(0, prompt, 0);
    // (a) the runner splits the chunk itself (prefill_chunk 16);
    auto opts = f32_kv();
    opts.prefill_chunk = 16;
    TestRunner split(fx.model_dir, opts);
    const double d_split = max_diff(split.run(0, prompt, 0), want);
    // (b) the engine sends the prompt as chunks of uneven sizes.
    TestRunner engine(fx.model_dir, f32_kv());
    std::vector<float> got;
    const int64_t cuts[] = {0, 7, 40, 41, 64, 90};
    for (int i = 0; i + 1 < 6; ++i)
      got = engine.run(0, std::span(prompt).subspan(cuts[i], cuts[i + 1] - cuts[i]), cuts[i]);
    const double d_engine = max_diff(got, want);
    // And the decode that follows matches too.
    const int32_t next = argmax(want.data(), fx.vocab);
    const double d_decode = max_diff(engine.run(0, std::span(&next, 1), 90), one.run(0, std::span(&next, 1), 90));
    std::printf("[runner] %-18s chunked prefill: split %.2e, engine chunks %.2e, next decode %.2e\n", name, d_split,
                d_engine, d_decode);
    EXPECT_LT(d_split, kSelfTol) << name;
    EXPECT_LT(d_engine, kSelfTol) << name;
    EXPECT_LT(d_decode, kSelfTol) << name;
  }
}

TEST(Runner, PrefillThenDecodeEqualsLongerPrefill) {
  for (const char* name : kModels) {
    const Fixture fx = Fixture::load(name);
    const std::vector<int32_t>& prompt = fx.prompts[2].tokens;  // 33 tokens
    TestRunner a(fx.model_dir, f32_kv()), b(fx.model_dir, f32_kv());
    double worst = 0;
    a.run(0, std::span(prompt).first(20), 0);
    for (int64_t n = 20; n < 33; ++n) {
      const std::vector<float> decoded = a.run(0, std::span(prompt).subspan(n, 1), n);
      const std::vector<float> prefilled = b.run(0, std::span(prompt).first(n + 1), 0);
      worst = std::max(worst, max_diff(decoded, prefilled));
    }
    std::printf("[runner] %-18s prefill n + decode vs prefill n+1: %.2e\n", name, worst);
    EXPECT_LT(worst, kSelfTol) << name;
  }
}

TEST(Runner, MixedBatchEqualsEachAlone) {
  for (const char* name : kModels) {
    const Fixture fx = Fixture::load(name);
    const int64_t V = fx.vocab;
    auto opts = f32_kv();
    TestRunner batch(fx.model_dir, opts), alone(fx.model_dir, opts);
    // Step 1: prefill prompts 1 and 3 together with the first part of prompt 2 (no logits for it).
    const auto& p1 = fx.prompts[1].tokens;
    const auto& p2 = fx.prompts[2].tokens;
    const auto& p3 = fx.prompts[3].tokens;
    std::vector<model::SeqChunk> step1 = {batch.chunk(1, p1, 0), batch.chunk(2, std::span(p2).first(10), 0, false),
                                          batch.chunk(3, p3, 0)};
    std::vector<float> out1(2 * V);
    batch.runner->forward(step1, out1);
    // Step 2: a mixed step: decode for 1 and 3, the rest of prompt 2, and a fresh prompt 0 in slot 0.
    const int32_t n1 = argmax(&out1[0], V), n3 = argmax(&out1[V], V);
    std::vector<model::SeqChunk> step2 = {batch.chunk(3, std::span(&n3, 1), 90), batch.chunk(2, std::span(p2).subspan(10), 10),
                                          batch.chunk(0, fx.prompts[0].tokens, 0), batch.chunk(1, std::span(&n1, 1), 6)};
    std::vector<float> out2(4 * V);
    batch.runner->forward(step2, out2);

    double worst = 0;
    auto cmp = [&](const float* got, const std::vector<float>& want) {
      worst = std::max(worst, max_diff(std::vector<float>(got, got + V), want));
    };
    cmp(&out1[0], alone.run(1, p1, 0));
    cmp(&out1[V], alone.run(3, p3, 0));
    cmp(&out2[0], alone.run(3, std::span(&n3, 1), 90));
    cmp(&out2[V], alone.run(2, p2, 0));
    cmp(&out2[2 * V], alone.run(0, fx.prompts[0].tokens, 0));
    cmp(&out2[3 * V], alone.run(1, std::span(&n1, 1), 6));
    std::printf("[runner] %-18s mixed batch vs alone: %.2e\n", name, worst);
    EXPECT_LT(worst, kSelfTol) << name;
  }
}

TEST(Runner, ChunkedDeltaRuleEqualsRecurrence) {
  for (const char* name : {"qwen3_5_moe_bf16", "qwen3_next_bf16", "qwen3_5_bf16"}) {
    const Fixture fx = Fixture::load(name);
    auto opts = f32_kv();
    TestRunner chunked(fx.model_dir, opts);
    opts.prefill_delta_rule = model::DeltaRuleMode::recurrent;
    TestRunner recurrent(fx.model_dir, opts);
    const auto& prompt = fx.prompts[3].tokens;  // 90 tokens: two 64-token chunks
    const double d = max_diff(chunked.run(0, prompt, 0), recurrent.run(0, prompt, 0));
    std::printf("[runner] %-18s chunked vs recurrent delta rule (90-token prefill): %.2e\n", name, d);
    EXPECT_LT(d, kSelfTol) << name;
  }
}

TEST(Runner, ResetsStateForFreshSequences) {
  const Fixture fx = Fixture::load("qwen3_5_moe_bf16");
  TestRunner tr(fx.model_dir, f32_kv());
  const auto first = tr.run(0, fx.prompts[1].tokens, 0);
  tr.run(0, fx.prompts[2].tokens, 0);  // another sequence in the same slot
  EXPECT_EQ(max_diff(tr.run(0, fx.prompts[1].tokens, 0), first), 0.0);
}

TEST(Runner, Fp8KvCacheUsesCheckpointScalesOrFirstChunk) {
  // The mixed fixture carries k_scale / v_scale: they are used as given.
  {
    const Fixture fx = Fixture::load("qwen3_5_moe_mixed");
    auto opts = f32_kv();
    opts.kv_dtype = DType::F8_E4M3;
    TestRunner tr(fx.model_dir, opts);
    const auto scales = tr.impl().kv_scales();
    ASSERT_EQ(scales.size(), 1u);
    EXPECT_GT(scales[0].first, 0.0f);
    EXPECT_NE(scales[0].first, 1.0f);
    const Prompt& p = fx.prompts[3];
    const auto got = tr.run(0, p.tokens, 0);
    ErrorStats e;
    e.add(got.data(), &p.prefill_logits[(p.prefill_logits.size() / fx.vocab - 1) * fx.vocab], fx.vocab);
    std::printf("[runner] qwen3_5_moe_mixed kv=fp8 (checkpoint scales) last-logit max_rel %.2e\n", e.max_rel);
    EXPECT_LT(e.max_rel, 0.1);
  }
  // No scales in the checkpoint: computed from the first chunk (amax / 448).
  {
    const Fixture fx = Fixture::load("qwen3_bf16");
    auto opts = f32_kv();
    opts.kv_dtype = DType::F8_E4M3;
    TestRunner tr(fx.model_dir, opts);
    for (auto s : tr.impl().kv_scales()) EXPECT_EQ(s.first, 0.0f);
    const Prompt& p = fx.prompts[3];
    const auto got = tr.run(0, p.tokens, 0);
    for (auto s : tr.impl().kv_scales()) {
      EXPECT_GT(s.first, 0.0f);
      EXPECT_GT(s.second, 0.0f);
    }
    ErrorStats e;
    e.add(got.data(), &p.prefill_logits[(p.prefill_logits.size() / fx.vocab - 1) * fx.vocab], fx.vocab);
    std::printf("[runner] qwen3_bf16 kv=fp8 (first-chunk scales) last-logit max_rel %.2e\n", e.max_rel);
    EXPECT_LT(e.max_rel, 0.1);
  }
}

// A copy of a fixture's model folder with config.json edited.
std::string edited_copy(const std::string& fixture, const std::string& from, const std::string& to) {
  namespace fs = std::filesystem;
  const fs::path src = fixtures_root() + "/" + fixture + "/model";
  const fs::path dst = fs::temp_directory_path() / ("kiln_bad_" + fixture + "_" + std::to_string(::getpid()));
  fs::remove_all(dst);
  fs::create_directories(dst);
  for (const auto& e : fs::directory_iterator(src)) fs::copy(e.path(), dst / e.path().filename());
  std::ifstream in(dst / "config.json");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  std::ofstream(dst / "config.json") << text;
  return dst.string();
}

TEST(Runner, CheckpointNotMatchingConfigFailsAtLoad) {
  struct Case {
    const char* fixture;
    const char* from;
    const char* to;
    const char* expect;  // in the error message
  } cases[] = {
      {"qwen3_5_moe_bf16", "\"moe_intermediate_size\": 32", "\"moe_intermediate_size\": 48", "gate_up_proj"},
      {"qwen3_next_bf16", "\"linear_num_value_heads\": 4", "\"linear_num_value_heads\": 8", "linear_attn"},
      {"qwen3_bf16", "\"num_hidden_layers\": 4", "\"num_hidden_layers\": 5", "layers.4"},
      {"qwen3_moe_nvfp4", "\"hidden_size\": 64", "\"hidden_size\": 80", "does not match"},
  };
  for (const Case& c : cases) {
    const std::string dir = edited_copy(c.fixture, c.from, c.to);
    try {
      backend::load_cpu_model(format::ModelDir::open(dir), f32_kv());
      ADD_FAILURE() << c.fixture << ": loading a mismatched checkpoint succeeded";
    } catch (const Error& e) {
      const std::string msg = e.what();
      std::printf("[runner] %s with %s -> %s\n", c.fixture, c.to, msg.substr(0, msg.find('\n')).c_str());
      EXPECT_NE(msg.find(c.expect), std::string::npos) << msg;
    }
    std::filesystem::remove_all(dir);
  }
}

TEST(Runner, RejectsBadChunks) {
  const Fixture fx = Fixture::load("qwen3_5_bf16");
  TestRunner tr(fx.model_dir, f32_kv());
  std::vector<float> out(fx.vocab);
  const int32_t bad = static_cast<int32_t>(fx.vocab);
  auto c = tr.chunk(0, std::span(&bad, 1), 0);
  EXPECT_THROW(tr.runner->forward({&c, 1}, out), Error);
  const int32_t ok = 1;
  auto c2 = tr.chunk(9, std::span(&ok, 1), 0);
  EXPECT_THROW(tr.runner->forward({&c2, 1}, out), Error);
  std::vector<model::SeqChunk> two = {tr.chunk(0, std::span(&ok, 1), 0), tr.chunk(0, std::span(&ok, 1), 0)};
  std::vector<float> out2(2 * fx.vocab);
  EXPECT_THROW(tr.runner->forward(two, out2), Error);
}

}  // namespace
}  // namespace kiln::testing
