// The Runner (src/model/runner.*). Consistency on the tiny fixtures (no reference needed: the engine against itself, F32 KV cache so only
// accumulation order differs): chunked prefill == one-shot prefill, prefill n + decode == prefill n+1, a mixed
// batch == each sequence alone, chunked delta rule == recurrence; plus FP8 KV scales and load-time errors.
//
// Then the runner's decode-graph bookkeeping, host-only: a backend whose "graphs" record the ops of a captured pass
// (instead of running them) and run them when the graph is launched. The first decode pass of a shape must run
// eagerly, the next ones capture and launch; a stale graph (launch refused) is captured again; a capture that
// throws ends the capture; and the logits equal a plain CPU runner's bit for bit.
#include "model/runner.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <gtest/gtest.h>
#include <memory>
#include <string>
#include <unistd.h>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"
#include "format/model_config.h"
#include "format/model_dir.h"
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

// A pass of >= model::kLayerScratchReleaseMinTokens tokens frees each layer's scratch when the layer is done (its
// block output added to the residual stream there): on kiln-tiny (8 layers) a 300-token pass must hold well under
// what a 256-token pass holds (every layer's buffers), and its logits must be those of the same prompt run in passes
// of 100 tokens (which keep every layer's buffers).
TEST(Runner, LargePassesFreeEachLayersScratch) {
  const std::string tiny = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  std::vector<int32_t> prompt(300);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 13) % 2000);
  auto opts = f32_kv();
  opts.max_context = 512;
  TestRunner big(tiny, opts);
  const std::vector<float> want_short = big.run(0, std::span(prompt).first(256), 0);
  const size_t peak256 = big.impl().ops().scratch_peak_bytes();
  const std::vector<float> got = big.run(1, prompt, 0);
  const size_t peak300 = big.impl().ops().scratch_peak_bytes();
  ASSERT_GT(peak256, 0u) << "the CPU backend counts its scratch";
  std::printf("[runner] kiln-tiny scratch peak: 256-token pass %.2f MB, 300-token pass (layers freed) %.2f MB\n",
              peak256 / 1e6, peak300 / 1e6);
  EXPECT_LT(peak300 * 3, peak256);  // ~2 of 8 layers' buffers for 1.17x the tokens
  opts.prefill_chunk = 100;
  TestRunner split(tiny, opts);
  EXPECT_LT(max_diff(split.run(0, prompt, 0), got), kSelfTol);
  EXPECT_LT(max_diff(split.run(1, std::span(prompt).first(256), 0), want_short), kSelfTol);
}

