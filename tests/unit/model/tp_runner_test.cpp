// Tensor / expert parallelism on the CPU (N ranks as threads, the in-process all-reduce): the logits of TP 2 and
// TP 4 (with KV-head and key-head replication at TP 4: the fixtures have 2 KV heads and 2 key heads) and of EP 2 / 4
// against TP 1 and against the transformers reference (tests/fixtures/reference), on every committed fixture at
// every size its shapes divide, and on kiln-tiny; greedy tokens identical. The sizes a fixture cannot take are
// written out below from its shapes and must fail to plan with the reason.
//
// Then tensor parallelism over several machines (model/tp_runner.h with a link; backend/comm_net.h), each "node" a
// thread of this test over real TCP on localhost: node 0 drives the steps, the others follow(). The logits equal
// the one-process group's of the same --tp-size bit for bit (the same rank-order sums) and TP 1's within the fp32
// tolerance; greedy identical; a follower that fails or never comes is an error on node 0, not a hang; the followers
// take node 0's sizes.
#include "model/tp_runner.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/error.h"
#include "fixture_util.h"
#include "format/safetensors.h"
#include "net_util.h"
#include "reference_fixture.h"

namespace kiln::testing {
namespace {

constexpr double kTol = 2e-4;  // max |logit difference| (fp32 maths in another summation order)

struct Size {
  int tp, ep;
};
const Size kSizes[] = {{2, 1}, {2, 2}, {4, 1}, {4, 2}, {4, 4}};

// Why a fixture cannot be split at a size ("" when it can), from the fixtures' shapes (README: 4 query / 2 KV
// heads, 2 key / 4 value heads, 8 experts of intermediate 32, shared expert 32, dense MLP 96, vocab 512): NVFP4
// weights keep whole 16-input blocks per rank.
std::string cannot_split(const std::string& fx, Size s) {
  const bool moe = fx.find("moe") != std::string::npos || fx.find("next") != std::string::npos;
  if (s.ep > 1 && !moe) return "no routed experts";
  const bool fp4_experts = fx.find("nvfp4") != std::string::npos || fx.find("mixed") != std::string::npos;
  const bool fp4_all = fx.find("nvfp4all") != std::string::npos;
  const int moe_tp = s.tp / s.ep;
  if (fp4_experts && 32 / moe_tp < 16) return "down_proj";  // each rank would keep 8 of an expert's 32 inputs
  if (fp4_all && s.tp == 4) return "down_proj";             // shared expert / dense MLP: 8 or 24 inputs per rank
  return "";
}

std::vector<float> last_logits(model::ModelRunner& r, TestRunner& pages, int slot, std::span<const int32_t> toks,
                               int64_t start) {
  std::vector<float> out(r.vocab_size());
  model::SeqChunk c = pages.chunk(slot, toks, start);
  r.forward({&c, 1}, out);
  return out;
}

double max_abs_diff(const std::vector<float>& a, const float* b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]));
  return m;
}

backend::LoadOptions opts_for(Size s) {
  backend::LoadOptions o;
  o.kv_dtype = DType::F32;
  o.state_slots = 3;
  o.max_context = 256;
  o.parallel.tp_size = s.tp;
  o.parallel.ep_size = s.ep;
  return o;
}

