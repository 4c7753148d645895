// The engine with a grammar constraint (fake model, 64-token vocabulary): constrained sequences follow the
// grammar whether they sample greedily (the runner's argmax path is bypassed) or at temperature 1, end on eos
// exactly where the grammar is complete, and start only after their start token.
#include <gtest/gtest.h>

#include "engine/dummy_runner.h"
#include "engine/engine.h"
#include "engine/grammar/token_mask.h"

namespace kiln::engine {
namespace {

using namespace std::chrono_literals;

// Token i (1..63) is the byte 'A' + i - 1 ('A'..'~'); token 0 is eos (no bytes).
std::shared_ptr<const grammar::TokenTable> table() {
  std::vector<std::string> bytes(64);
  for (int i = 1; i < 64; ++i) bytes[static_cast<size_t>(i)] = std::string(1, static_cast<char>('A' + i - 1));
  return std::make_shared<grammar::TokenTable>(bytes);
}

// "[" then 1..3 of "AB" or "C", then "]".
std::shared_ptr<const grammar::Grammar> brackets() {
  auto g = std::make_shared<grammar::Grammar>();
  int32_t root = g->new_rule("root");
  g->define_rule(root, g->seq({g->literal("["),
                               g->repeat([&] { return g->alt({g->literal("AB"), g->literal("C")}); }, 1, 3),
                               g->literal("]")}));
  g->set_root(root);
  return g;
}

std::string text_of(const std::vector<int32_t>& toks, bool* ended_on_eos) {
  std::string s;
  *ended_on_eos = !toks.empty() && toks.back() == 0;
  for (int32_t t : toks)
    if (t > 0) s += static_cast<char>('A' + t - 1);
  return s;
}

bool valid(const std::string& s) {
  if (s.size() < 3 || s.front() != '[' || s.back() != ']') return false;
  std::string body = s.substr(1, s.size() - 2);
  int items = 0;
  for (size_t i = 0; i < body.size(); ++items) {
    if (body.compare(i, 2, "AB") == 0) i += 2;
    else if (body[i] == 'C') i += 1;
    else return false;
  }
  return items >= 1 && items <= 3;
}

std::vector<int32_t> run_one(Engine& e, GenerateRequest r) {
  auto ch = e.submit({r}).channel;
  std::vector<int32_t> toks;
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!(ch->all_finished() && !ch->has_events()) && std::chrono::steady_clock::now() < deadline) {
    std::vector<TokenEvent> evs;
    ch->wait(evs, 100ms);
    for (auto& ev : evs) {
      if (ev.token >= 0) toks.push_back(ev.token);
      EXPECT_NE(ev.finish_reason, FinishReason::error) << ev.error;
    }
  }
  return toks;
}

TEST(EngineConstraint, GreedyAndSampledRowsFollowTheGrammarAndEndOnEos) {
  EngineOptions eo;
  eo.eos_token_ids = {0};
  Engine e(std::make_unique<DummyRunner>(DummyRunner::Options{}), eo);
  e.start();
  auto c = std::make_shared<grammar::Constraint>();
  c->grammar = brackets();
  c->tokens = table();
  for (float temperature : {0.0f, 1.0f}) {
    for (int i = 0; i < 12; ++i) {
      GenerateRequest r;
      r.prompt = {static_cast<int32_t>(1 + i), 7, 9};
      r.max_tokens = 40;
      r.sampling.temperature = temperature;
      r.sampling.seed = static_cast<uint64_t>(i);
      r.constraint = c;
      bool eos = false;
      std::string s = text_of(run_one(e, r), &eos);
      EXPECT_TRUE(valid(s)) << s << " (temperature " << temperature << ")";
      EXPECT_TRUE(eos) << s;
    }
  }
}

TEST(EngineConstraint, StartsAfterItsStartToken) {
  EngineOptions eo;
  eo.eos_token_ids = {0};
  DummyRunner::Options ro;
  ro.favourite_token = 5;  // the fake model prefers token 5 after a few tokens: it is the "</think>" here
  ro.favourite_after = 6;
  Engine e(std::make_unique<DummyRunner>(ro), eo);
  e.start();
  auto c = std::make_shared<grammar::Constraint>();
  c->grammar = brackets();
  c->tokens = table();
  c->start_after_token = 5;
  GenerateRequest r;
  r.prompt = {3, 4};
  r.max_tokens = 60;
  r.sampling.temperature = 0.0f;
  r.constraint = c;
  std::vector<int32_t> toks = run_one(e, r);
  auto it = std::find(toks.begin(), toks.end(), 5);
  ASSERT_NE(it, toks.end());
  bool eos = false;
  std::string after = text_of(std::vector<int32_t>(it + 1, toks.end()), &eos);
  EXPECT_TRUE(valid(after)) << after;
  EXPECT_TRUE(eos);
}

// Requests in one batch that share one compiled grammar (the server's GrammarCache) each follow it on their own.
TEST(EngineConstraint, RequestsSharingACompiledGrammar) {
  EngineOptions eo;
  eo.eos_token_ids = {0};
  Engine e(std::make_unique<DummyRunner>(DummyRunner::Options{}), eo);
  e.start();
  auto c = std::make_shared<grammar::Constraint>();
  c->grammar = brackets();
  c->tokens = table();
  grammar::GrammarCache cache;
  c->compiled = cache.get(c->grammar, c->tokens);
  std::vector<std::shared_ptr<RequestChannel>> channels;
  for (int i = 0; i < 8; ++i) {
    GenerateRequest r;
    r.prompt = {static_cast<int32_t>(2 + i), 9};
    r.max_tokens = 40;
    r.sampling.temperature = 1.0f;
    r.sampling.seed = static_cast<uint64_t>(100 + i);
    r.constraint = c;
    channels.push_back(e.submit({r}).channel);
  }
  for (auto& ch : channels) {
    std::vector<int32_t> toks;
    auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!(ch->all_finished() && !ch->has_events()) && std::chrono::steady_clock::now() < deadline) {
      std::vector<TokenEvent> evs;
      ch->wait(evs, 100ms);
      for (auto& ev : evs)
        if (ev.token >= 0) toks.push_back(ev.token);
    }
    bool eos = false;
    std::string s = text_of(toks, &eos);
    EXPECT_TRUE(valid(s)) << s;
    EXPECT_TRUE(eos) << s;
  }
  EXPECT_GT(c->compiled->mask_hits(), 0u);
}

}  // namespace
}  // namespace kiln::engine