// A prompt chunk with prefix-cache snapshots inside it (SeqChunk::snapshots): a 33-token chunk writes them as position
// checkpoints in its one pass; a 90-token one runs to its first snapshot (a copy) and writes the second in its short
// tail's pass; a 200-token one ends passes at both and copies the state each time. A sequence restored from each
// snapshot (sharing the prompt's pages, as the prefix cache shares them) continues to the logits of the whole prompt,
// on the hybrid fixtures and on kiln-tiny with its MTP head, where the head's last hidden state belongs to the snapshot
// too: the continuation's carried first draft must equal the whole prompt's.
TEST(Runner, SnapshotsInsideAChunkHoldTheStateThere) {
  struct Case {
    std::string name, dir;
    bool mtp;
  };
  std::vector<Case> cases;
  for (const char* name : {"qwen3_5_moe_bf16", "qwen3_next_nvfp4", "qwen3_5_bf16"})
    cases.push_back({name, Fixture::load(name).model_dir, false});
  cases.push_back({"kiln-tiny (MTP head)", std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny", true});
  for (const Case& c : cases) {
    auto opts = f32_kv();
    opts.mtp = c.mtp;
    TestRunner r(c.dir, opts);
    std::vector<int32_t> prompt(200);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 13) % (r.vocab() - 1));
    for (const int64_t len : {int64_t{33}, int64_t{90}, int64_t{200}}) {
      const std::span<const int32_t> p = std::span<const int32_t>(prompt).first(static_cast<size_t>(len));
      const std::vector<int64_t> at = len == 33   ? std::vector<int64_t>{16, 32}
                                      : len == 90 ? std::vector<int64_t>{32, 80}
                                                  : std::vector<int64_t>{64, 128};
      model::SeqChunk whole = r.chunk(0, p, 0);
      whole.snapshots = {{at[0], 1}, {at[1], 2}};
      std::vector<float> want(static_cast<size_t>(r.vocab()));
      r.runner->forward({&whole, 1}, want);
      int32_t want_draft = -1;
      if (c.mtp) {
        int32_t id = -1;
        r.runner->forward_argmax_carry({&whole, 1}, {&id, 1}, {&want_draft, 1}, {});
        EXPECT_EQ(id, argmax(want.data(), r.vocab())) << c.name;
      }
      for (size_t k = 0; k < at.size(); ++k) {
        r.runner->copy_state(static_cast<int>(k) + 1, 3);
        model::SeqChunk rest = r.chunk(3, p.subspan(static_cast<size_t>(at[k])), at[k]);
        rest.page_table = r.page_tables[0];
        std::vector<float> got(static_cast<size_t>(r.vocab()));
        r.runner->forward({&rest, 1}, got);
        const double d = max_diff(got, want);
        std::printf("[runner] %-20s %2lld-token chunk, snapshot after %2lld tokens: continuation vs whole %.2e\n",
                    c.name.c_str(), static_cast<long long>(len), static_cast<long long>(at[k]), d);
        EXPECT_LT(d, kSelfTol) << c.name << " len " << len << " snapshot " << at[k];
        if (c.mtp) {
          r.runner->copy_state(static_cast<int>(k) + 1, 3);
          int32_t id = -1, draft = -1;
          r.runner->forward_argmax_carry({&rest, 1}, {&id, 1}, {&draft, 1}, {});
          EXPECT_EQ(draft, want_draft) << c.name << " len " << len << " snapshot " << at[k];
        }
      }
    }
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

// Image inputs (SeqChunk::mrope_pos, embeds) against the runner itself: three equal rope positions are the plain rope
// (bit for bit), a shifted block of positions is not, and embeddings handed in for some tokens act exactly like the
// token embeddings they equal (the values traced at "embed" from a run of the original tokens).
TEST(RunnerImages, EqualMRopePositionsAreThePlainRopeAndEmbeddingsReplaceTokens) {
  const Fixture fx = Fixture::load("qwen3_5_moe_bf16");
  const std::vector<int32_t>& prompt = fx.prompts[2].tokens;  // 33 tokens
  const int64_t L = static_cast<int64_t>(prompt.size());
  TestRunner plain(fx.model_dir, f32_kv());
  std::vector<float> embed_rows;
  plain.impl().set_trace([&](std::string_view what, int, const TensorView& v) {
    if (what != "embed") return;
    const float* p = static_cast<const float*>(v.data);
    embed_rows.assign(p, p + v.numel());
  });
  const std::vector<float> want = plain.run(0, prompt, 0);
  plain.impl().set_trace(nullptr);
  const int64_t H = static_cast<int64_t>(embed_rows.size()) / L;
  ASSERT_GT(H, 0);
  ASSERT_EQ(static_cast<int64_t>(embed_rows.size()), L * H);

  // Equal positions, prompt in two chunks (the second carries mrope_prev), then a decode.
  TestRunner mr(fx.model_dir, f32_kv());
  std::vector<int32_t> pos3(L * 3);
  for (int64_t i = 0; i < L * 3; ++i) pos3[i] = static_cast<int32_t>(i / 3);
  model::SeqChunk a = mr.chunk(0, std::span(prompt).first(20), 0, false);
  a.mrope_pos = std::span(pos3).first(60);
  mr.runner->forward({&a, 1}, std::span<float>());
  model::SeqChunk b = mr.chunk(0, std::span(prompt).subspan(20), 20);
  b.mrope_pos = std::span(pos3).subspan(60);
  b.mrope_prev = {19, 19, 19};
  std::vector<float> got(fx.vocab);
  mr.runner->forward({&b, 1}, got);
  TestRunner plain2(fx.model_dir, f32_kv());
  plain2.run(0, std::span(prompt).first(20), 0);
  EXPECT_EQ(max_diff(got, plain2.run(0, std::span(prompt).subspan(20), 20)), 0.0);

  // A block of tokens at image-like positions: the logits move.
  std::vector<int32_t> shifted = pos3;
  for (int64_t i = 10; i < 16; ++i) {
    shifted[i * 3 + 1] = static_cast<int32_t>(10 + (i - 10) / 3);
    shifted[i * 3 + 2] = static_cast<int32_t>(10 + (i - 10) % 3);
  }
  TestRunner moved(fx.model_dir, f32_kv());
  model::SeqChunk c = moved.chunk(0, prompt, 0);
  c.mrope_pos = shifted;
  std::vector<float> got_moved(fx.vocab);
  moved.runner->forward({&c, 1}, got_moved);
  EXPECT_GT(max_diff(got_moved, want), 1e-3);

  // Tokens 5..9 replaced by other ids, their original embeddings handed in: the original logits.
  std::vector<int32_t> other = prompt;
  std::vector<int32_t> offsets;
  std::vector<float> rows;
  for (int32_t o = 5; o < 10; ++o) {
    other[o] = (other[o] + 1) % static_cast<int32_t>(fx.vocab);
    offsets.push_back(o);
    rows.insert(rows.end(), embed_rows.begin() + o * H, embed_rows.begin() + (o + 1) * H);
  }
  TestRunner emb(fx.model_dir, f32_kv());
  model::SeqChunk d = emb.chunk(0, other, 0);
  d.embed_offsets = offsets;
  d.embeds = rows;
  std::vector<float> got_emb(fx.vocab);
  emb.runner->forward({&d, 1}, got_emb);
  EXPECT_EQ(max_diff(got_emb, want), 0.0);
  EXPECT_GT(max_diff(TestRunner(fx.model_dir, f32_kv()).run(0, other, 0), want), 1e-3);  // the ids alone differ

  // Malformed image inputs are refused.
  model::SeqChunk bad = emb.chunk(1, prompt, 0);
  bad.mrope_pos = std::span(pos3).first(9);
  EXPECT_THROW(emb.runner->forward({&bad, 1}, got), Error);
  model::SeqChunk bad2 = emb.chunk(1, prompt, 0);
  const int32_t backwards[] = {4, 3};
  bad2.embed_offsets = backwards;
  bad2.embeds = std::span(rows).first(2 * H);
  EXPECT_THROW(emb.runner->forward({&bad2, 1}, got), Error);
}

}  // namespace
}  // namespace kiln::testing

