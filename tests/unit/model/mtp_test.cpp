// The MTP head (src/model/mtp.*, its runner plumbing in src/model/runner.*):
//  - against transformers (tools/reference/make_fixtures.py's MTP fixture; skipped until it is generated);
//  - against a hand composition: the fc input built on the host (norms and the [embedding | hidden] matmul written out
//    here) and fed, as the embedding rows of a separate one-layer model holding the MTP layer's weights, through the
//    ordinary runner: the draft chain's logits must equal that model's;
//  - the head's entries are the same whether the prompt ran in one pass, in small passes or as prefill + decode;
//  - the head leaves the target model's logits alone; save_state / restore_state bring a slot back;
//  - the greedy chain on the device (draft() without logits: each step's argmax fed on as device ids, one download) gives
//    the tokens of the chain that reads every step back to the host (draft() with logits), and transformers' drafts.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "fixture_util.h"
#include "format/model_config.h"
#include "mtp_model.h"
#include "reference_fixture.h"

namespace kiln::testing {
namespace {

namespace fs = std::filesystem;

backend::LoadOptions f32_kv(int64_t prefill_chunk = 512) {
  backend::LoadOptions o;
  o.kv_dtype = DType::F32;
  o.prefill_chunk = prefill_chunk;
  o.mtp = true;
  return o;
}

// A tensor of a checkpoint as floats.
std::vector<float> read_f32(const format::Checkpoint& ckpt, const std::string& name) {
  const format::TensorInfo& t = ckpt.get(name);
  std::vector<float> out(static_cast<size_t>(t.shape.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t.dtype == DType::F32) {
      std::memcpy(&out[i], t.data + i * 4, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, t.data + i * 2, 2);
      out[i] = bf16_to_f32(h);
    }
  }
  return out;
}

// Zero-centred RMSNorm (Qwen3.5): x / sqrt(mean(x^2) + eps) * (1 + w), in double.
std::vector<double> norm_zc(const float* x, const std::vector<float>& w, double eps) {
  const size_t H = w.size();
  double ss = 0;
  for (size_t i = 0; i < H; ++i) ss += static_cast<double>(x[i]) * x[i];
  const double r = 1.0 / std::sqrt(ss / static_cast<double>(H) + eps);
  std::vector<double> out(H);
  for (size_t i = 0; i < H; ++i) out[i] = x[i] * r * (1.0 + w[i]);
  return out;
}

double max_abs_diff(const float* a, const float* b, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}
double max_abs(const float* a, int64_t n) {
  double m = 1e-12;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(a[i])));
  return m;
}

// The MTP head's inputs by hand: fc([norm_e(embed(token)) | norm_h(hidden)]) with the checkpoint's weights.
struct HandHead {
  int64_t H = 0, V = 0;
  double eps = 1e-6;
  std::vector<float> embed, fc, norm_e, norm_h;
  HandHead(const format::Checkpoint& ckpt, const format::ModelConfig& c) : H(c.hidden_size), V(c.vocab_size) {
    eps = c.rms_norm_eps;
    embed = read_f32(ckpt, c.tensor_prefix + "embed_tokens.weight");
    fc = read_f32(ckpt, "mtp.fc.weight");
    norm_e = read_f32(ckpt, "mtp.pre_fc_norm_embedding.weight");
    norm_h = read_f32(ckpt, "mtp.pre_fc_norm_hidden.weight");
  }
  std::vector<float> fc_out(int32_t token, const float* hidden) const {
    const std::vector<double> e = norm_zc(embed.data() + token * H, norm_e, eps);
    const std::vector<double> h = norm_zc(hidden, norm_h, eps);
    std::vector<float> out(static_cast<size_t>(H));
    for (int64_t r = 0; r < H; ++r) {
      const float* w = fc.data() + r * 2 * H;
      double acc = 0;
      for (int64_t i = 0; i < H; ++i) acc += w[i] * e[i];  // the embedding half first
      for (int64_t i = 0; i < H; ++i) acc += w[H + i] * h[i];
      out[r] = static_cast<float>(acc);
    }
    return out;
  }
};

// A one-layer full-attention model holding the MTP layer's weights (mtp.layers.0.* as layer 0, mtp.norm as the final
// norm, the same lm_head), whose embedding row i is rows[i]: running ids 0..n-1 through it runs the MTP layer over
// the entries whose fc outputs are rows.
void write_layer_model(const std::string& mtp_dir, const std::string& out, const std::vector<std::vector<float>>& rows) {
  fs::create_directories(out);
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(mtp_dir + "/config.json"));
  nlohmann::json& t = cfg.contains("text_config") ? cfg["text_config"] : cfg;
  t["num_hidden_layers"] = 1;
  t["layer_types"] = nlohmann::json::array({"full_attention"});
  t.erase("mtp_num_hidden_layers");
  std::ofstream(out + "/config.json") << cfg.dump(2);
  const format::ModelDir dir = format::ModelDir::open(mtp_dir);
  const format::Checkpoint ckpt = format::Checkpoint::open(dir);
  format::ModelConfig c = format::load_model_config(dir);
  const std::string P = format::detect_tensor_prefix(ckpt);
  format::SafetensorsWriter w;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  std::vector<uint8_t> table(static_cast<size_t>(V * H) * 4, 0);
  for (size_t i = 0; i < rows.size(); ++i) std::memcpy(table.data() + i * H * 4, rows[i].data(), H * 4);
  w.add(P + "embed_tokens.weight", DType::F32, Shape{V, H}, table);
  for (const auto& [name, info] : ckpt.tensors()) {
    if (name.starts_with("mtp.layers.0."))
      w.add_view(P + "layers.0." + name.substr(std::string("mtp.layers.0.").size()), info.dtype, info.shape, info.bytes());
    else if (name == "mtp.norm.weight")
      w.add_view(P + "norm.weight", info.dtype, info.shape, info.bytes());
    else if (name == "lm_head.weight")
      w.add_view(name, info.dtype, info.shape, info.bytes());
  }
  w.set_metadata("format", "pt");
  w.write(out + "/model.safetensors");
}

