// Values of the Jinja interpreter (src/template/jinja/value.*): Python's number formatting and json.dumps.
#include "template/jinja/value.h"

#include <gtest/gtest.h>

#include <string>
#include <unordered_map>

#include "template/jinja/template.h"

namespace {

namespace jinja = kiln::tmpl::jinja;
using nlohmann::ordered_json;

std::string render(const std::string& src) { return jinja::Template(src).render({}); }

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

}  // namespace