namespace kiln::model {
namespace {

// Wraps the CPU backend. While capturing, compute ops are recorded (memory ops run at once, as scratch
// addresses are fixed at capture time on a GPU too); graph_launch runs the recording. A graph can be launched
// once: every later launch reports it stale (as a GPU backend does after its scratch memory moved), which makes
// the runner capture again on every step after the first of a shape.
class RecordingOps final : public Ops {
 public:
  explicit RecordingOps(std::unique_ptr<Ops> inner) : in_(std::move(inner)) {}
  int captures = 0, launches = 0, stale = 0, eager_passes_seen = 0;
  int all_reduces = 0;  // Ops::all_reduce calls (the tensor-parallel sum points), captured or not
  bool throw_in_next_capture = false;

  std::string name() const override { return "recording"; }
  std::string describe() const override { return in_->describe(); }
  TensorView allocate(DType d, Shape s) override { return in_->allocate(d, s); }
  TensorView place_weight(const TensorView& h) override { return in_->place_weight(h); }
  void finish_weights() override { in_->finish_weights(); }
  TensorView scratch(DType d, Shape s) override { return in_->scratch(d, s); }
  void reset_scratch() override { in_->reset_scratch(); }
  TensorView upload(const void* h, DType d, Shape s) override {
    KILN_CHECK(!capturing_, "upload during a capture (a replay would not see the new values)");
    return in_->upload(h, d, s);
  }
  void download(const TensorView& src, void* host) override {
    KILN_CHECK(!capturing_, "download during a capture");
    in_->download(src, host);
  }
  float max_abs(const TensorView& x) override {
    KILN_CHECK(!capturing_, "max_abs (a synchronising op) during a capture");
    return in_->max_abs(x);
  }
  void fill_zero(TensorView t) override { run([=, this] { in_->fill_zero(t); }); }
  void copy(const TensorView& s, TensorView d) override { run([=, this] { in_->copy(s, d); }); }

  bool graph_capture_begin() override {
    capturing_ = true;
    recording_.clear();
    ++captures;
    return true;
  }
  int graph_capture_end() override {
    capturing_ = false;
    graphs_.push_back(std::move(recording_));
    launched_.push_back(false);
    return static_cast<int>(graphs_.size()) - 1;
  }
  bool graph_launch(int h) override {
    if (h < 0 || h >= static_cast<int>(graphs_.size()) || launched_[h]) {
      ++stale;
      return false;
    }
    launched_[h] = true;
    for (auto& op : graphs_[h]) op();
    ++launches;
    return true;
  }