// Runs `tokens` through a fresh slot of `r` in one chunk and returns the logits of every position; `hidden` (if
// given) gets every position's final-norm output (the trace "final_norm" of that pass).
std::vector<float> run_all(TestRunner& r, int slot, std::span<const int32_t> tokens, std::vector<float>* hidden) {
  const int64_t L = static_cast<int64_t>(tokens.size()), V = r.vocab();
  model::SeqChunk ch = r.chunk(slot, tokens, 0);
  ch.logits_tokens = static_cast<int>(L);
  if (hidden)
    r.impl().set_trace([hidden](std::string_view name, int layer, const TensorView& v) {
      if (name != "final_norm" || layer != -1) return;
      hidden->assign(static_cast<const float*>(v.data), static_cast<const float*>(v.data) + v.numel());
    });
  std::vector<float> logits(static_cast<size_t>(L * V));
  r.runner->forward({&ch, 1}, logits);
  r.impl().set_trace(nullptr);
  return logits;
}

struct Draft {
  std::vector<int32_t> tokens;
  std::vector<float> logits;  // [steps, V]
};
Draft draft(TestRunner& r, int slot, int32_t token, int64_t pos, int steps) {
  Draft d;
  d.tokens.resize(steps);
  d.logits.resize(static_cast<size_t>(steps * r.vocab()));
  model::DraftSeq s;
  s.state_slot = slot;
  s.token = token;
  s.pos = pos;
  s.page_table = r.page_tables[slot];
  r.runner->draft({&s, 1}, steps, d.tokens, d.logits);
  return d;
}

constexpr const char* kFixture = "qwen3_5_moe_bf16";
constexpr uint64_t kSeed = 28;

class MtpHead : public ::testing::Test {
 protected:
  void SetUp() override {
    fx_ = Fixture::load(kFixture);
    mtp_dir_ = tmp_.path() + "/mtp";
    kiln::test::write_model_with_mtp(fx_.model_dir, mtp_dir_, kSeed);
  }
  Fixture fx_;
  kiln::test::TempDir tmp_;
  std::string mtp_dir_;
};

TEST_F(MtpHead, LoadsAndCountsItsKvAndState) {
  TestRunner plain(fx_.model_dir, f32_kv());
  TestRunner with(mtp_dir_, f32_kv());
  EXPECT_EQ(plain.runner->mtp_layers(), 0);
  EXPECT_EQ(with.runner->mtp_layers(), 1);
  const auto a = plain.runner->capacity(), b = with.runner->capacity();
  // One more full-attention layer's KV per token (the fixture has one full-attention layer among four).
  EXPECT_EQ(b.kv_bytes_per_token, 2 * a.kv_bytes_per_token);
  EXPECT_EQ(b.state_bytes_per_slot, 2 * a.state_bytes_per_slot);  // the verify checkpoints
  // Off by option: the head is not loaded.
  auto off = f32_kv();
  off.mtp = false;
  TestRunner none(mtp_dir_, off);
  EXPECT_EQ(none.runner->mtp_layers(), 0);
  EXPECT_EQ(none.runner->capacity().kv_bytes_per_token, a.kv_bytes_per_token);
}

TEST_F(MtpHead, LeavesTheTargetLogitsAlone) {
  TestRunner plain(fx_.model_dir, f32_kv());
  TestRunner with(mtp_dir_, f32_kv());
  const std::vector<int32_t>& prompt = fx_.prompts[2].tokens;
  const std::vector<float> a = run_all(plain, 0, prompt, nullptr), b = run_all(with, 0, prompt, nullptr);
  EXPECT_EQ(max_abs_diff(a.data(), b.data(), static_cast<int64_t>(a.size())), 0.0);
}

