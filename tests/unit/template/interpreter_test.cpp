// Hand-checked behaviour of the Jinja interpreter and ChatTemplate that the jinja2 oracle tests do not
// pin down: error messages with line:column, raise_exception, resource limits, Python number
// formatting, the model-files loader and the request handling of ChatTemplate.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "template/chat_template.h"
#include "template/jinja/template.h"
#include "template/jinja/value.h"

namespace {

namespace jinja = kiln::tmpl::jinja;
using kiln::tmpl::ChatTemplate;
using nlohmann::ordered_json;

std::string render(const std::string& src, std::unordered_map<std::string, jinja::Value> vars = {},
                   const jinja::RenderLimits& limits = {}) {
  return jinja::Template(src).render(vars, limits);
}

std::string error_of(const std::string& src, std::unordered_map<std::string, jinja::Value> vars = {},
                     const jinja::RenderLimits& limits = {}) {
  try {
    render(src, std::move(vars), limits);
  } catch (const kiln::Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string fixture(const std::string& name) {
  std::ifstream in(std::string(KILN_SOURCE_DIR) + "/tests/fixtures/templates/" + name, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(JinjaErrors, RuntimeErrorsCarryLineAndColumn) {
  EXPECT_EQ(error_of("line one\n  {{ x + 1 }}"), "chat template error at line 2, column 6: 'x' is undefined");
  EXPECT_EQ(error_of("{% set d = {'a': 1} %}\n\n{{ d.a.b.c }}"),
            "chat template error at line 3, column 9: 'int object' has no attribute 'b'");
  EXPECT_EQ(error_of("{{ 'a' + 1 }}"),
            "chat template error at line 1, column 4: can only concatenate str (not \"int\") to str");
  EXPECT_EQ(error_of("{% for x in 5 %}{% endfor %}"),
            "chat template error at line 1, column 13: 'int' object is not iterable");
  EXPECT_EQ(
      error_of("{{ [1].append(2) }}"),
      "chat template error at line 1, column 14: access to attribute 'append' of 'list' object is unsafe "
      "(templates may not modify data)");
}

TEST(JinjaErrors, SyntaxErrorsCarryLineAndColumn) {
  EXPECT_EQ(error_of("{% if true %}\n  {% endfor %}"),
            "chat template syntax error at line 2, column 6: unexpected 'endfor': no block to close");
  EXPECT_EQ(error_of("{{ 1 + }}"),
            "chat template syntax error at line 1, column 8: unexpected end of print statement");
  EXPECT_EQ(error_of("ok\n{% if x %}never closed"),
            "chat template syntax error at line 2, column 23: unexpected end of template, expected 'elif' or "
            "'else' or 'endif'");
  EXPECT_EQ(error_of("{{ (1 ]}}"),
            "chat template syntax error at line 1, column 7: unexpected ']', expected ')'");
  EXPECT_EQ(error_of("{# open comment"),
            "chat template syntax error at line 1, column 1: missing end of comment tag");
  EXPECT_EQ(error_of("{{ x | nosuch }}"),
            "chat template error at line 1, column 8: no filter named 'nosuch'");
  EXPECT_EQ(error_of("{% include 'x' %}"),
            "chat template syntax error at line 1, column 4: 'include' is not supported in chat templates "
            "(they are single files)");
  // Column counts code points, not bytes.
  EXPECT_EQ(
      error_of("é😀 {{ }}"),
      "chat template syntax error at line 1, column 7: expected an expression, got end of print statement");
}

TEST(JinjaErrors, RaiseExceptionKeepsTheTemplatesMessage) {
  try {
    render("a{{ raise_exception('Conversation roles must alternate: ' ~ 3) }}");
    FAIL() << "no exception";
  } catch (const jinja::TemplateRaised& e) {
    EXPECT_STREQ(e.what(), "Conversation roles must alternate: 3");
  }
}

TEST(JinjaLimits, RunawayTemplatesFailCleanly) {
  EXPECT_NE(
      error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").find("recursion deeper than 200"),
      std::string::npos);
  EXPECT_NE(error_of("{{ range(100001) | length }}").find("Range too big"), std::string::npos);
  jinja::RenderLimits small;
  small.max_steps = 10'000;
  EXPECT_NE(
      error_of("{% for a in range(1000) %}{% for b in range(1000) %}{% endfor %}{% endfor %}", {}, small)
          .find("steps"),
      std::string::npos);
  small.max_output_bytes = 1000;
  EXPECT_NE(
      error_of("{% for a in range(100) %}0123456789abcdef{% endfor %}", {}, small).find("output exceeds"),
      std::string::npos);
  EXPECT_NE(error_of("{{ 'x' * 1000000 }}", {}, small).find("exceeds"), std::string::npos);
  // Deep nesting in the source, in values and through self-reference.
  EXPECT_NE(
      error_of("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}").find("deeper than"),
      std::string::npos);
  std::string chain = "{{ 1";
  for (int i = 0; i < 20000; ++i) chain += " + 1";
  EXPECT_NE(error_of(chain + " }}").find("deeper than"), std::string::npos);
  EXPECT_NE(
      error_of("{% set ns = namespace(x=0) %}{% for i in range(2000) %}{% set ns.x = [ns.x] %}{% endfor %}")
          .find("nested deeper than"),
      std::string::npos);
  EXPECT_NE(error_of("{% set ns = namespace() %}{% set l = [ns] %}{% set ns.l = l %}{{ l }}")
                .find("refers to itself"),
            std::string::npos);
  ordered_json deep = 1;
  for (int i = 0; i < 2000; ++i) deep = ordered_json::array({deep});
  EXPECT_THROW(jinja::Value::from_json(deep), kiln::Error);
}

TEST(JinjaValues, PythonNumberFormatting) {
  EXPECT_EQ(jinja::py_float_repr(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(jinja::py_float_repr(1e16), "1e+16");
  EXPECT_EQ(jinja::py_float_repr(1e15), "1000000000000000.0");
  EXPECT_EQ(jinja::py_float_repr(1e-5), "1e-05");
  EXPECT_EQ(jinja::py_float_repr(0.0001), "0.0001");
  EXPECT_EQ(jinja::py_float_repr(-2.5e-300), "-2.5e-300");
  EXPECT_EQ(jinja::py_float_repr(123.0), "123.0");
  EXPECT_EQ(jinja::py_float_repr(-0.0), "-0.0");
  EXPECT_EQ(render("{{ 7 // -2 }} {{ 7 % -2 }} {{ 2 ** 0.5 }} {{ 1 / 4 }}"), "-4 -1 1.4142135623730951 0.25");
  EXPECT_EQ(render("{{ [1.0, 'it\\'s', none, true] }}"), "[1.0, \"it's\", None, True]");
}

TEST(JinjaValues, TojsonIsPythonJsonDumps) {
  auto v =
      jinja::Value::from_json(ordered_json::parse(R"({"b": [1, 2.5, null], "a": "é\n\u0001", "c": {}})"));
  EXPECT_EQ(jinja::json_dumps(v, {}), R"({"b": [1, 2.5, null], "a": "é\n\u0001", "c": {}})");
  jinja::JsonDumpOptions indented;
  indented.indent = "  ";
  EXPECT_EQ(jinja::json_dumps(v, indented),
            "{\n  \"b\": [\n    1,\n    2.5,\n    null\n  ],\n  \"a\": \"é\\n\\u0001\",\n  \"c\": {}\n}");
  jinja::JsonDumpOptions ascii;
  ascii.ensure_ascii = true;
  ascii.sort_keys = true;
  EXPECT_EQ(jinja::json_dumps(v, ascii), R"({"a": "\u00e9\n\u0001", "b": [1, 2.5, null], "c": {}})");
}

TEST(JinjaWhitespace, HuggingFaceSettings) {
  // trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before it.
  EXPECT_EQ(render("{% for i in [1, 2] %}\n    {% if i %}\n  <{{ i }}>\n    {% endif %}\n{% endfor %}\n"),
            "  <1>\n  <2>\n");
  // The source's one trailing newline is dropped, \r\n becomes \n.
  EXPECT_EQ(render("a\r\nb\n\n"), "a\nb\n");
}

// ---- ChatTemplate

TEST(ChatTemplate, LoadsFromModelFiles) {
  auto from_jinja =
      ChatTemplate::from_model_files("J{{ bos_token }}", R"({"chat_template": "C", "bos_token": "<s>"})");
  EXPECT_EQ(from_jinja->render(ordered_json::parse(R"({"messages": []})")), "J<s>");
  auto from_config = ChatTemplate::from_model_files(std::nullopt, R"({"chat_template": "C{{ eos_token }}",
      "eos_token": {"content": "</s>", "lstrip": false}})");
  EXPECT_EQ(from_config->render(ordered_json::parse(R"({"messages": []})")), "C</s>");
  auto from_list = ChatTemplate::from_model_files(
      std::nullopt,
      R"({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})");
  EXPECT_EQ(from_list->render(ordered_json::parse(R"({"messages": []})")), "D");
  EXPECT_THROW(
      ChatTemplate::from_model_files(std::nullopt, R"({"chat_template": [{"name": "x", "template": "T"}]})"),
      kiln::Error);
  try {
    ChatTemplate::from_model_files(std::nullopt, R"({"eos_token": "</s>"})");
    FAIL();
  } catch (const kiln::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--chat-template"), std::string::npos);
  }
  EXPECT_THROW(ChatTemplate::from_model_files(std::nullopt, "{not json"), kiln::Error);
  // bos_token undefined when the tokenizer has none (HF leaves it out of the variables).
  EXPECT_EQ(ChatTemplate("{{ bos_token is defined }}").render(ordered_json::parse(R"({"messages": []})")),
            "False");
}

TEST(ChatTemplate, RequestHandling) {
  ChatTemplate t(
      "{{ add_generation_prompt }}|{{ tools }}|{{ enable_thinking }}|"
      "{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments is mapping }}:"
      "{{ c.function.arguments }};{% endfor %}{% endfor %}");
  auto req = ordered_json::parse(R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [
      {"type": "function", "function": {"name": "f", "arguments": "{\"city\": \"Paris\", \"n\": 2}"}},
      {"type": "function", "function": {"name": "g", "arguments": "not json"}},
      {"type": "function", "function": {"name": "h", "arguments": {"already": "object"}}}]}],
      "chat_template_kwargs": {"enable_thinking": false}})");
  EXPECT_EQ(t.render(req),
            "True|None|False|True:{'city': 'Paris', 'n': 2};False:not json;True:{'already': 'object'};");
  req["add_generation_prompt"] = false;
  req["tools"] = ordered_json::array();
  EXPECT_EQ(t.render(req).substr(0, 9), "False|[]|");

  EXPECT_THROW(t.render(ordered_json::parse(R"({"prompt": "x"})")), kiln::Error);
  EXPECT_THROW(t.render(ordered_json::parse(R"({"messages": [], "chat_template_kwargs": {"messages": []}})")),
               kiln::Error);
  EXPECT_THROW(t.render(ordered_json::parse(R"({"messages": [], "add_generation_prompt": "yes"})")),
               kiln::Error);
  EXPECT_THROW(t.render_json_text("{\"messages\": ["), kiln::Error);
  EXPECT_EQ(t.render_json_text(R"({"messages": []})"), "True|None||");
}

TEST(ChatTemplate, ThinkInjection) {
  ChatTemplate qwen35(fixture("Qwen3.5-4B.jinja"), "", "<|im_end|>");
  ChatTemplate qwen3(fixture("Qwen-Qwen3-0.6B.jinja"), "", "<|im_end|>");
  EXPECT_TRUE(qwen35.injects_think());
  EXPECT_FALSE(qwen3.injects_think());
  auto off = ordered_json::parse(
      R"({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": false}})");
  std::string prompt = qwen35.render(off);
  EXPECT_EQ(prompt, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_FALSE(ChatTemplate::prompt_ends_inside_think(prompt));
  EXPECT_TRUE(ChatTemplate::prompt_ends_inside_think("<think>\nold</think>\nx<think>\n"));
  EXPECT_FALSE(ChatTemplate::prompt_ends_inside_think("plain"));
}

TEST(ChatTemplate, SglangToolShape) {
  auto tools = ordered_json::parse(R"([{"type": "function", "function": {"name": "f", "parameters":
      {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}}},
      {"type": "function", "function": {"description": "D", "name": "g", "strict": true}}])");
  ChatTemplate t("{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}");
  ordered_json req = {{"messages", ordered_json::array()}, {"tools", ChatTemplate::sglang_tools(tools)}};
  EXPECT_EQ(t.render(req),
            "{\"description\": null, \"name\": \"f\", \"parameters\": {\"type\": \"object\", \"properties\": "
            "{\"z\": {\"type\": \"string\"}, \"a\": {\"type\": \"integer\"}}}, \"strict\": false}\n"
            "{\"description\": \"D\", \"name\": \"g\", \"parameters\": null, \"strict\": true}\n");
  EXPECT_THROW(ChatTemplate::sglang_tools(ordered_json::parse(R"([{"type": "function"}])")), kiln::Error);
}

