// Hand-checked behaviour of the Jinja interpreter (src/template/jinja/interpreter.*) that the jinja2 oracle tests
// (template_test.cpp) do not pin down: error messages with line:column, raise_exception, resource limits, Hugging
// Face's whitespace settings.
#include "template/jinja/interpreter.h"

#include <gtest/gtest.h>

#include <string>
#include <unordered_map>

#include "core/error.h"
#include "template/jinja/template.h"
#include "template/jinja/value.h"

namespace {

namespace jinja = kiln::tmpl::jinja;
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

TEST(JinjaWhitespace, HuggingFaceSettings) {
  // trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before it.
  EXPECT_EQ(render("{% for i in [1, 2] %}\n    {% if i %}\n  <{{ i }}>\n    {% endif %}\n{% endfor %}\n"),
            "  <1>\n  <2>\n");
  // The source's one trailing newline is dropped, \r\n becomes \n.
  EXPECT_EQ(render("a\r\nb\n\n"), "a\nb\n");
}

}  // namespace