TEST_F(MtpHead, DraftChainEqualsTheHandComposition) {
  TestRunner r(mtp_dir_, f32_kv());
  const std::vector<int32_t>& prompt = fx_.prompts[2].tokens;  // 33 tokens
  const int64_t L = static_cast<int64_t>(prompt.size()), V = r.vocab();
  std::vector<float> hidden;  // [L, H] the target's final-norm outputs
  const std::vector<float> logits = run_all(r, 0, prompt, &hidden);
  const int32_t next = argmax(logits.data() + (L - 1) * V, V);
  const Draft d = draft(r, 0, next, L, 2);

  const format::ModelDir dir = format::ModelDir::open(mtp_dir_);
  const format::Checkpoint ckpt = format::Checkpoint::open(dir);
  format::ModelConfig c = format::load_model_config(dir);
  c.tensor_prefix = format::detect_tensor_prefix(ckpt);
  const int64_t H = c.hidden_size;
  ASSERT_EQ(static_cast<int64_t>(hidden.size()), L * H);
  const HandHead head(ckpt, c);
  // Entry j = (t[j+1], h[j]), j = 0 .. L-1 (t[L] = the sampled next token).
  std::vector<std::vector<float>> rows;
  for (int64_t j = 0; j < L; ++j) rows.push_back(head.fc_out(j + 1 < L ? prompt[j + 1] : next, hidden.data() + j * H));
  write_layer_model(mtp_dir_, tmp_.path() + "/step1", rows);
  TestRunner one(tmp_.path() + "/step1", f32_kv());
  std::vector<int32_t> ids(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) ids[i] = static_cast<int32_t>(i);
  std::vector<float> g;  // the layer model's final-norm outputs: the head's chained hidden states
  const std::vector<float> want1 = run_all(one, 0, ids, &g);
  const float* want1_last = want1.data() + (L - 1) * V;
  const double tol = 1e-4 * max_abs(want1_last, V);
  EXPECT_LT(max_abs_diff(d.logits.data(), want1_last, V), tol);
  EXPECT_EQ(d.tokens[0], argmax(d.logits.data(), V));

  // Step 2: entry L = (d1, g[L-1]).
  rows.push_back(head.fc_out(d.tokens[0], g.data() + (L - 1) * H));
  write_layer_model(mtp_dir_, tmp_.path() + "/step2", rows);
  TestRunner two(tmp_.path() + "/step2", f32_kv());
  ids.push_back(static_cast<int32_t>(L));
  const std::vector<float> want2 = run_all(two, 0, ids, nullptr);
  const float* want2_last = want2.data() + L * V;
  EXPECT_LT(max_abs_diff(d.logits.data() + V, want2_last, V), 1e-4 * max_abs(want2_last, V));
  std::printf("[mtp] draft step 1 max |diff| %.2e, step 2 %.2e (logit scale %.2f)\n",
              max_abs_diff(d.logits.data(), want1_last, V), max_abs_diff(d.logits.data() + V, want2_last, V),
              max_abs(want1_last, V));
}

TEST_F(MtpHead, EntriesDoNotDependOnHowThePromptRan) {
  const std::vector<int32_t>& prompt = fx_.prompts[3].tokens;  // 90 tokens
  const int64_t L = static_cast<int64_t>(prompt.size()), V = fx_.vocab;
  TestRunner one(mtp_dir_, f32_kv());
  const std::vector<float> logits = one.run(0, prompt, 0);
  const int32_t next = argmax(logits.data(), V);
  const Draft want = draft(one, 0, next, L, 3);
  // (a) passes of 16 tokens (the head's first entry of a pass reads the slot's kept hidden state);
  TestRunner split(mtp_dir_, f32_kv(16));
  split.run(1, prompt, 0);
  const Draft a = draft(split, 1, next, L, 3);
  // (b) prefill L-1, then the last prompt token as a decode step.
  TestRunner dec(mtp_dir_, f32_kv());
  dec.run(2, std::span(prompt).first(L - 1), 0);
  dec.run(2, std::span(prompt).subspan(L - 1, 1), L - 1);
  const Draft b = draft(dec, 2, next, L, 3);
  const double scale = max_abs(want.logits.data(), 3 * V);
  EXPECT_LT(max_abs_diff(a.logits.data(), want.logits.data(), 3 * V), 1e-4 * scale);
  EXPECT_LT(max_abs_diff(b.logits.data(), want.logits.data(), 3 * V), 1e-4 * scale);
  EXPECT_EQ(a.tokens, want.tokens);
  EXPECT_EQ(b.tokens, want.tokens);
}

TEST_F(MtpHead, RestoreStateUndoesAVerifyPass) {
  TestRunner r(mtp_dir_, f32_kv());
  const std::vector<int32_t>& prompt = fx_.prompts[2].tokens;
  const int64_t L = static_cast<int64_t>(prompt.size());
  r.run(0, prompt, 0);
  r.runner->save_state(0);
  const std::vector<int32_t> guess = {5, 6, 7, 8};
  r.run(0, guess, L);  // a verify pass that is then rejected whole
  r.runner->restore_state(0);
  const int32_t t = 9;
  const std::vector<float> after = r.run(0, std::span(&t, 1), L);
  TestRunner fresh(mtp_dir_, f32_kv());
  fresh.run(0, prompt, 0);
  const std::vector<float> want = fresh.run(0, std::span(&t, 1), L);
  EXPECT_EQ(max_abs_diff(after.data(), want.data(), fx_.vocab), 0.0);
}