// Prefill each prompt, then decode the reference's greedy tokens; every logits row of TP N against TP 1 and the
// transformers reference; forward_argmax of TP N against the argmax of TP 1's logits; a two-sequence step.
void check_fixture_at(const Fixture& fx, Size s, TestRunner& one) {
  TestRunner tp(fx.model_dir, opts_for(s));
  ASSERT_NE(dynamic_cast<model::TpRunner*>(tp.runner.get()), nullptr);
  const int64_t V = fx.vocab;
  double vs_one = 0, vs_ref = 0;
  int greedy_checked = 0;
  for (const Prompt& p : fx.prompts) {
    const int64_t L = static_cast<int64_t>(p.tokens.size());
    std::vector<float> a = last_logits(*one.runner, one, 0, p.tokens, 0);
    std::vector<float> b = last_logits(*tp.runner, tp, 0, p.tokens, 0);
    const int64_t S = std::min<int64_t>(8, static_cast<int64_t>(p.greedy_tokens.size()));
    for (int64_t step = 0; step < S; ++step) {
      if (step > 0) {
        std::span<const int32_t> tok = std::span(p.greedy_tokens).subspan(step - 1, 1);
        a = last_logits(*one.runner, one, 0, tok, L + step - 1);
        b = last_logits(*tp.runner, tp, 0, tok, L + step - 1);
      }
      vs_one = std::max(vs_one, max_abs_diff(b, a.data()));
      vs_ref = std::max(vs_ref, max_abs_diff(b, &p.greedy_logits[step * V]));
      std::vector<float> sorted(a);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
      if (sorted[0] - sorted[1] > 2 * kTol) {
        ++greedy_checked;
        EXPECT_EQ(argmax(b.data(), V), argmax(a.data(), V)) << fx.name << " step " << step;
      }
    }
  }
  // forward_argmax (each rank's best over its vocabulary slice) against TP 1's logits, and a step of two sequences
  // (prefill of one, prefill of another) whose rows come back in chunk order.
  const Prompt& p0 = fx.prompts.back();
  const Prompt& p1 = fx.prompts.front();
  model::SeqChunk chunks[2] = {tp.chunk(1, p0.tokens, 0), tp.chunk(2, p1.tokens, 0)};
  std::vector<int32_t> ids(2);
  tp.runner->forward_argmax(chunks, ids);
  const std::vector<float> a0 = last_logits(*one.runner, one, 1, p0.tokens, 0);
  const std::vector<float> a1 = last_logits(*one.runner, one, 2, p1.tokens, 0);
  EXPECT_EQ(ids[0], argmax(a0.data(), V)) << fx.name;
  EXPECT_EQ(ids[1], argmax(a1.data(), V)) << fx.name;
  model::SeqChunk again[2] = {tp.chunk(1, p0.tokens, 0), tp.chunk(2, p1.tokens, 0)};
  std::vector<float> both(2 * V);
  tp.runner->forward(again, both);
  EXPECT_LT(max_abs_diff(a0, both.data()), kTol) << fx.name;
  EXPECT_LT(max_abs_diff(a1, both.data() + V), kTol) << fx.name;

  std::printf("[tp] %-22s tp %d ep %d: max |TP - TP1| %.2e, max |TP - transformers| %.2e, greedy %d checked\n",
              fx.name.c_str(), s.tp, s.ep, vs_one, vs_ref, greedy_checked);
  EXPECT_LT(vs_one, kTol) << fx.name;
  EXPECT_LT(vs_ref, kTol) << fx.name;
  EXPECT_GT(greedy_checked, 0) << fx.name;
}

class TpFixtureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TpFixtureTest, MatchesTp1AndTransformers) {
  const Fixture fx = Fixture::load(GetParam());
  TestRunner one(fx.model_dir, opts_for({1, 1}));
  int ran = 0;
  for (Size s : kSizes) {
    const std::string why = cannot_split(fx.name, s);
    if (!why.empty()) {
      // The loader refuses it before reading weights, naming the reason.
      try {
        TestRunner bad(fx.model_dir, opts_for(s));
        ADD_FAILURE() << fx.name << " tp " << s.tp << " ep " << s.ep << " should not load";
      } catch (const Error& e) {
        EXPECT_THAT(e.what(), ::testing::HasSubstr(why)) << fx.name;
      }
      continue;
    }
    SCOPED_TRACE(fmt::format("{} tp {} ep {}", fx.name, s.tp, s.ep));
    check_fixture_at(fx, s, one);
    ++ran;
  }
  EXPECT_GE(ran, 1);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TpFixtureTest, ::testing::ValuesIn(Fixture::all_names()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(TpRunner, EveryFixtureRunsAtTp4) {
  // TP 4 (with KV-head and key-head replication) for every fixture whose NVFP4 blocks allow it: all but the
  // nvfp4all ones (their shared expert has 32 inputs of down_proj).
  for (const std::string& name : Fixture::all_names()) {
    bool some = false;
    for (Size s : kSizes) some |= s.tp == 4 && cannot_split(name, s).empty();
    EXPECT_EQ(some, name.find("nvfp4all") == std::string::npos) << name;
  }
}

TEST(TpRunner, KilnTinyGreedyIdenticalAtTp2AndTp4) {
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  TestRunner one(dir, opts_for({1, 1}));
  const std::vector<int32_t> prompt = {2049, 872, 198, 3, 100, 57, 911, 2050, 198, 2049, 77, 198};
  for (Size s : {Size{2, 1}, Size{4, 1}, Size{4, 4}}) {
    TestRunner tp(dir, opts_for(s));
    std::vector<int32_t> seq1 = prompt, seqn = prompt;
    double worst = 0;
    for (int step = 0; step < 12; ++step) {
      const int64_t start = step == 0 ? 0 : static_cast<int64_t>(seq1.size()) - 1;
      std::span<const int32_t> in1 = std::span(seq1).subspan(start), inn = std::span(seqn).subspan(start);
      std::vector<float> a = last_logits(*one.runner, one, 0, in1, start);
      std::vector<float> b = last_logits(*tp.runner, tp, 0, inn, start);
      worst = std::max(worst, max_abs_diff(b, a.data()));
      // Each follows its own argmax: the generated texts must stay identical.
      seq1.push_back(argmax(a.data(), one.vocab()));
      seqn.push_back(argmax(b.data(), tp.vocab()));
    }
    std::printf("[tp] kiln-tiny tp %d ep %d: max |TP - TP1| %.2e\n", s.tp, s.ep, worst);
    EXPECT_EQ(seqn, seq1) << "tp " << s.tp << " ep " << s.ep;
    EXPECT_LT(worst, 1e-3);
    // forward_argmax over the whole generated text equals TP 1's argmax.
    std::vector<int32_t> id(1);
    model::SeqChunk c = tp.chunk(1, seq1, 0);
    tp.runner->forward_argmax({&c, 1}, id);
    const std::vector<float> a = last_logits(*one.runner, one, 1, seq1, 0);
    EXPECT_EQ(id[0], argmax(a.data(), one.vocab()));
  }
}

TEST(TpRunner, DummyWeightsAreSlicesOfTheSameModel) {
  // --load-format dummy: each rank fills its slice of the same random tensors, so TP 2 computes TP 1's model.
  const Fixture fx = Fixture::load("qwen3_5_moe_nvfp4");
  backend::LoadOptions o1 = opts_for({1, 1}), o2 = opts_for({2, 1});
  o1.load_format = o2.load_format = model::LoadFormat::dummy;
  TestRunner one(fx.model_dir, o1), two(fx.model_dir, o2);
  const std::vector<float> a = last_logits(*one.runner, one, 0, fx.prompts.back().tokens, 0);
  const std::vector<float> b = last_logits(*two.runner, two, 0, fx.prompts.back().tokens, 0);
  double ref = 0;
  for (float x : a) ref = std::max(ref, double(std::fabs(x)));
  EXPECT_GT(ref, 0);
  EXPECT_LT(max_abs_diff(b, a.data()), 1e-4 * std::max(1.0, ref));
}

TEST(TpRunner, BadSizesFailBeforeLoading) {
  const Fixture fx = Fixture::load("qwen3_5_moe_bf16");
  auto error = [&](Size s) {
    try {
      TestRunner tr(fx.model_dir, opts_for(s));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  EXPECT_THAT(error({3, 1}), ::testing::HasSubstr("4 query heads do not split over 3 ranks"));
  EXPECT_THAT(error({8, 1}), ::testing::HasSubstr("4 query heads do not split over 8 ranks"));
  EXPECT_THAT(error({4, 3}), ::testing::HasSubstr("--ep-size 3 must divide --tp-size 4"));
  EXPECT_THAT(error({0, 1}), ::testing::HasSubstr("--tp-size must be at least 1"));
}

// A copy of a fixture model whose vocabulary is cut to its first `vocab` rows (embed_tokens and lm_head rows, and
// vocab_size wherever config.json has it). Row v of lm_head gives logit v from the same hidden state, and ids below
// `vocab` embed the same, so the cut model's logits are the transformers reference's first `vocab` columns.
void write_cut_vocabulary(const Fixture& fx, int64_t vocab, const std::string& out_dir) {
  namespace fs = std::filesystem;
  for (const auto& e : fs::directory_iterator(fx.model_dir))
    if (e.path().filename() != "model.safetensors" && e.path().filename() != "config.json")
      fs::copy_file(e.path(), out_dir + "/" + e.path().filename().string());
  nlohmann::json config = nlohmann::json::parse(std::ifstream(fx.model_dir + "/config.json"));
  std::function<void(nlohmann::json&)> cut = [&](nlohmann::json& j) {
    if (!j.is_object()) return;
    for (auto& [k, v] : j.items()) {
      if (k == "vocab_size") v = vocab;
      cut(v);
    }
  };
  cut(config);
  std::ofstream(out_dir + "/config.json") << config.dump(2);
  const std::vector<uint8_t> bytes = read_bytes(fx.model_dir + "/model.safetensors");
  format::SafetensorsFile file(bytes, "model.safetensors");
  format::SafetensorsWriter w;
  int cut_tensors = 0;
  for (const format::TensorInfo& t : file.tensors()) {
    const bool vocab_rows = (t.name.find("embed_tokens") != std::string::npos ||
                             t.name.find("lm_head") != std::string::npos) &&
                            t.shape.ndim >= 1 && t.shape.dims[0] == fx.vocab;
    if (!vocab_rows) {
      w.add(t.name, t.dtype, t.shape, t.bytes());
      continue;
    }
    Shape shape = t.shape;
    shape.dims[0] = vocab;
    const size_t row_bytes = t.nbytes / static_cast<size_t>(fx.vocab);
    w.add(t.name, t.dtype, shape, t.bytes().first(row_bytes * static_cast<size_t>(vocab)));
    ++cut_tensors;
  }
  ASSERT_GE(cut_tensors, 1) << fx.name;  // the embedding (and lm_head, unless tied)
  w.write(out_dir + "/model.safetensors");
}

// Any vocabulary at any TP size (vLLM and SGLang pad the vocabulary shards instead): a vocabulary of 509 rows (a
// prime: no size divides it) at TP 2 and TP 4 (the fixtures' 4 query heads allow no other): the first V % N ranks
// hold one row more.
// Logits equal TP 1's and the transformers reference's first 509 columns; greedy picks (forward_argmax, whose ids
// are each rank's offset plus a local index) equal TP 1's; no id at or past 509 ever comes back.
TEST(TpRunner, VocabularyNoSizeDivides) {
  constexpr int64_t kVocab = 509;
  for (const std::string name : {"qwen3_5_moe_bf16", "qwen3_next_bf16", "qwen3_bf16"}) {
    SCOPED_TRACE(name);
    const Fixture fx = Fixture::load(name);
    test::TempDir tmp;
    write_cut_vocabulary(fx, kVocab, tmp.path());
    TestRunner one(tmp.path(), opts_for({1, 1}));
    ASSERT_EQ(one.runner->vocab_size(), kVocab);
    for (Size s : {Size{2, 1}, Size{4, 1}}) {
      TestRunner tp(tmp.path(), opts_for(s));
      ASSERT_EQ(tp.runner->vocab_size(), kVocab);
      double vs_one = 0, vs_ref = 0;
      int prompts = 0;
      for (const Prompt& p : fx.prompts) {
        const bool in_vocab = std::all_of(p.tokens.begin(), p.tokens.end(), [](int32_t t) { return t < kVocab; });
        if (!in_vocab || p.greedy_tokens.empty()) continue;
        ++prompts;
        const std::vector<float> a = last_logits(*one.runner, one, 0, p.tokens, 0);
        const std::vector<float> b = last_logits(*tp.runner, tp, 0, p.tokens, 0);
        vs_one = std::max(vs_one, max_abs_diff(b, a.data()));
        for (int64_t v = 0; v < kVocab; ++v)
          vs_ref = std::max(vs_ref, std::fabs(double(b[v]) - p.greedy_logits[v]));  // step 0: after the prompt
        model::SeqChunk c = tp.chunk(1, p.tokens, 0);
        int32_t id = -1;
        tp.runner->forward_argmax({&c, 1}, {&id, 1});
        EXPECT_EQ(id, argmax(a.data(), kVocab));
        EXPECT_GE(id, 0);
        EXPECT_LT(id, kVocab);
      }
      std::printf("[tp] %-18s vocab %lld tp %d: max |TP - TP1| %.2e, max |TP - transformers| %.2e over %d prompts\n",
                  name.c_str(), static_cast<long long>(kVocab), s.tp, vs_one, vs_ref, prompts);
      EXPECT_GT(prompts, 0);
      EXPECT_LT(vs_one, kTol);
      EXPECT_LT(vs_ref, kTol);
    }
  }
}

// The MTP head under TP: after the same prefill, TP 2 and TP 4 draft the logits of TP 1 (the transformers-checked
// head, tests/fixtures/reference/qwen3_5_moe_mtp) within the fp32 tolerance and the same tokens wherever TP 1's best
// logit leads by more than the tolerance; save_state / restore_state bring a rank group back to the same drafts.
TEST(TpRunner, MtpDraftsMatchTp1) {
  const Fixture fx = Fixture::load("qwen3_5_moe_mtp");
  auto opts = [](Size s) {
    backend::LoadOptions o = opts_for(s);
    o.mtp = true;
    return o;
  };
  TestRunner one(fx.model_dir, opts({1, 1}));
  ASSERT_EQ(one.runner->mtp_layers(), 1);
  constexpr int kSteps = 3;
  const int64_t V = fx.vocab;
  for (Size s : {Size{2, 1}, Size{4, 1}, Size{2, 2}}) {
    TestRunner tp(fx.model_dir, opts(s));
    ASSERT_EQ(tp.runner->mtp_layers(), 1);
    double worst = 0;
    int tokens_checked = 0;
    for (const Prompt& p : fx.prompts) {
      const int64_t L = static_cast<int64_t>(p.tokens.size());
      const std::vector<float> a = last_logits(*one.runner, one, 0, p.tokens, 0);
      last_logits(*tp.runner, tp, 0, p.tokens, 0);
      const int32_t next = static_cast<int32_t>(argmax(a.data(), V));
      std::vector<int32_t> t1(kSteps), tn(kSteps), tn2(kSteps);
      std::vector<float> l1(kSteps * V), ln(kSteps * V), ln2(kSteps * V);
      model::DraftSeq d1{0, next, L, one.page_tables[0]}, dn{0, next, L, tp.page_tables[0]};
      one.runner->draft({&d1, 1}, kSteps, t1, l1);
      tp.runner->save_state(0);
      tp.runner->draft({&dn, 1}, kSteps, tn, ln);
      for (int k = 0; k < kSteps; ++k) {
        const float* r1 = l1.data() + k * V;
        worst = std::max(worst, max_abs_diff(std::vector<float>(ln.begin() + k * V, ln.begin() + (k + 1) * V), r1));
        std::vector<float> sorted(r1, r1 + V);
        std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
        if (sorted[0] - sorted[1] <= 2 * kTol) break;  // a near tie: the chains may part here
        EXPECT_EQ(tn[k], t1[k]) << fx.name << " tp " << s.tp << " ep " << s.ep << " step " << k;
        ++tokens_checked;
      }
      // The drafts wrote only the head's KV entries; after a restore the same draft comes back bit for bit.
      tp.runner->restore_state(0);
      tp.runner->draft({&dn, 1}, kSteps, tn2, ln2);
      EXPECT_EQ(tn2, tn);
      EXPECT_EQ(ln2, ln);
    }
    std::printf("[tp] mtp drafts tp %d ep %d: max |TP - TP1| %.2e over %d prompts x %d steps, %d tokens checked\n",
                s.tp, s.ep, worst, static_cast<int>(fx.prompts.size()), kSteps, tokens_checked);
    EXPECT_LT(worst, kTol);
    EXPECT_GT(tokens_checked, 0);
  }
}

TEST(TpRunner, DescribeShowsPerRankFigures) {
  const Fixture fx = Fixture::load("qwen3_5_moe_bf16");
  TestRunner tp(fx.model_dir, opts_for({4, 2}));
  const std::string d = tp.runner->describe();
  EXPECT_THAT(d, ::testing::HasSubstr("tensor parallel 4 x cpu (ep 2"));
  EXPECT_THAT(d, ::testing::HasSubstr("1 q / 1 KV heads, 1 key / 1 value heads, experts 4 of 8 (intermediate 16)"));
  EXPECT_THAT(d, ::testing::HasSubstr("rank 3 "));
  // Rank capacity: the KV cache of one KV head (F32, 1 full layer, head dim 32): 1 x 2 x 1 x 32 x 4 bytes.
  EXPECT_EQ(tp.runner->capacity().kv_bytes_per_token, 1 * 2 * 1 * 32 * 4);
}

}  // namespace
}  // namespace kiln::testing

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;


backend::LoadOptions node_opts(int tp, int ep, int nnodes, int node, int port) {
  backend::LoadOptions o;
  o.kv_dtype = DType::F32;
  o.state_slots = 3;
  o.max_context = 256;
  o.parallel.tp_size = tp;
  o.parallel.ep_size = ep;
  o.parallel.nnodes = nnodes;
  o.parallel.node_rank = node;
  // One node meets no one: no address (backend::validate_parallel refuses a port of 0).
  if (nnodes > 1) o.parallel.dist_init_addr = fmt::format("127.0.0.1:{}", port);
  o.parallel.dist_timeout_s = 20;
  return o;
}

// The other nodes: load, then follow node 0 until it stops the group; the future says how it ended ("" = stopped).
std::vector<std::future<std::string>> start_followers(const std::string& dir, int tp, int ep, int nnodes, int port,
                                                      std::function<void(backend::LoadOptions&)> tweak = {}) {
  std::vector<std::future<std::string>> out;
  for (int k = 1; k < nnodes; ++k)
    out.push_back(std::async(std::launch::async, [=]() -> std::string {
      try {
        backend::LoadOptions o = node_opts(tp, ep, nnodes, k, port);
        if (tweak) tweak(o);
        auto r = backend::load_cpu_model(format::ModelDir::open(dir), o);
        dynamic_cast<model::TpRunner&>(*r).follow();
        return "";
      } catch (const std::exception& e) {
        return e.what();
      }
    }));
  return out;
}

std::vector<float> logits_of(TestRunner& r, int slot, std::span<const int32_t> toks, int64_t start) {
  std::vector<float> out(r.vocab());
  model::SeqChunk c = r.chunk(slot, toks, start);
  r.runner->forward({&c, 1}, out);
  return out;
}

struct Shape {
  int tp, ep, nnodes;
};

TEST(TpNodes, KilnTinyOverNodesEqualsOneProcess) {
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  const std::vector<int32_t> prompt = {2049, 872, 198, 3, 100, 57, 911, 2050, 198, 2049, 77, 198};
  backend::LoadOptions one_o = node_opts(1, 1, 1, 0, 0);
  TestRunner one(dir, one_o);
  for (Shape s : {Shape{2, 1, 2}, Shape{4, 2, 2}, Shape{4, 1, 4}}) {
    SCOPED_TRACE(fmt::format("tp {} ep {} nnodes {}", s.tp, s.ep, s.nnodes));
    backend::LoadOptions same = node_opts(s.tp, s.ep, 1, 0, 0);
    TestRunner local(dir, same);  // the one-process group of the same size
    const int port = free_port();
    auto followers = start_followers(dir, s.tp, s.ep, s.nnodes, port);
    {
      TestRunner node0(dir, node_opts(s.tp, s.ep, s.nnodes, 0, port));
      EXPECT_THAT(node0.runner->describe(), HasSubstr(fmt::format("{} nodes; ranks 0-{} on this node (node 0)",
                                                                  s.nnodes, s.tp / s.nnodes - 1)));
      std::vector<int32_t> seq = prompt, seq1 = prompt;
      double worst = 0;
      for (int step = 0; step < 10; ++step) {
        const int64_t start = step == 0 ? 0 : static_cast<int64_t>(seq.size()) - 1;
        const std::vector<float> n = logits_of(node0, 0, std::span(seq).subspan(start), start);
        const std::vector<float> l = logits_of(local, 0, std::span(seq).subspan(start), start);
        const std::vector<float> a = logits_of(one, 0, std::span(seq1).subspan(start), start);
        ASSERT_EQ(n, l) << "step " << step << ": the nodes' sums differ from the one-process group's";
        for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, double(std::fabs(n[i] - a[i])));
        seq.push_back(argmax(n.data(), node0.vocab()));
        seq1.push_back(argmax(a.data(), one.vocab()));
      }
      EXPECT_EQ(seq, seq1);
      EXPECT_LT(worst, 1e-3);
      // forward_argmax (the other nodes send their best (value, id) per row) on a two-sequence step after a state
      // copy driven on every node; the one-process group does the same.
      node0.runner->copy_state(0, 2);
      std::vector<int32_t> tail = {seq.back()};
      model::SeqChunk chunks[2] = {node0.chunk(1, prompt, 0), node0.chunk(2, tail, static_cast<int64_t>(seq.size()) - 1)};
      std::vector<int32_t> ids(2);
      node0.runner->forward_argmax(chunks, ids);
      local.runner->copy_state(0, 2);
      model::SeqChunk lc[2] = {local.chunk(1, prompt, 0), local.chunk(2, tail, static_cast<int64_t>(seq.size()) - 1)};
      std::vector<float> both(2 * local.vocab());
      local.runner->forward(lc, both);
      EXPECT_EQ(ids[0], argmax(both.data(), local.vocab()));
      EXPECT_EQ(ids[1], argmax(both.data() + local.vocab(), local.vocab()));
    }
    // Node 0 gone: every follower was stopped cleanly.
    for (auto& f : followers) EXPECT_EQ(f.get(), "");
  }
}

TEST(TpNodes, FollowerFailureIsAnErrorOnNodeZero) {
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  const std::vector<int32_t> prompt = {2049, 872, 198, 3, 100};
  const int port = free_port();
  auto followers = start_followers(dir, 2, 1, 2, port);
  TestRunner node0(dir, node_opts(2, 1, 2, 0, port));
  (void)logits_of(node0, 0, prompt, 0);
  // A step the follower rejects (a state slot it does not have): node 0's step fails naming it, then the group is
  // broken for good, with the reason.
  std::vector<float> out(node0.vocab());
  model::SeqChunk bad = node0.chunk(7, prompt, 0);
  try {
    node0.runner->forward({&bad, 1}, out);
    ADD_FAILURE() << "a bad slot ran";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("slot"));
  }
  try {
    (void)logits_of(node0, 0, prompt, 0);
    ADD_FAILURE() << "a broken group ran a step";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("failed earlier"));
    EXPECT_THAT(e.what(), HasSubstr("restart every node"));
  }
  EXPECT_THAT(followers[0].get(), HasSubstr("restart every node"));
}

