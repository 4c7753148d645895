// Token masks: the trie walk gives exactly the tokens whose bytes fit (checked token by token), stop tokens
// only where the grammar accepts, and a mask is forced to the stop token when the grammar has ended.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "engine/grammar/token_mask.h"

namespace kiln::grammar {
namespace {

// A small vocabulary: bytes, JSON-ish pieces, multi-byte UTF-8 and its halves, an empty (special) slot.
std::vector<std::string> small_vocab() {
  std::vector<std::string> v;
  for (int b = 0; b < 256; ++b) v.push_back(std::string(1, static_cast<char>(b)));
  for (const char* s : {"{\"", "\":", "\",", "\"}", "},", "{}", "[]", "true", "false", "null", "tr", "ue", "12", "0.",
                        " \"", "\n  ", "  ", "name", "\"name\"", "\":\"", "\xc3\xa9", "\xc3", "\xe2\x82", "\\u00", "\\n",
                        "abc", "a\"", "\"a", "1,", "]}", "\"]", "[{"})
    v.push_back(s);
  v.push_back("");  // a special token: never allowed by the grammar
  v.push_back("");  // the stop token
  return v;
}

// One or two records {"name":"<letters, spaces, \xc3\xa9 or \\n>"} with an optional ,"n":[1-3 integers]
// (hand-built), comma-separated.
std::shared_ptr<const Grammar> record_grammar() {
  auto g = std::make_shared<Grammar>();
  std::array<bool, 256> letters{};
  for (int c = 'a'; c <= 'z'; ++c) letters[static_cast<size_t>(c)] = true;
  letters[' '] = true;
  int32_t str = g->new_rule("string");
  g->define_rule(str, g->seq({g->literal("\""), g->star(g->alt({g->byte_set(letters), g->literal("\xc3\xa9"), g->literal("\\n")})),
                              g->literal("\"")}));
  int32_t num = g->new_rule("integer");
  g->define_rule(num, g->seq({g->opt(g->literal("-")), g->bytes('1', '9'), g->repeat([&] { return g->bytes('0', '9'); }, 0, 3)}));
  int32_t root = g->new_rule("root");
  Frag list = g->seq({g->literal(",\"n\":["), g->call(num), g->repeat([&] { return g->seq({g->literal(","), g->call(num)}); }, 0, 2),
                      g->literal("]")});
  // The record is its own rule, called twice from the root: strings and numbers run two calls deep, so the
  // masks take the context-independent path (innermost frame + opaque bottom) and its uncertain tokens.
  int32_t rec = g->new_rule("record");
  g->define_rule(rec, g->seq({g->literal("{\"name\":"), g->call(str), g->opt(list), g->literal("}")}));
  g->define_rule(root, g->seq({g->call(rec), g->opt(g->seq({g->literal(","), g->call(rec)}))}));
  g->set_root(root);
  return g;
}

// One string rule called from two sites with different continuations ({"a":STR,"b":[STR,STR]}): both calls share
// the string's context-independent mask (the opaque view drops the return node), the closing quote's continuation
// differs ('","' / '"]' / '",') and must come from the real stack.
std::shared_ptr<const Grammar> two_sites_grammar() {
  auto g = std::make_shared<Grammar>();
  std::array<bool, 256> letters{};
  for (int c = 'a'; c <= 'z'; ++c) letters[static_cast<size_t>(c)] = true;
  int32_t str = g->new_rule("string");
  g->define_rule(str, g->seq({g->literal("\""), g->star(g->alt({g->byte_set(letters), g->literal("\xc3\xa9")})), g->literal("\"")}));
  int32_t root = g->new_rule("root");
  g->define_rule(root, g->seq({g->literal("{\"a\":"), g->call(str), g->literal(",\"b\":["), g->call(str),
                               g->opt(g->seq({g->literal(","), g->call(str)})), g->literal("]}")}));
  g->set_root(root);
  return g;
}

std::shared_ptr<const Grammar> boolean_grammar() {
  auto g = std::make_shared<Grammar>();
  int32_t root = g->new_rule("root");
  g->define_rule(root, g->alt({g->literal("true"), g->literal("false")}));
  g->set_root(root);
  return g;
}

std::shared_ptr<const Grammar> string_grammar() {
  auto g = std::make_shared<Grammar>();
  int32_t root = g->new_rule("root");
  std::array<bool, 256> letters{};
  for (int c = 'a'; c <= 'z'; ++c) letters[static_cast<size_t>(c)] = true;
  g->define_rule(root, g->seq({g->literal("\""), g->star(g->alt({g->byte_set(letters), g->literal("\xc3\xa9")})), g->literal("\"")}));
  g->set_root(root);
  return g;
}

// The independent check: a token fits when stepping its bytes one by one from the state stays alive.
std::vector<bool> brute_force(Automaton& a, int32_t state, const TokenTable& t) {
  std::vector<bool> ok(static_cast<size_t>(t.vocab_size()), false);
  for (int32_t i = 0; i < t.vocab_size(); ++i)
    ok[static_cast<size_t>(i)] = !t.bytes(i).empty() && a.step_bytes(state, t.bytes(i)) != Automaton::kDead;
  return ok;
}

TEST(TokenMask, TrieIsPreorderWithSubtreeEnds) {
  TokenTable t({"ab", "a", "b", "abc", "", "ab"});
  const auto& trie = t.trie();
  ASSERT_EQ(trie.size(), 4u);  // a, ab, abc, b
  EXPECT_EQ(trie[0].byte, 'a');
  EXPECT_EQ(trie[0].subtree_end, 3);
  EXPECT_EQ(trie[1].byte, 'b');
  EXPECT_EQ(trie[1].depth, 2);
  EXPECT_EQ(trie[1].tokens_end - trie[1].tokens_begin, 2);  // ids 0 and 5 are both "ab"
  EXPECT_EQ(trie[3].byte, 'b');
  EXPECT_EQ(trie[3].depth, 1);
}

TEST(TokenMask, MatchesTokenByTokenCheckAlongRandomWalks) {
  auto vocab = small_vocab();
  const int32_t stop = static_cast<int32_t>(vocab.size()) - 1;
  auto table = std::make_shared<TokenTable>(vocab);
  std::mt19937 rng(7);
  int finished = 0;
  for (int walk = 0; walk < 80; ++walk) {
    auto g = walk % 2 ? two_sites_grammar() : record_grammar();
    Matcher m(g, table, {stop});
    Automaton oracle(g);
    int32_t os = oracle.initial_state();
    std::string text;
    for (int step = 0; step < 200 && !m.finished(); ++step) {
      const TokenBitmask& mask = m.mask();
      auto expect = brute_force(oracle, os, *table);
      std::vector<int32_t> allowed;
      for (int32_t i = 0; i < table->vocab_size(); ++i) {
        bool want = expect[static_cast<size_t>(i)] || (i == stop && oracle.accepting(os));
        ASSERT_EQ(mask.test(i), want) << "token " << i << " after " << text;
        if (want) allowed.push_back(i);
      }
      ASSERT_FALSE(allowed.empty()) << "dead end after " << text;
      int32_t pick = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
      // Lean towards the stop token and closing pieces so that walks finish.
      if (mask.test(stop) && rng() % 2) pick = stop;
      ASSERT_TRUE(m.accept(pick));
      if (pick != stop) {
        text += table->bytes(pick);
        os = oracle.step_bytes(os, table->bytes(pick));
      }
    }
    if (m.finished()) ++finished;
  }
  EXPECT_GT(finished, 0);
}

TEST(TokenMask, StopOnlyWhenAcceptingAndForcedAtTheEnd) {
  auto vocab = small_vocab();
  const int32_t stop = static_cast<int32_t>(vocab.size()) - 1;
  auto table = std::make_shared<TokenTable>(vocab);
  Matcher m(boolean_grammar(), table, {stop});
  EXPECT_FALSE(m.mask().test(stop));
  EXPECT_FALSE(m.accept(stop));
  EXPECT_FALSE(m.accept(static_cast<int32_t>('x')));
  ASSERT_TRUE(m.accept(static_cast<int32_t>(std::find(vocab.begin(), vocab.end(), "tr") - vocab.begin())));
  EXPECT_FALSE(m.mask().test(stop));
  ASSERT_TRUE(m.accept(static_cast<int32_t>(std::find(vocab.begin(), vocab.end(), "ue") - vocab.begin())));
  EXPECT_TRUE(m.accepting());
  EXPECT_EQ(m.mask().count(), 1);  // "true" is complete: only the stop token fits
  EXPECT_TRUE(m.mask().test(stop));
  std::vector<float> logits(static_cast<size_t>(table->vocab_size()) + 5, 1.0f);  // padded rows
  EXPECT_EQ(m.apply(logits), 1);
  for (size_t i = 0; i < logits.size(); ++i)
    EXPECT_EQ(std::isinf(logits[i]), static_cast<int32_t>(i) != stop) << i;
  EXPECT_TRUE(m.accept(stop));
  EXPECT_TRUE(m.finished());
}

TEST(TokenMask, MaskCacheGivesTheSameMaskForARepeatedState) {
  auto table = std::make_shared<TokenTable>(small_vocab());
  Matcher m(string_grammar(), table, {});
  ASSERT_TRUE(m.accept_bytes("\"x"));
  TokenBitmask first = m.mask();
  ASSERT_TRUE(m.accept_bytes("abc"));  // same automaton state inside the string
  EXPECT_EQ(m.mask().words, first.words);
  EXPECT_GE(m.cache_hits(), 1u);
  EXPECT_TRUE(first.test(static_cast<int32_t>('a')));
  EXPECT_FALSE(first.test(0x01));  // control byte
  EXPECT_TRUE(first.test(0xc3));   // the first half of a two-byte character
  EXPECT_FALSE(first.test(0x80));  // a lone continuation byte
}

}  // namespace
}  // namespace kiln::grammar