// Position checkpoints: after a verify chunk of 4 tokens, keep_verified(slot, m) leaves the slot as running the first m
// tokens would (the next token's logits and the head's drafts from there), for every m, beside a prompt that runs in
// the same call (it goes to a pass of its own, the chunked delta rule).
TEST_F(MtpHead, KeepVerifiedEqualsRunningTheAcceptedTokens) {
  const std::vector<int32_t>& prompt = fx_.prompts[2].tokens;
  const std::vector<int32_t>& other = fx_.prompts[3].tokens;
  const int64_t L = static_cast<int64_t>(prompt.size()), V = fx_.vocab;
  const std::vector<int32_t> guess = {5, 6, 7, 8};
  const int32_t t = 9;
  for (int m = 1; m <= 4; ++m) {
    TestRunner r(mtp_dir_, f32_kv());
    ASSERT_GT(r.runner->position_checkpoints(), 3);
    r.run(0, prompt, 0);
    model::SeqChunk verify = r.chunk(0, guess, L);
    verify.logits_tokens = 4;
    verify.checkpoint_positions = true;
    const model::SeqChunk chunks[] = {verify, r.chunk(1, other, 0)};
    std::vector<float> logits(static_cast<size_t>(5 * V));
    r.runner->forward(chunks, logits);
    r.runner->keep_verified(0, m);
    const std::vector<float> after = r.run(0, std::span(&t, 1), L + m);
    const Draft d = draft(r, 0, t, L + m, 2);

    TestRunner fresh(mtp_dir_, f32_kv());
    fresh.run(0, prompt, 0);
    for (int j = 0; j < m; ++j) fresh.run(0, std::span(&guess[static_cast<size_t>(j)], 1), L + j);
    const std::vector<float> want = fresh.run(0, std::span(&t, 1), L + m);
    const Draft want_d = draft(fresh, 0, t, L + m, 2);
    EXPECT_LT(max_abs_diff(after.data(), want.data(), V), 1e-5 * max_abs(want.data(), V)) << "m = " << m;
    EXPECT_LT(max_abs_diff(d.logits.data(), want_d.logits.data(), 2 * V), 1e-5 * max_abs(want_d.logits.data(), 2 * V))
        << "m = " << m;
    EXPECT_EQ(d.tokens, want_d.tokens) << "m = " << m;
  }
}

// keep_verified_rows settles several slots in one call (one copy_spans): two slots verified together, each keeping a
// different number of tokens (one all of its chunk: nothing moves), end exactly as keep_verified one slot at a time.
TEST_F(MtpHead, KeepVerifiedRowsEqualsOneSlotAtATime) {
  const std::vector<int32_t>& p0 = fx_.prompts[2].tokens;
  const std::vector<int32_t>& p1 = fx_.prompts[1].tokens;
  const int64_t L0 = static_cast<int64_t>(p0.size()), L1 = static_cast<int64_t>(p1.size()), V = fx_.vocab;
  const std::vector<int32_t> g0 = {5, 6, 7}, g1 = {11, 12};  // 2 + 1 position checkpoints of the 4 a call keeps
  const int32_t t = 9;
  for (const auto& [m0, m1] : std::vector<std::pair<int, int>>{{1, 2}, {2, 1}, {3, 1}}) {
    std::vector<float> next[2];
    for (int batched = 0; batched < 2; ++batched) {
      TestRunner r(mtp_dir_, f32_kv());
      r.run(0, p0, 0);
      r.run(1, p1, 0);
      model::SeqChunk v0 = r.chunk(0, g0, L0), v1 = r.chunk(1, g1, L1);
      v0.logits_tokens = 3;
      v1.logits_tokens = 2;
      v0.checkpoint_positions = v1.checkpoint_positions = true;
      const model::SeqChunk chunks[] = {v0, v1};
      std::vector<float> logits(static_cast<size_t>(5 * V));
      r.runner->forward(chunks, logits);
      if (batched) {
        const model::ModelRunner::VerifiedRow rows[] = {{1, m1}, {0, m0}};
        r.runner->keep_verified_rows(rows);
      } else {
        r.runner->keep_verified(0, m0);
        r.runner->keep_verified(1, m1);
      }
      next[batched] = r.run(0, std::span(&t, 1), L0 + m0);
      const std::vector<float> n1 = r.run(1, std::span(&t, 1), L1 + m1);
      next[batched].insert(next[batched].end(), n1.begin(), n1.end());
    }
    EXPECT_EQ(max_abs_diff(next[0].data(), next[1].data(), 2 * V), 0.0) << m0 << ", " << m1;
  }
  TestRunner r(mtp_dir_, f32_kv());
  r.run(0, p0, 0);
  model::SeqChunk v0 = r.chunk(0, g0, L0);
  v0.checkpoint_positions = true;
  std::vector<float> logits(static_cast<size_t>(V));
  r.runner->forward({&v0, 1}, logits);
  const model::ModelRunner::VerifiedRow twice[] = {{0, 2}, {0, 2}};
  EXPECT_THROW(r.runner->keep_verified_rows(twice), Error);  // a slot given twice
}