TEST(TpNodes, FollowersTakeNodeZerosSizes) {
  // A follower launched with other sizes (here: state slots) runs with node 0's: node 0 decides the group's KV pages,
  // slots and context (a `kiln generate` on node 0 sizes it for its prompt), and the steps work.
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  const int port = free_port();
  auto followers = start_followers(dir, 2, 1, 2, port, [](backend::LoadOptions& o) {
    o.state_slots = 5;
    o.max_context = 128;
  });
  {
    TestRunner node0(dir, node_opts(2, 1, 2, 0, port));
    EXPECT_EQ(node0.runner->capacity().state_slots, 3);
    const std::vector<int32_t> prompt = {2049, 872, 198, 3, 100};
    model::SeqChunk c = node0.chunk(2, prompt, 0);  // the last of node 0's 3 slots
    std::vector<int32_t> id(1);
    node0.runner->forward_argmax({&c, 1}, id);
    EXPECT_GE(id[0], 0);
  }
  EXPECT_EQ(followers[0].get(), "");
}

TEST(TpNodes, MissingNodeTimesOut) {
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  backend::LoadOptions o = node_opts(2, 1, 2, 0, free_port());
  o.parallel.dist_timeout_s = 1;
  try {
    TestRunner node0(dir, o);
    ADD_FAILURE() << "node 0 started without node 1";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("node rank(s) 1 of 2 did not arrive within 1 s"));
  }
}

}  // namespace
}  // namespace kiln::testing
