// Counted strings (Grammar::counted_call) and shared compiled grammars: the masks of strings with minLength /
// maxLength bounds, checked token by token against a hand-written recogniser of the same small language (not the
// automaton), over a vocabulary whose tokens mix characters, escapes, halves of multi-byte characters and the
// closing quote with what follows it; the same through matchers that share one CompiledGrammar (also from several
// threads), and GrammarCache's sharing and bounds.
#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "engine/grammar/token_mask.h"

namespace kiln::grammar {
namespace {

// The language: [S1,S2,S3] where each S is a JSON-like string "..." of characters: a-z or space, e with acute
// (C3 A9), the escapes \n and \" and \u00 followed by two hex digits (0-9, a-f). Each character counts 1.
// S1 has bounds [lo1, hi1], S2 [lo2, hi2], S3 [lo3, hi3] (hi < 0: unbounded).
struct Bounds {
  int lo1, hi1, lo2, hi2, lo3, hi3;
};

// The grammar, built the way the server builds JSON strings: one string rule, bounded strings as counted calls.
std::shared_ptr<const Grammar> list_grammar(const Bounds& b) {
  auto g = std::make_shared<Grammar>();
  int32_t str = g->new_rule("string");
  std::array<bool, 256> plain{};
  for (int c = 'a'; c <= 'z'; ++c) plain[static_cast<size_t>(c)] = true;
  plain[' '] = true;
  std::array<bool, 256> hex{};
  for (const char* p = "0123456789abcdef"; *p; ++p) hex[static_cast<uint8_t>(*p)] = true;
  Frag ch = g->count_units(g->alt({g->byte_set(plain), g->literal("\xc3\xa9"), g->literal("\\n"), g->literal("\\\""),
                                   g->seq({g->literal("\\u00"), g->byte_set(hex), g->byte_set(hex)})}));
  g->define_rule(str, g->seq({g->literal("\""), g->star(ch), g->literal("\"")}));
  auto call = [&](int lo, int hi) { return lo == 0 && hi < 0 ? g->call(str) : g->counted_call(str, lo, hi); };
  int32_t root = g->new_rule("root");
  g->define_rule(root, g->seq({g->literal("["), call(b.lo1, b.hi1), g->literal(","), call(b.lo2, b.hi2), g->literal(","),
                               call(b.lo3, b.hi3), g->literal("]")}));
  g->set_root(root);
  return g;
}

// The independent recogniser: is text a prefix of a sentence (viable), and a whole one (complete)?
struct Verdict {
  bool viable = false, complete = false;
};
Verdict recognise(const std::string& t, const Bounds& b) {
  const int lo[3] = {b.lo1, b.lo2, b.lo3}, hi[3] = {b.hi1, b.hi2, b.hi3};
  size_t i = 0;
  auto at_end = [&] { return i >= t.size(); };
  if (at_end()) return {true, false};
  if (t[i++] != '[') return {};
  for (int f = 0; f < 3; ++f) {
    if (at_end()) return {true, false};
    if (t[i++] != '"') return {};
    int chars = 0;
    for (;;) {
      if (at_end()) return {true, false};
      const char c = t[i];
      if (c == '"') {
        ++i;
        if (chars < lo[f]) return {};
        break;
      }
      // A character starts here: it must be allowed by the upper bound before any of its bytes.
      if (hi[f] >= 0 && chars + 1 > hi[f]) return {};
      ++chars;
      if ((c >= 'a' && c <= 'z') || c == ' ') {
        ++i;
      } else if (c == '\xc3') {
        if (++i >= t.size()) return {true, false};
        if (t[i++] != '\xa9') return {};
      } else if (c == '\\') {
        if (++i >= t.size()) return {true, false};
        const char e = t[i++];
        if (e == 'n' || e == '"') continue;
        if (e != 'u') return {};
        for (int k = 0; k < 4; ++k) {
          if (i >= t.size()) return {true, false};
          const char h = t[i++];
          const bool ok = k < 2 ? h == '0' : ((h >= '0' && h <= '9') || (h >= 'a' && h <= 'f'));
          if (!ok) return {};
        }
      } else {
        return {};
      }
    }
    if (at_end()) return {true, false};
    if (t[i++] != (f < 2 ? ',' : ']')) return {};
  }
  return {at_end(), at_end()};
}

std::vector<std::string> vocab() {
  std::vector<std::string> v;
  for (int c = 0; c < 128; ++c) v.push_back(std::string(1, static_cast<char>(c)));
  for (const char* s : {"\xc3", "\xa9", "\xc3\xa9", "\xa9\"", "a\xc3", "\xc3\xa9\xc3\xa9", "\\", "\\n", "\\\"", "\\u",
                        "\\u00", "\\u00e9", "\\u00e", "00", "e9", "9\"", "e9\",", "ab", "abc", "abcd", "abcde", "abcdef",
                        "a b", "a\"", "ab\"", "abc\",", "abcd\",\"", "\",\"", "\",", "\"]", "\"", "\"\"", "[\"", "[\"ab",
                        "\\n\\n", "\\n\"", "\\\"\"", "a\\", "a\\u0", "z\",\"y", "\",\"\",\"", "\"]x", "]", ",\"",
                        "\xc3\xa9\"", "\xc3\xa9\",\"\xc3\xa9"})
    v.push_back(s);
  v.push_back("");  // the stop token (no bytes)
  return v;
}

// One random walk through the language, checking every mask against the recogniser. Returns false on a mismatch
// (with a message).
::testing::AssertionResult walk_and_check(Matcher& m, const TokenTable& table, const Bounds& b, int32_t stop,
                                          std::mt19937& rng) {
  std::string text;
  for (int step = 0; step < 60 && !m.finished(); ++step) {
    const TokenBitmask& mask = m.mask();
    std::vector<int32_t> allowed;
    for (int32_t i = 0; i < table.vocab_size(); ++i) {
      const bool want = i == stop ? recognise(text, b).complete
                                  : !table.bytes(i).empty() && recognise(text + table.bytes(i), b).viable;
      if (mask.test(i) != want)
        return ::testing::AssertionFailure() << "token " << i << " [" << table.bytes(i) << "] after [" << text
                                             << "]: mask " << mask.test(i) << ", recogniser " << want;
      if (want) allowed.push_back(i);
    }
    if (allowed.empty()) return ::testing::AssertionFailure() << "dead end after [" << text << "]";
    // Prefer long tokens now and then (they cross the bounds), and the stop token when it is allowed.
    int32_t pick = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
    if (mask.test(stop) && rng() % 2) pick = stop;
    if (!m.accept(pick)) return ::testing::AssertionFailure() << "accept " << pick << " after [" << text << "]";
    if (pick != stop) text += table.bytes(pick);
  }
  return ::testing::AssertionSuccess();
}

const Bounds kBounds[] = {
    {2, 4, 0, 1, 0, -1},  // min and max, max 1, unbounded
    {0, 0, 3, 3, 1, -1},  // empty only, exactly 3, min only
    {1, 2, 0, 5, 2, 6},
};

TEST(CountedMask, MasksMatchTheRecogniserAlongRandomWalks) {
  auto v = vocab();
  const int32_t stop = static_cast<int32_t>(v.size()) - 1;
  auto table = std::make_shared<TokenTable>(v);
  std::mt19937 rng(11);
  for (const Bounds& b : kBounds) {
    Matcher m0(list_grammar(b), table, {stop});  // a first matcher: fills the table's shared view masks
    auto compiled = std::make_shared<CompiledGrammar>(list_grammar(b), table);
    for (int walk = 0; walk < 60; ++walk) {
      Matcher m(compiled, {stop});  // later walks hit the shared grammar's caches
      ASSERT_TRUE(walk_and_check(m, *table, b, stop, rng)) << "bounds " << b.lo1 << ".." << b.hi1 << " walk " << walk;
    }
    EXPECT_GT(compiled->mask_hits(), 0u);
  }
}

TEST(CountedMask, HandPickedTokensAtTheBounds) {
  auto v = vocab();
  const int32_t stop = static_cast<int32_t>(v.size()) - 1;
  auto table = std::make_shared<TokenTable>(v);
  auto id = [&](const std::string& s) { return static_cast<int32_t>(std::find(v.begin(), v.end(), s) - v.begin()); };
  const Bounds b{2, 4, 0, 1, 0, -1};
  Matcher m(list_grammar(b), table, {stop});
  ASSERT_TRUE(m.accept_bytes("[\"ab"));  // S1 has 2 of at most 4 characters
  EXPECT_TRUE(m.mask().test(id("ab")));
  EXPECT_FALSE(m.mask().test(id("abc")));           // 5 characters
  EXPECT_TRUE(m.mask().test(id("\\u00e9")));        // an escape is one character
  EXPECT_TRUE(m.mask().test(id("\\n\\n")));
  EXPECT_TRUE(m.mask().test(id("\xc3\xa9\xc3\xa9")));  // two characters, four bytes
  EXPECT_TRUE(m.mask().test(id("ab\"")));           // 4 characters, then the closing quote
  EXPECT_FALSE(m.mask().test(id("abc\",")));        // 5 characters before the quote
  EXPECT_TRUE(m.mask().test(id("\",\"")));          // 2 >= minLength 2
  ASSERT_TRUE(m.accept_bytes("\\u00e9\xc3"));       // 4 characters, the last one half written
  EXPECT_TRUE(m.mask().test(id("\xa9")));
  EXPECT_TRUE(m.mask().test(id("\xa9\"")));
  EXPECT_FALSE(m.mask().test(id("\xc3\xa9")));
  ASSERT_TRUE(m.accept_bytes("\xa9"));              // 4 of 4: only the closing quote
  EXPECT_FALSE(m.mask().test(id("a")));
  EXPECT_FALSE(m.mask().test(id("\\")));            // would start a fifth character
  EXPECT_FALSE(m.mask().test(id("\xc3")));
  EXPECT_TRUE(m.mask().test(id("\"")));
  EXPECT_TRUE(m.mask().test(id("\",\"")));
  EXPECT_TRUE(m.mask().test(id("\",\"\",\"")));     // closes S1, an empty S2 (0 >= 0), opens S3
  EXPECT_FALSE(m.mask().test(id("\"]")));          // two strings missing
}

TEST(CountedMask, MinLengthHoldsTheClosingQuote) {
  auto v = vocab();
  const int32_t stop = static_cast<int32_t>(v.size()) - 1;
  auto table = std::make_shared<TokenTable>(v);
  auto id = [&](const std::string& s) { return static_cast<int32_t>(std::find(v.begin(), v.end(), s) - v.begin()); };
  Matcher m(list_grammar({0, 0, 3, 3, 1, -1}), table, {stop});
  ASSERT_TRUE(m.accept_bytes("[\"\",\"a"));  // S1 = "" (exactly 0), S2 has 1 of exactly 3
  EXPECT_FALSE(m.mask().test(id("\"")));
  EXPECT_FALSE(m.mask().test(id("a\"")));    // 2 characters
  EXPECT_TRUE(m.mask().test(id("ab\"")));    // 3
  EXPECT_FALSE(m.mask().test(id("abc")));     // 4
  EXPECT_FALSE(m.mask().test(id("\\n\"")));  // an escape, then the quote: 2 characters, not 3
}

// Several threads walking over one CompiledGrammar (the n choices of a request): every mask still matches.
TEST(CountedMask, SharedCompiledGrammarAcrossThreads) {
  auto v = vocab();
  const int32_t stop = static_cast<int32_t>(v.size()) - 1;
  auto table = std::make_shared<TokenTable>(v);
  const Bounds b = kBounds[2];
  auto compiled = std::make_shared<CompiledGrammar>(list_grammar(b), table);
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + static_cast<unsigned>(t));
      for (int walk = 0; walk < 15; ++walk) {
        Matcher m(compiled, {stop});
        if (!walk_and_check(m, *table, b, stop, rng)) ++failures[static_cast<size_t>(t)];
      }
    });
  for (auto& th : threads) th.join();
  for (int f : failures) EXPECT_EQ(f, 0);
}