TEST_F(MtpHead, PositionCheckpointErrors) {
  TestRunner r(mtp_dir_, f32_kv());
  const std::vector<int32_t>& prompt = fx_.prompts[2].tokens;
  const int64_t L = static_cast<int64_t>(prompt.size());
  r.run(0, prompt, 0);
  EXPECT_THROW(r.runner->keep_verified(0, 1), Error);  // the last call kept none for slot 0
  const std::vector<int32_t> guess = {5, 6, 7};
  model::SeqChunk verify = r.chunk(0, guess, L);
  verify.checkpoint_positions = true;
  std::vector<float> logits(static_cast<size_t>(fx_.vocab));
  r.runner->forward({&verify, 1}, logits);
  EXPECT_THROW(r.runner->keep_verified(0, 4), Error);  // more tokens than the chunk ran
  EXPECT_THROW(r.runner->keep_verified(0, 0), Error);
  EXPECT_NO_THROW(r.runner->keep_verified(0, 2));
}

// Runners a and b take the same steps: sequence i (slot i) runs prompt i, then each round two more tokens; after every
// step both draft K tokens from the pending token (the argmax of the step's logits), a through the host chain (logits
// asked for: each step's ids chosen on the host, then uploaded), b through the device chain. Same tokens, each the
// argmax of a's draft logits; the target's logits stay bit for bit the same (the chain writes only the head's KV at its
// own positions, which the next pass writes again before any read).
TEST_F(MtpHead, DeviceChainGivesTheHostChainsTokens) {
  const int64_t V = fx_.vocab;
  const std::vector<int32_t> more = {11, 200, 37, 5, 90, 3};
  int drafts = 0;
  for (int S : {1, 3}) {
    for (int K = 1; K <= 4; ++K) {
      TestRunner a(mtp_dir_, f32_kv()), b(mtp_dir_, f32_kv());
      std::vector<int64_t> pos(static_cast<size_t>(S), 0);
      std::vector<int32_t> pending(static_cast<size_t>(S));
      for (int round = 0; round < 3; ++round) {
        std::vector<model::SeqChunk> ca, cb;
        for (int i = 0; i < S; ++i) {
          const std::span<const int32_t> toks =
              round == 0 ? std::span<const int32_t>(fx_.prompts[static_cast<size_t>(i)].tokens)
                         : std::span<const int32_t>(more).subspan(static_cast<size_t>(2 * (round - 1) + (i % 2)), 2);
          ca.push_back(a.chunk(i, toks, pos[static_cast<size_t>(i)]));
          cb.push_back(b.chunk(i, toks, pos[static_cast<size_t>(i)]));
          pos[static_cast<size_t>(i)] += static_cast<int64_t>(toks.size());
        }
        std::vector<float> la(static_cast<size_t>(S * V)), lb(la.size());
        a.runner->forward(ca, la);
        b.runner->forward(cb, lb);
        ASSERT_EQ(la, lb) << "S " << S << " K " << K << " round " << round;
        std::vector<model::DraftSeq> sa(static_cast<size_t>(S)), sb;
        for (int i = 0; i < S; ++i) {
          pending[static_cast<size_t>(i)] = argmax(la.data() + i * V, V);
          sa[static_cast<size_t>(i)].state_slot = i;
          sa[static_cast<size_t>(i)].token = pending[static_cast<size_t>(i)];
          sa[static_cast<size_t>(i)].pos = pos[static_cast<size_t>(i)];
          sa[static_cast<size_t>(i)].page_table = a.page_tables[static_cast<size_t>(i)];
        }
        sb = sa;
        for (int i = 0; i < S; ++i) sb[static_cast<size_t>(i)].page_table = b.page_tables[static_cast<size_t>(i)];
        std::vector<int32_t> ta(static_cast<size_t>(S * K), -1), tb(ta.size(), -2);
        std::vector<float> logits(static_cast<size_t>(S * K * V));
        a.runner->draft(sa, K, ta, logits);
        b.runner->draft(sb, K, tb, {});
        EXPECT_EQ(ta, tb) << "S " << S << " K " << K << " round " << round;
        for (int64_t r = 0; r < S * K; ++r)
          EXPECT_EQ(ta[static_cast<size_t>(r)], argmax(logits.data() + r * V, V)) << "S " << S << " K " << K;
        drafts += S * K;
      }
    }
  }
  EXPECT_EQ(drafts, 3 * (1 + 3) * (1 + 2 + 3 + 4));
}

