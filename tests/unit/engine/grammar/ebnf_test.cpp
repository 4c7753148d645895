// EBNF (GBNF) grammars: texts chosen by hand that each grammar must / must not accept, and errors that say what is
// wrong.
#include <gtest/gtest.h>

#include "core/error.h"
#include "engine/grammar/ebnf.h"

namespace kiln::grammar {
namespace {

bool matches(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  Automaton a(g);
  const int32_t s = a.step_bytes(a.initial_state(), text);
  return s != Automaton::kDead && a.accepting(s);
}

std::string error_of(std::string_view text) {
  try {
    parse_ebnf(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Ebnf, ArithmeticWithRecursionAndComments) {
  auto g = parse_ebnf(R"G(
    # sums of products of small numbers, parenthesised
    root   ::= expr
    expr   ::= term ("+" term)*
    term   ::= factor ("*" factor)*
    factor ::= num | "(" expr ")"
    num    ::= [1-9] [0-9]{0,2} | "0"
  )G");
  for (const char* y : {"1", "0", "12+3*4", "(1+2)*3", "((7))", "999*(0+1)"}) EXPECT_TRUE(matches(g, y)) << y;
  for (const char* n : {"", "+", "1+", "(1", "1000", "01", "1 + 2", "()"}) EXPECT_FALSE(matches(g, n)) << n;
}

TEST(Ebnf, TermsAndRepetition) {
  auto g = parse_ebnf(R"G(root ::= "a\n" [^a-c]? "\x41\u00e9" ("x" | "yz")+ "q"{2,3} . [\]\-]*)G");
  EXPECT_TRUE(matches(g, "a\nA\xc3\xa9xqq!"));
  EXPECT_TRUE(matches(g, "a\nd" "A\xc3\xa9yzxqqq\xe2\x82\xac]-]"));
  EXPECT_FALSE(matches(g, "a\nbA\xc3\xa9xqq!"));  // b is in the excluded class
  EXPECT_FALSE(matches(g, "a\nA\xc3\xa9qq!"));    // ( ... )+ needs one
  EXPECT_FALSE(matches(g, "a\nA\xc3\xa9xq!"));    // q{2,3}
  EXPECT_FALSE(matches(g, "a\nA\xc3\xa9xqqqq!"));
  EXPECT_FALSE(matches(g, "a\nA\xc3\xa9xqq"));    // '.' needs one character
}

TEST(Ebnf, ErrorsSayWhatIsWrong) {
  EXPECT_NE(error_of("root ::= foo").find("'foo' is used but not defined"), std::string::npos);
  EXPECT_NE(error_of("start ::= \"a\"").find("root"), std::string::npos);
  EXPECT_NE(error_of("root ::= root \"a\" | \"b\"").find("left-recursive"), std::string::npos);
  EXPECT_NE(error_of("root ::= \"a\" root").find("no finite text"), std::string::npos);
  EXPECT_NE(error_of("root ::= \"a\nroot2 ::= \"b\"").find("line"), std::string::npos);
  EXPECT_NE(error_of("root ::= (\"a\"").find("missing ')'"), std::string::npos);
  EXPECT_NE(error_of("root ::= \"a\"{5,2}").find("n < m"), std::string::npos);
  EXPECT_NE(error_of("root ::= \"a\"\nroot ::= \"b\"").find("twice"), std::string::npos);
  EXPECT_NE(error_of("root ::= [^\\x00-\\U0010FFFF]").find("no character"), std::string::npos);
}

}  // namespace
}  // namespace kiln::grammar