// Two grammars with the same string rule share its view masks through the table (one walk of the vocabulary for
// every bounded and unbounded string), whatever the bounds.
TEST(CountedMask, ViewMasksAreSharedAcrossGrammars) {
  auto v = vocab();
  auto table = std::make_shared<TokenTable>(v);
  Matcher a(list_grammar(kBounds[0]), table, {});
  ASSERT_TRUE(a.accept_bytes("[\"a"));
  a.mask();
  const size_t shared = table->num_shared_view_masks();
  EXPECT_GE(shared, 1u);
  Matcher b(list_grammar(kBounds[1]), table, {});
  ASSERT_TRUE(b.accept_bytes("[\"\",\"a"));
  b.mask();
  EXPECT_EQ(table->num_shared_view_masks(), shared);
}

// A frame where one byte counts on one path and not on another ("ab" is a unit, "ac" is not: after 'a' the two
// configurations disagree): such prefixes are walked from the real state. At most 2 "ab" in ["..."].
TEST(CountedMask, BytesThatCountOnOnePathOnly) {
  auto g = std::make_shared<Grammar>();
  int32_t r = g->new_rule("pairs");
  g->define_rule(r, g->seq({g->literal("\""), g->star(g->alt({g->count_units(g->literal("ab")), g->literal("ac")})),
                            g->literal("\"")}));
  int32_t root = g->new_rule("root");
  g->define_rule(root, g->seq({g->literal("["), g->counted_call(r, 0, 2), g->literal("]")}));
  g->set_root(root);
  // The recogniser: [" then pairs ab / ac with at most two ab, then "].
  auto viable = [](const std::string& t) {
    const std::string head = "[\"";
    if (t.size() <= head.size()) return head.compare(0, t.size(), t) == 0;
    if (t.compare(0, head.size(), head) != 0) return false;
    size_t i = head.size();
    int ab = 0;
    while (i < t.size() && t[i] != '"') {
      if (t[i] != 'a') return false;
      if (i + 1 == t.size()) return true;
      if (t[i + 1] == 'b') ++ab;
      else if (t[i + 1] != 'c') return false;
      if (ab > 2) return false;
      i += 2;
    }
    if (i == t.size()) return true;
    return t.compare(i, std::string::npos, std::string("\"]").substr(0, t.size() - i)) == 0 && t.size() - i <= 2;
  };
  std::vector<std::string> v;
  for (const char* x : {"[", "\"", "a", "b", "c", "]", "ab", "ac", "abab", "abac", "acab", "ababab", "acacac", "ab\"",
                        "ac\"", "b\"", "c\"]", "\"]", "[\"ab", "aba", "aca", "bab", "cab"})
    v.push_back(x);
  auto table = std::make_shared<TokenTable>(v);
  std::mt19937 rng(5);
  auto compiled = std::make_shared<CompiledGrammar>(g, table);
  for (int walk = 0; walk < 40; ++walk) {
    Matcher m(compiled, {});
    std::string text;
    for (int step = 0; step < 12; ++step) {
      const TokenBitmask& mask = m.mask();
      std::vector<int32_t> allowed;
      for (int32_t i = 0; i < table->vocab_size(); ++i) {
        ASSERT_EQ(mask.test(i), viable(text + v[static_cast<size_t>(i)])) << "[" << v[static_cast<size_t>(i)] << "] after [" << text << "]";
        if (mask.test(i)) allowed.push_back(i);
      }
      if (allowed.empty()) break;
      int32_t pick = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
      ASSERT_TRUE(m.accept(pick));
      text += v[static_cast<size_t>(pick)];
    }
  }
}