// forward_argmax_carry: runners a and b take the same greedy path. Each round both draft K tokens for every sequence,
// then verify [pending, K tokens] whose first m are the sequence's greedy continuation (from runner c, which decodes
// one token at a time) and the rest wrong, so about m of K are accepted; position checkpoints settle the accepted
// count the target's ids give. a runs the plain scheme (forward's logits, the chain from the pending token); b carries:
// its steps give next drafts, and its chains start from the carried first draft and head output. Every round: the
// same target ids and the same K drafts (with K = 1 b runs no chain at all).
TEST_F(MtpHead, CarriedDraftsEqualTheChain) {
  const int64_t V = fx_.vocab;
  int accepted_total = 0, verified = 0;
  for (int S : {1, 2}) {
    // The greedy continuation of each prompt.
    std::vector<std::vector<int32_t>> greedy(static_cast<size_t>(S));
    {
      TestRunner c(mtp_dir_, f32_kv());
      for (int i = 0; i < S; ++i) {
        const std::vector<int32_t>& prompt = fx_.prompts[static_cast<size_t>(i)].tokens;
        std::vector<float> l = c.run(i, prompt, 0);
        int64_t p = static_cast<int64_t>(prompt.size());
        for (int t = 0; t < 24; ++t) {
          const int32_t g = argmax(l.data(), V);
          greedy[static_cast<size_t>(i)].push_back(g);
          l = c.run(i, std::span(&g, 1), p++);
        }
      }
    }
    for (int K : {1, 3}) {
      backend::LoadOptions o = f32_kv();
      o.state_slots = 8;  // position checkpoints for 2 x 3 verify tokens
      TestRunner a(mtp_dir_, o), b(mtp_dir_, o);
      ASSERT_TRUE(b.runner->can_carry_drafts());
      std::vector<int64_t> pos(static_cast<size_t>(S)), idx(static_cast<size_t>(S), 0);
      std::vector<int32_t> pending(static_cast<size_t>(S)), first(static_cast<size_t>(S));
      std::vector<int> carried(static_cast<size_t>(S), 0);
      {  // the prompts
        std::vector<model::SeqChunk> ca, cb;
        for (int i = 0; i < S; ++i) {
          const std::vector<int32_t>& prompt = fx_.prompts[static_cast<size_t>(i)].tokens;
          ca.push_back(a.chunk(i, prompt, 0));
          cb.push_back(b.chunk(i, prompt, 0));
          pos[static_cast<size_t>(i)] = static_cast<int64_t>(prompt.size());
        }
        std::vector<float> la(static_cast<size_t>(S * V));
        a.runner->forward(ca, la);
        std::vector<int32_t> tb(static_cast<size_t>(S)), nb(static_cast<size_t>(S));
        b.runner->forward_argmax_carry(cb, tb, nb);
        for (int i = 0; i < S; ++i) {
          pending[static_cast<size_t>(i)] = argmax(la.data() + i * V, V);
          ASSERT_EQ(tb[static_cast<size_t>(i)], pending[static_cast<size_t>(i)]);
          first[static_cast<size_t>(i)] = nb[static_cast<size_t>(i)];
        }
      }
      for (int round = 0; round < 4; ++round) {
        std::vector<model::DraftSeq> sa(static_cast<size_t>(S)), sb;
        for (int i = 0; i < S; ++i) {
          model::DraftSeq& d = sa[static_cast<size_t>(i)];
          d.state_slot = i;
          d.token = pending[static_cast<size_t>(i)];
          d.pos = pos[static_cast<size_t>(i)];
          d.page_table = a.page_tables[static_cast<size_t>(i)];
        }
        sb = sa;
        for (int i = 0; i < S; ++i) {
          sb[static_cast<size_t>(i)].page_table = b.page_tables[static_cast<size_t>(i)];
          sb[static_cast<size_t>(i)].carried_row = carried[static_cast<size_t>(i)];
          sb[static_cast<size_t>(i)].first_draft = first[static_cast<size_t>(i)];
        }
        std::vector<int32_t> ta(static_cast<size_t>(S * K), -1), tb(ta.size(), -2);
        a.runner->draft(sa, K, ta, {});
        b.runner->draft(sb, K, tb, {});
        ASSERT_EQ(ta, tb) << "S " << S << " K " << K << " round " << round;
        // The verify chunks: [pending, the first m of the greedy continuation after it, then wrong tokens].
        std::vector<std::vector<int32_t>> vt(static_cast<size_t>(S));
        std::vector<model::SeqChunk> ca, cb;
        for (int i = 0; i < S; ++i) {
          const int m = (round + i) % (K + 1);
          const std::vector<int32_t>& g = greedy[static_cast<size_t>(i)];
          std::vector<int32_t>& v = vt[static_cast<size_t>(i)];
          v.push_back(pending[static_cast<size_t>(i)]);
          for (int j = 1; j <= K; ++j) {
            const size_t at = static_cast<size_t>(idx[static_cast<size_t>(i)] + j);
            const int32_t truth = at < g.size() ? g[at] : 7;
            v.push_back(j <= m ? truth : static_cast<int32_t>((truth + 1) % V));
          }
          for (TestRunner* r : {&a, &b}) {
            model::SeqChunk ch = r->chunk(i, v, pos[static_cast<size_t>(i)]);
            ch.logits_tokens = K + 1;
            ch.checkpoint_positions = true;
            (r == &a ? ca : cb).push_back(ch);
          }
        }
        std::vector<float> la(static_cast<size_t>(S * (K + 1) * V));
        a.runner->forward(ca, la);
        std::vector<int32_t> tgt(static_cast<size_t>(S * (K + 1))), nb(tgt.size());
        b.runner->forward_argmax_carry(cb, tgt, nb);
        std::vector<model::ModelRunner::VerifiedRow> rows;
        for (int i = 0; i < S; ++i) {
          int acc = 0;
          for (int j = 0; j <= K; ++j) {
            const int64_t r = i * (K + 1) + j;
            ASSERT_EQ(tgt[static_cast<size_t>(r)], argmax(la.data() + r * V, V)) << "round " << round << " row " << r;
          }
          while (acc < K && vt[static_cast<size_t>(i)][static_cast<size_t>(acc + 1)] ==
                                tgt[static_cast<size_t>(i * (K + 1) + acc)])
            ++acc;
          accepted_total += acc;
          ++verified;
          rows.push_back({i, acc + 1});
          pending[static_cast<size_t>(i)] = tgt[static_cast<size_t>(i * (K + 1) + acc)];
          first[static_cast<size_t>(i)] = nb[static_cast<size_t>(i * (K + 1) + acc)];
          carried[static_cast<size_t>(i)] = acc;
          pos[static_cast<size_t>(i)] += acc + 1;
          idx[static_cast<size_t>(i)] += acc + 1;
        }
        a.runner->keep_verified_rows(rows);
        b.runner->keep_verified_rows(rows);
      }
    }
  }
  EXPECT_GT(accepted_total, verified / 2);  // the forced acceptances happened (some rounds accept none by design)
}

