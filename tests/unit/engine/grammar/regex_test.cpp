// Regular expressions through the grammar automaton: strings chosen by hand that must / must not match (from the
// ECMA-262 semantics of each construct), and unsupported features named in the error.
#include <gtest/gtest.h>

#include "core/error.h"
#include "engine/grammar/regex.h"

namespace kiln::grammar {
namespace {

std::shared_ptr<const Grammar> regex(std::string_view pattern, bool search = false) {
  auto g = std::make_shared<Grammar>();
  const int32_t root = g->new_rule("root");
  RegexOptions o;
  o.search = search;
  g->define_rule(root, compile_regex(*g, pattern, o));
  g->set_root(root);
  return g;
}

bool matches(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  Automaton a(g);
  const int32_t s = a.step_bytes(a.initial_state(), text);
  return s != Automaton::kDead && a.accepting(s);
}

std::string error_of(std::string_view pattern) {
  try {
    regex(pattern);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

struct Case {
  const char* pattern;
  std::vector<const char*> yes, no;
};

TEST(Regex, WholeMatchAcceptsAndRejectsByHand) {
  const Case cases[] = {
      {"abc", {"abc"}, {"", "ab", "abcd", "xabc"}},
      {"a|bc|", {"a", "bc", ""}, {"b", "abc"}},
      {"a*", {"", "a", "aaaa"}, {"b", "aab"}},
      {"a+b?", {"a", "ab", "aaab"}, {"", "b", "abb"}},
      {"(ab)+", {"ab", "abab"}, {"", "aba", "ba"}},
      {"(?:x|yz){2}", {"xx", "xyz", "yzyz"}, {"x", "xxx", "y"}},
      {"(?<name>q)r", {"qr"}, {"q", "r"}},
      {"a{2,3}", {"aa", "aaa"}, {"a", "aaaa"}},
      {"a{2,}", {"aa", "aaaaaa"}, {"a"}},
      {"a{0}b", {"b"}, {"ab"}},
      {"a{,2}", {"a{,2}"}, {"aa"}},  // not a quantifier: literal text (ECMA-262 Annex B)
      {"x{", {"x{"}, {"x"}},
      {"[a-c]", {"a", "b", "c"}, {"d", "A", ""}},
      {"[^a-c]", {"d", "\xc3\xa9", "\n"}, {"a", "c", ""}},
      {"[a\\-z]", {"a", "-", "z"}, {"b"}},
      {"[-a]", {"-", "a"}, {"b"}},
      {"[a-]", {"-", "a"}, {"b"}},
      {"[\\d.]", {"5", "."}, {"a"}},
      {"[\\w-]", {"_", "-", "Z"}, {"."}},  // '-' after a class escape is literal
      {"\\d{3}", {"123", "000"}, {"12", "12a", "\xd9\xa3\xd9\xa3\xd9\xa3"}},  // \d is ASCII only
      {"\\D", {"a", "\xc3\xa9"}, {"7"}},
      {"\\w+", {"a_Z9"}, {"a-b", "\xc3\xa9"}},
      {"\\W", {"-", " "}, {"a", "_"}},
      {"\\s", {" ", "\t", "\n", "\xc2\xa0", "\xe3\x80\x80"}, {"a", ""}},
      {"\\S", {"a"}, {" "}},
      {".", {"a", "\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80"}, {"\n", "\r", "\xe2\x80\xa8", "", "ab"}},
      {"\\.\\*\\\\\\/", {".*\\/"}, {"a*\\/"}},
      {"\\x41\\u00e9\\u{1F600}", {"A\xc3\xa9\xf0\x9f\x98\x80"}, {"A"}},
      {"\\t\\n", {"\t\n"}, {"tn"}},
      {"\xc3\xa9+", {"\xc3\xa9\xc3\xa9"}, {"e"}},  // a multi-byte literal repeats as one character
      {"[\xc3\xa0-\xc3\xbf]", {"\xc3\xa0", "\xc3\xa9", "\xc3\xbf"}, {"\xc3\x9f", "\xc4\x80", "a"}},
      {"[\xe0\xa0\x80-\xf0\x90\x80\x80]", {"\xe0\xa0\x80", "\xef\xbf\xbf", "\xf0\x90\x80\x80", "\xed\x9f\xbf"},
       {"\xdf\xbf", "\xf0\x90\x80\x81", "\xed\xa0\x80"}},  // no surrogate (ED A0 80) inside the range
      {"^ab$", {"ab"}, {"abc"}},
      {"a*?b+?", {"b", "aab"}, {"a"}},  // lazy quantifiers: same language
  };
  for (const Case& c : cases) {
    auto g = regex(c.pattern);
    for (const char* y : c.yes) EXPECT_TRUE(matches(g, y)) << "/" << c.pattern << "/ should match [" << y << "]";
    for (const char* n : c.no) EXPECT_FALSE(matches(g, n)) << "/" << c.pattern << "/ should not match [" << n << "]";
  }
}

TEST(Regex, SearchModeAnchors) {
  auto anywhere = regex("ab", true);
  for (const char* y : {"ab", "xaby", "xxab", "abxx"}) EXPECT_TRUE(matches(anywhere, y)) << y;
  for (const char* n : {"", "a", "ba", "a b"}) EXPECT_FALSE(matches(anywhere, n)) << n;
  auto start = regex("^ab", true);
  EXPECT_TRUE(matches(start, "abzz"));
  EXPECT_FALSE(matches(start, "zab"));
  auto end = regex("ab$", true);
  EXPECT_TRUE(matches(end, "zzab"));
  EXPECT_FALSE(matches(end, "abz"));
  auto both = regex("^a|b$", true);  // an anchor per top-level alternative
  for (const char* y : {"a", "axx", "xxb", "b"}) EXPECT_TRUE(matches(both, y)) << y;
  for (const char* n : {"xa", "bx"}) EXPECT_FALSE(matches(both, n)) << n;
}

TEST(Regex, UnsupportedFeaturesAreNamed) {
  EXPECT_NE(error_of("(a)\\1").find("back-references"), std::string::npos);
  EXPECT_NE(error_of("a(?=b)").find("lookaround"), std::string::npos);
  EXPECT_NE(error_of("a(?<!b)").find("lookaround"), std::string::npos);
  EXPECT_NE(error_of("\\bword").find("word boundary"), std::string::npos);
  EXPECT_NE(error_of("\\p{L}").find("Unicode property"), std::string::npos);
  EXPECT_NE(error_of("a^b").find("'^'"), std::string::npos);
  EXPECT_NE(error_of("(a$)").find("'$'"), std::string::npos);
  EXPECT_NE(error_of("a{1001}").find("1000"), std::string::npos);
  EXPECT_NE(error_of("(?i)a").find("(?i"), std::string::npos);
  EXPECT_NE(error_of("(ab").find("missing ')'"), std::string::npos);
  EXPECT_NE(error_of("ab)").find("unbalanced"), std::string::npos);
  EXPECT_NE(error_of("[ab").find("missing ']'"), std::string::npos);
  EXPECT_NE(error_of("*a").find("nothing to repeat"), std::string::npos);
  EXPECT_NE(error_of("a**").find("nothing to repeat"), std::string::npos);
  EXPECT_NE(error_of("[z-a]").find("out of order"), std::string::npos);
  EXPECT_NE(error_of("a{3,2}").find("n < m"), std::string::npos);
  EXPECT_NE(error_of("\\q").find("unknown escape"), std::string::npos);
  EXPECT_NE(error_of("\xff").find("UTF-8"), std::string::npos);
  EXPECT_NE(error_of(std::string(100, '(') + std::string(100, ')')).find("nested deeper"), std::string::npos);
}

TEST(Regex, NestedRepeatsHitTheNodeBudget) {
  auto g = std::make_shared<Grammar>();
  CompileLimits l;
  l.max_nodes = 100'000;
  g->set_limits(l);
  try {
    compile_regex(*g, "((a{1000}){1000}){1000}");
    FAIL() << "compiled";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("too large"), std::string::npos) << e.what();
  }
  EXPECT_LE(g->nodes().size(), 100'000u);
}

TEST(Regex, CodepointSets) {
  EXPECT_EQ(normalize({{5, 9}, {1, 3}, {4, 4}}).size(), 1u);
  const CodepointSet c = complement({{0, 0x40}});
  ASSERT_EQ(c.size(), 2u);  // 0x41..0xD7FF, 0xE000..0x10FFFF
  EXPECT_EQ(c[0].lo, 0x41u);
  EXPECT_EQ(c[0].hi, 0xD7FFu);
  EXPECT_EQ(c[1].lo, 0xE000u);
  const CodepointSet i = intersect({{'a', 'z'}}, {{'x', 0x100}});
  ASSERT_EQ(i.size(), 1u);
  EXPECT_EQ(i[0].lo, static_cast<uint32_t>('x'));
  EXPECT_EQ(i[0].hi, static_cast<uint32_t>('z'));
}

}  // namespace
}  // namespace kiln::grammar