TEST(ChatTemplate, ConcurrentRendersAgree) {
  ChatTemplate t(fixture("Qwen3.5-4B.jinja"), "", "<|im_end|>");
  auto req = ordered_json::parse(R"({"messages": [{"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "w",
       "arguments": "{\"city\": \"Oslo\"}"}}]}, {"role": "tool", "content": "cold"}],
      "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]})");
  const std::string expected = t.render(req);
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int i = 0; i < 4; ++i)
    threads.emplace_back([&, i] {
      for (int k = 0; k < 50; ++k)
        if (t.render(req) != expected) ++mismatches[i];
    });
  for (auto& th : threads) th.join();
  for (int m : mismatches) EXPECT_EQ(m, 0);
}

TEST(ChatTemplate, ReferencePromptQwen35) {
  // REFERENCE.md section 4: turns are <|im_start|>{role}\n...<|im_end|>\n, generation prompt opens <think>.
  ChatTemplate t(fixture("Qwen3.5-4B.jinja"), "", "<|im_end|>");
  EXPECT_EQ(
      t.render(ordered_json::parse(R"({"messages": [{"role": "system", "content": "S"},
                                                        {"role": "user", "content": "U"}]})")),
      "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<think>\n");
  EXPECT_THROW(t.render(ordered_json::parse(R"({"messages": [{"role": "system", "content": "S"}]})")),
               kiln::Error);
}

}  // namespace