// draft_deferred: the chain after a carried first draft stays on the device and the next forward_argmax_carry reads
// it into its verify chunks (SeqChunk::device_draft_row). Runner b drafts through the host (draft with carried first
// drafts, the ids back, then a verify of [pending, drafts]); runner d defers (its chunks hold placeholders there).
// Every round: the chain's ids that come back equal b's drafts, and the targets and next drafts are the same ids.
TEST_F(MtpHead, DeferredChainEqualsTheHostChain) {
  int rounds = 0;
  for (int K : {2, 3}) {
    const int S = 2;
    backend::LoadOptions o = f32_kv();
    o.state_slots = 8;
    TestRunner b(mtp_dir_, o), d(mtp_dir_, o);
    std::vector<int64_t> pos(S);
    std::vector<int32_t> pending(S), first(S);
    std::vector<int> carried(S, 0);
    {
      std::vector<model::SeqChunk> cb, cd;
      for (int i = 0; i < S; ++i) {
        const std::vector<int32_t>& prompt = fx_.prompts[static_cast<size_t>(i)].tokens;
        cb.push_back(b.chunk(i, prompt, 0));
        cd.push_back(d.chunk(i, prompt, 0));
        pos[static_cast<size_t>(i)] = static_cast<int64_t>(prompt.size());
      }
      std::vector<int32_t> tb(S), nb(S), td(S), nd(S);
      b.runner->forward_argmax_carry(cb, tb, nb);
      d.runner->forward_argmax_carry(cd, td, nd);
      ASSERT_EQ(tb, td);
      ASSERT_EQ(nb, nd);
      pending = tb;
      first = nb;
    }
    for (int round = 0; round < 4; ++round, ++rounds) {
      std::vector<model::DraftSeq> sb(S), sd;
      for (int i = 0; i < S; ++i) {
        model::DraftSeq& q = sb[static_cast<size_t>(i)];
        q.state_slot = i;
        q.token = pending[static_cast<size_t>(i)];
        q.pos = pos[static_cast<size_t>(i)];
        q.page_table = b.page_tables[static_cast<size_t>(i)];
        q.carried_row = carried[static_cast<size_t>(i)];
        q.first_draft = first[static_cast<size_t>(i)];
      }
      sd = sb;
      for (int i = 0; i < S; ++i) sd[static_cast<size_t>(i)].page_table = d.page_tables[static_cast<size_t>(i)];
      std::vector<int32_t> drafted(static_cast<size_t>(S * K));
      b.runner->draft(sb, K, drafted, {});
      d.runner->draft_deferred(sd, K);
      std::vector<std::vector<int32_t>> vb(S), vd(S);
      std::vector<model::SeqChunk> cb, cd;
      for (int i = 0; i < S; ++i) {
        vb[static_cast<size_t>(i)] = {pending[static_cast<size_t>(i)]};
        vb[static_cast<size_t>(i)].insert(vb[static_cast<size_t>(i)].end(), drafted.begin() + i * K,
                                          drafted.begin() + (i + 1) * K);
        vd[static_cast<size_t>(i)].assign(static_cast<size_t>(K + 1), pending[static_cast<size_t>(i)]);
        vd[static_cast<size_t>(i)][1] = first[static_cast<size_t>(i)];
        model::SeqChunk x = b.chunk(i, vb[static_cast<size_t>(i)], pos[static_cast<size_t>(i)]);
        model::SeqChunk y = d.chunk(i, vd[static_cast<size_t>(i)], pos[static_cast<size_t>(i)]);
        x.logits_tokens = y.logits_tokens = K + 1;
        x.checkpoint_positions = y.checkpoint_positions = true;
        y.device_draft_row = i;
        cb.push_back(x);
        cd.push_back(y);
      }
      const size_t R = static_cast<size_t>(S * (K + 1));
      std::vector<int32_t> tb(R), nb(R), td(R), nd(R), chain(static_cast<size_t>(S * (K - 1)), -1);
      b.runner->forward_argmax_carry(cb, tb, nb);
      d.runner->forward_argmax_carry(cd, td, nd, chain);
      for (int i = 0; i < S; ++i)
        for (int k = 0; k < K - 1; ++k)
          EXPECT_EQ(chain[static_cast<size_t>(i * (K - 1) + k)], drafted[static_cast<size_t>(i * K + 1 + k)])
              << "K " << K << " round " << round << " sequence " << i;
      ASSERT_EQ(tb, td) << "K " << K << " round " << round;
      ASSERT_EQ(nb, nd) << "K " << K << " round " << round;
      std::vector<model::ModelRunner::VerifiedRow> rows;
      for (int i = 0; i < S; ++i) {
        int acc = 0;
        while (acc < K && vb[static_cast<size_t>(i)][static_cast<size_t>(acc + 1)] ==
                              tb[static_cast<size_t>(i * (K + 1) + acc)])
          ++acc;
        rows.push_back({i, acc + 1});
        pending[static_cast<size_t>(i)] = tb[static_cast<size_t>(i * (K + 1) + acc)];
        first[static_cast<size_t>(i)] = nb[static_cast<size_t>(i * (K + 1) + acc)];
        carried[static_cast<size_t>(i)] = acc;
        pos[static_cast<size_t>(i)] += acc + 1;
      }
      b.runner->keep_verified_rows(rows);
      d.runner->keep_verified_rows(rows);
    }
  }
  EXPECT_EQ(rounds, 8);
  // Misuse: a chunk that reads a deferred chain when none is pending.
  TestRunner r(mtp_dir_, f32_kv());
  const std::vector<int32_t> v = {5, 6, 7};
  model::SeqChunk ch = r.chunk(0, v, 0);
  ch.logits_tokens = 3;
  ch.device_draft_row = 0;
  std::vector<int32_t> t(3), n(3);
  EXPECT_THROW(r.runner->forward_argmax_carry({&ch, 1}, t, n), Error);
}