  void embedding(const TensorView& t, const TensorView& ids, TensorView out) override {
    if (!capturing_) ++eager_passes_seen;  // one embedding per pass
    if (capturing_ && throw_in_next_capture) {
      throw_in_next_capture = false;
      fail("injected failure inside a capture");
    }
    run([=, this] { in_->embedding(t, ids, out); });
  }
  void linear(const TensorView& x, const LinearWeight& w, TensorView out) override {
    run([=, this, &w] { in_->linear(x, w, out); });
  }
  void rms_norm(const TensorView& x, const TensorView& w, float eps, NormKind k, TensorView out) override {
    run([=, this] { in_->rms_norm(x, w, eps, k, out); });
  }
  void gated_rms_norm(const TensorView& x, const TensorView& z, const TensorView& w, float eps,
                      TensorView out) override {
    run([=, this] { in_->gated_rms_norm(x, z, w, eps, out); });
  }
  void rope(TensorView x, const TensorView& pos, int rd, double theta) override {
    run([=, this] { in_->rope(x, pos, rd, theta); });
  }
  void add(const TensorView& a, const TensorView& b, TensorView out) override {
    run([=, this] { in_->add(a, b, out); });
  }
  void silu_mul(const TensorView& g, const TensorView& u, TensorView out) override {
    run([=, this] { in_->silu_mul(g, u, out); });
  }
  void sigmoid_mul(const TensorView& x, const TensorView& g, TensorView out) override {
    run([=, this] { in_->sigmoid_mul(x, g, out); });
  }
  void all_reduce(TensorView x) override {
    ++all_reduces;
    run([=, this] { in_->all_reduce(x); });
  }
  void gather_rows(const TensorView& x, const TensorView& rows, TensorView out) override {
    run([=, this] { in_->gather_rows(x, rows, out); });
  }
  // The step layout is the runner's for the pass being captured; a recording is launched within that pass
  // (later launches are refused), so holding it by reference is valid.
  void kv_store(const TensorView& k, const TensorView& v, KvLayerView c, const StepLayout& st) override {
    run([=, this, &st] { in_->kv_store(k, v, c, st); });
  }
  void attention(const TensorView& q, KvLayerView c, const StepLayout& st, float scale, TensorView out) override {
    run([=, this, &st] { in_->attention(q, c, st, scale, out); });
  }
  void causal_conv1d_silu(const TensorView& x, const TensorView& w, TensorView cs, const StepLayout& st,
                          TensorView out) override {
    run([=, this, &st] { in_->causal_conv1d_silu(x, w, cs, st, out); });
  }
  void delta_rule_gates(const TensorView& a, const TensorView& b, const TensorView& al, const TensorView& dt,
                        TensorView g, TensorView beta) override {
    run([=, this] { in_->delta_rule_gates(a, b, al, dt, g, beta); });
  }
  void gated_delta_rule(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                        const TensorView& b, TensorView state, const StepLayout& st, DeltaRuleMode m,
                        TensorView out) override {
    run([=, this, &st] { in_->gated_delta_rule(q, k, v, g, b, state, st, m, out); });
  }
  void moe_route(const TensorView& l, int k, bool r, TensorView ids, TensorView w) override {
    run([=, this] { in_->moe_route(l, k, r, ids, w); });
  }
  void moe_experts(const TensorView& x, const TensorView& ids, const TensorView& w,
                   std::span<const ExpertWeights> experts, TensorView out) override {
    run([=, this] { in_->moe_experts(x, ids, w, experts, out); });
  }
  void argmax_rows_into(const TensorView& logits, TensorView ids, int32_t offset) override {
    run([=, this] { in_->argmax_rows_into(logits, ids, offset); });
  }