TEST(GrammarCache, SameGrammarSameCompiledBounded) {
  auto table = std::make_shared<TokenTable>(vocab());
  GrammarCache cache(2, 1000);
  auto a1 = cache.get(list_grammar(kBounds[0]), table);
  auto a2 = cache.get(list_grammar(kBounds[0]), table);  // built again: equal structure
  EXPECT_EQ(a1, a2);
  EXPECT_EQ(cache.hits(), 1u);
  auto b = cache.get(list_grammar(kBounds[1]), table);  // other bounds: another grammar
  EXPECT_NE(b, a1);
  auto other_table = std::make_shared<TokenTable>(vocab());
  EXPECT_NE(cache.get(list_grammar(kBounds[0]), other_table), a1);  // another table
  EXPECT_EQ(cache.size(), 2u);                                       // capacity 2: the oldest was dropped
  EXPECT_EQ(cache.get(list_grammar(kBounds[1]), table), b);          // kept
  EXPECT_NE(cache.get(list_grammar(kBounds[0]), table), a1);         // the least recently used: dropped
  // A grammar whose automaton outgrew max_states is replaced for later requests.
  GrammarCache small(4, 3);
  auto c1 = small.get(list_grammar(kBounds[0]), table);
  Matcher m(c1, {});
  ASSERT_TRUE(m.accept_bytes("[\"abcd\",\""));
  ASSERT_GT(c1->num_states(), 3u);
  EXPECT_NE(small.get(list_grammar(kBounds[0]), table), c1);
}

}  // namespace
}  // namespace kiln::grammar