TEST(MtpHeadErrors, DraftWithoutAHeadFails) {
  const Fixture fx = Fixture::load(kFixture);
  TestRunner r(fx.model_dir, f32_kv());
  EXPECT_THROW(draft(r, 0, 1, 1, 1), Error);
}

// transformers' MTP module (make_fixtures.py, fixture qwen3_5_moe_mtp): the draft chain after each prompt.
TEST(MtpHeadReference, DraftLogitsMatchTransformers) {
  const std::string dir = fixtures_root() + "/qwen3_5_moe_mtp";
  if (!fs::exists(dir + "/manifest.json"))
    GTEST_SKIP() << "fixture qwen3_5_moe_mtp not generated yet (tools/reference/make_fixtures.py --only mtp)";
  const nlohmann::json manifest = nlohmann::json::parse(std::ifstream(dir + "/manifest.json"));
  std::vector<uint8_t> bytes = read_bytes(dir + "/expected.safetensors");
  format::SafetensorsFile file(bytes, "qwen3_5_moe_mtp/expected.safetensors");
  auto tensor = [&](const std::string& n) { return file.find(n); };
  TestRunner r(dir + "/model", f32_kv());
  const int64_t V = r.vocab();
  const int steps = manifest["draft_steps"].get<int>();
  const double rel_tol = manifest.value("draft_rel_tol", 1e-3);
  int slot = 0;
  for (const auto& p : manifest["prompts"]) {
    const std::string pre = "p" + std::to_string(p["index"].get<int>()) + ".";
    const format::TensorInfo* tok = tensor(pre + "tokens");
    const format::TensorInfo* next = tensor(pre + "next_token");
    const format::TensorInfo* want_tok = tensor(pre + "draft_tokens");
    const format::TensorInfo* want = tensor(pre + "draft_logits");
    ASSERT_TRUE(tok && next && want && want_tok) << pre;
    std::vector<int32_t> prompt(static_cast<size_t>(tok->shape.numel()));
    std::memcpy(prompt.data(), tok->data, prompt.size() * 4);
    int32_t next_token, first_draft;
    std::memcpy(&next_token, next->data, 4);
    std::memcpy(&first_draft, want_tok->data, 4);
    const int s = slot++ % 4;
    r.run(s, prompt, 0);
    // The chain feeds its own argmax; compare the first step always, later steps while kiln drafted the same tokens.
    const Draft d = draft(r, s, next_token, static_cast<int64_t>(prompt.size()), steps);
    const float* ref = reinterpret_cast<const float*>(want->data);
    for (int k = 0; k < steps; ++k) {
      const double err = max_abs_diff(d.logits.data() + k * V, ref + k * V, V);
      EXPECT_LT(err, rel_tol * max_abs(ref + k * V, V)) << pre << " step " << k;
      int32_t want_k;
      std::memcpy(&want_k, want_tok->data + k * 4, 4);
      if (d.tokens[k] != want_k) break;
    }
    // The device chain (no logits) from the same state: the same tokens.
    std::vector<int32_t> device(static_cast<size_t>(steps), -1);
    model::DraftSeq ds;
    ds.state_slot = s;
    ds.token = next_token;
    ds.pos = static_cast<int64_t>(prompt.size());
    ds.page_table = r.page_tables[static_cast<size_t>(s)];
    r.runner->draft({&ds, 1}, steps, device, {});
    EXPECT_EQ(device, d.tokens) << pre;
    EXPECT_EQ(device[0], first_draft) << pre;
  }
}

}  // namespace
}  // namespace kiln::testing