 private:
  template <typename F>
  void run(F&& f) {
    if (capturing_) recording_.emplace_back(std::forward<F>(f));
    else f();
  }
  std::unique_ptr<Ops> in_;
  bool capturing_ = false;
  std::vector<std::function<void()>> recording_;
  std::vector<std::vector<std::function<void()>>> graphs_;
  std::vector<bool> launched_;
};

const std::string kTiny = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";

struct Gen {
  std::unique_ptr<Runner> runner;
  std::vector<std::vector<int32_t>> pages;
  Gen(std::unique_ptr<Ops> ops, int graph_max_batch, bool mtp = false) {
    RunnerOptions ro;
    ro.mtp = mtp;
    ro.state_slots = 3;
    ro.max_context = 128;
    ro.kv_dtype = DType::F32;
    ro.graph_max_batch = graph_max_batch;
    runner = std::make_unique<Runner>(std::move(ops), format::ModelDir::open(kTiny), ro);
    const int64_t per = runner->capacity().kv_pages / 3;
    for (int s = 0; s < 3; ++s) {
      pages.emplace_back(per);
      for (int64_t p = 0; p < per; ++p) pages.back()[p] = static_cast<int32_t>(s * per + p);
    }
  }
  const std::vector<std::vector<int32_t>> prompts = {{5, 6, 7}, {100, 200}, {9, 9, 9, 9, 40}};
  // Prefill three prompts, then `steps` greedy decode steps; the logits of every step, concatenated.
  std::vector<float> run(int steps, const std::function<void(int)>& before_step = nullptr) {
    const int64_t V = runner->vocab_size();
    std::vector<SeqChunk> chunks(3);
    std::vector<int32_t> next(3);
    std::vector<int64_t> pos(3);
    for (int i = 0; i < 3; ++i) {
      chunks[i].state_slot = i;
      chunks[i].tokens = prompts[i];
      chunks[i].page_table = pages[i];
      pos[i] = static_cast<int64_t>(prompts[i].size());
    }
    std::vector<float> all, logits(3 * V);
    for (int s = 0; s <= steps; ++s) {
      if (before_step) before_step(s);
      runner->forward(chunks, logits);
      all.insert(all.end(), logits.begin(), logits.end());
      for (int i = 0; i < 3; ++i) {
        next[i] = host_argmax(logits.data() + i * V, V);
        chunks[i].tokens = std::span<const int32_t>(&next[i], 1);
        chunks[i].start_pos = pos[i]++;
      }
    }
    return all;
  }
};

TEST(RunnerGraphs, CapturedPassesGiveTheEagerLogitsAndStaleGraphsAreCapturedAgain) {
  Gen plain(backend::make_cpu_backend(), 0);
  auto rec_owner = std::make_unique<RecordingOps>(backend::make_cpu_backend());
  RecordingOps* rec = rec_owner.get();
  Gen graphed(std::move(rec_owner), 256);
  std::vector<int> captures_before;
  const std::vector<float> want = plain.run(10);
  const std::vector<float> got = graphed.run(10, [&](int) { captures_before.push_back(rec->captures); });
  ASSERT_EQ(want.size(), got.size());
  EXPECT_EQ(want, got);  // the same CPU ops in the same order: bit for bit
  // Step 0 is the prefill (not graphable), step 1 the first decode of its shape (eager), step 2 on capture.
  EXPECT_EQ(captures_before[1], 0);
  EXPECT_EQ(captures_before[2], 0);
  EXPECT_EQ(captures_before[3], 1);
  // Every later step found its graph stale (this backend refuses a second launch) and captured again. The
  // context crosses a 16-token page-bucket boundary on the way (positions 5..15), which is a new shape: one more
  // eager pass there.
  EXPECT_GE(rec->captures, 8);
  EXPECT_EQ(rec->launches, rec->captures);
  EXPECT_GE(rec->stale, rec->captures - 2);
}

// The MTP draft chain (draft() without logits) as one graph: kiln-tiny's trained head over RecordingOps drafts the
// tokens of a plain CPU runner for one and three sequences and K = 1..4, three calls per shape (eager, captured, captured
// again: the recording is stale after one launch). Nothing in the chain uploads or downloads inside the capture
// (RecordingOps refuses both): each step's ids reach the next through device memory (Ops::argmax_rows_into).
TEST(RunnerGraphs, CapturedDraftChainsGiveTheEagerTokens) {
  Gen plain(backend::make_cpu_backend(), 0, /*mtp=*/true);
  auto rec_owner = std::make_unique<RecordingOps>(backend::make_cpu_backend());
  RecordingOps* rec = rec_owner.get();
  Gen graphed(std::move(rec_owner), 256, /*mtp=*/true);
  ASSERT_EQ(plain.runner->mtp_layers(), 1);
  constexpr int kSteps = 2;
  const std::vector<float> la = plain.run(kSteps), lb = graphed.run(kSteps);
  ASSERT_EQ(la, lb);
  const int64_t V = plain.runner->vocab_size();
  const float* last = la.data() + la.size() - static_cast<size_t>(3 * V);  // the last step's rows: pending tokens
  for (int S : {1, 3}) {
    for (int K = 1; K <= 4; ++K) {
      std::vector<DraftSeq> sp(static_cast<size_t>(S)), sg;
      for (int i = 0; i < S; ++i) {
        DraftSeq& d = sp[static_cast<size_t>(i)];
        d.state_slot = i;
        d.token = host_argmax(last + i * V, V);
        d.pos = static_cast<int64_t>(plain.prompts[static_cast<size_t>(i)].size()) + kSteps;
        d.page_table = plain.pages[static_cast<size_t>(i)];
      }
      sg = sp;
      for (int i = 0; i < S; ++i) sg[static_cast<size_t>(i)].page_table = graphed.pages[static_cast<size_t>(i)];
      std::vector<int32_t> want(static_cast<size_t>(S * K));
      plain.runner->draft(sp, K, want, {});
      for (int call = 0; call < 3; ++call) {
        const int captures = rec->captures;
        std::vector<int32_t> got(want.size(), -1);
        graphed.runner->draft(sg, K, got, {});
        EXPECT_EQ(got, want) << "S " << S << " K " << K << " call " << call;
        EXPECT_EQ(rec->captures - captures, call == 0 ? 0 : 1) << "S " << S << " K " << K << " call " << call;
      }
    }
  }
  EXPECT_EQ(rec->launches, rec->captures);
  // The target's next step is untouched by the chains (bit for bit).
  std::vector<float> next_a(static_cast<size_t>(V)), next_b(next_a.size());
  for (auto [g, out] : {std::pair{&plain, &next_a}, std::pair{&graphed, &next_b}}) {
    SeqChunk ch;
    ch.state_slot = 0;
    const int32_t t = host_argmax(last, V);
    ch.tokens = std::span<const int32_t>(&t, 1);
    ch.start_pos = static_cast<int64_t>(g->prompts[0].size()) + kSteps;
    ch.page_table = g->pages[0];
    g->runner->forward({&ch, 1}, *out);
  }
  EXPECT_EQ(next_a, next_b);
}

TEST(RunnerGraphs, AFailureInsideACaptureEndsTheCaptureAndTheRunnerKeepsWorking) {
  auto rec_owner = std::make_unique<RecordingOps>(backend::make_cpu_backend());
  RecordingOps* rec = rec_owner.get();
  Gen graphed(std::move(rec_owner), 256);
  bool threw = false;
  try {
    graphed.run(4, [&](int s) {
      if (s == 3) rec->throw_in_next_capture = true;
    });
  } catch (const Error& e) {
    threw = std::string(e.what()).find("injected") != std::string::npos;
  }
  EXPECT_TRUE(threw);
  // Not stuck capturing: an eager forward works (download would refuse inside a capture).
  Gen plain(backend::make_cpu_backend(), 0);
  SeqChunk ch;
  ch.state_slot = 0;
  const std::vector<int32_t> toks = {1, 2};
  ch.tokens = toks;
  ch.page_table = graphed.pages[0];
  std::vector<float> a(graphed.runner->vocab_size()), b(a.size());
  EXPECT_NO_THROW(graphed.runner->forward({&ch, 1}, a));
  ch.page_table = plain.pages[0];
  plain.runner->forward({&ch, 1}, b);
  EXPECT_EQ(a, b);
}

// The tensor-parallel sum points are explicit: every block that returns into the residual stream (kiln-tiny: a
// DeltaNet or attention block and a MoE block per layer) ends with one Ops::all_reduce, and nothing else calls it.
TEST(RunnerTensorParallel, OneAllReducePerBlockOutput) {
  auto rec_owner = std::make_unique<RecordingOps>(backend::make_cpu_backend());
  RecordingOps* rec = rec_owner.get();
  Gen eager(std::move(rec_owner), 0);  // graphs off: every pass runs its ops once
  const int layers = static_cast<int>(format::load_model_config(format::ModelDir::open(kTiny)).num_layers);
  ASSERT_GT(layers, 0);
  eager.run(2);  // a prefill pass and two decode passes
  EXPECT_EQ(rec->all_reduces, 3 * 2 * layers);
}

}  // namespace
}  // namespace kiln::model
