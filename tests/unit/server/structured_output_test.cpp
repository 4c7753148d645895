// The grammar automaton against hand-checked strings: JSON objects, JSON Schema features, Qwen3.5 XML tool
// calls. Every expectation below was written by hand from the JSON / JSON Schema specs and the tool-call
// format of server/tool_parser.h, not produced by the code under test.
#include <gtest/gtest.h>

#include "core/error.h"
#include "engine/grammar/grammar.h"
#include "server/structured_output.h"

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

TEST(GrammarJsonObject, WhitespaceIsBounded) {
  auto g = json_object_grammar();
  EXPECT_TRUE(full(g, "{" + std::string(kMaxWhitespace, ' ') + "}"));
  EXPECT_FALSE(prefix(g, "{" + std::string(kMaxWhitespace + 1, ' ')));
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
  EXPECT_NE(schema_error(R"({"type":"string","pattern":"^a"})").find("'pattern'"), std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"object","properties":{"a":{"type":"integer","minimum":0}}})").find("'minimum'"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"type":"object","properties":{"a":{"type":"integer","minimum":0}}})").find("/properties/a"),
            std::string::npos);
  EXPECT_NE(schema_error(R"({"oneOf":[{"type":"integer"}]})").find("'oneOf'"), std::string::npos);
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
  EXPECT_THROW(tool_call_grammar({{"f", R"({"type":"object","properties":{"x":{"type":"string","format":"date"}}})"}}, false),
               Error);
  EXPECT_THROW(tool_call_grammar({{"f", R"({"type":"object","properties":{"x":{}}})"}}, false), Error);
}

}  // namespace
}  // namespace kiln::server
