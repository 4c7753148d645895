// Qwen3-Coder XML tool calls: checked on the whole text and cut into pieces everywhere; the results must
// agree and match the expected values written from the format's definition.
#include <gtest/gtest.h>

#include "server/tool_parser.h"
#include "split_points.h"

namespace kiln::server {
namespace {

struct ToolOutcome {
  std::string content;
  std::vector<std::string> names;
  std::vector<std::string> arguments;
};

ToolOutcome run_tools(const nlohmann::json& tools, const std::vector<std::string>& pieces) {
  ToolCallParser p(tools);
  ToolOutcome o;
  auto absorb = [&](const ToolCallParser::Delta& d) {
    o.content += d.content;
    for (const auto& c : d.calls) {
      if (c.index >= static_cast<int>(o.names.size())) {
        EXPECT_EQ(c.index, static_cast<int>(o.names.size())) << "calls must appear in order";
        EXPECT_FALSE(c.name.empty()) << "the first piece of a call names it";
        o.names.push_back(c.name);
        o.arguments.push_back("");
      } else {
        EXPECT_TRUE(c.name.empty());
      }
      o.arguments[c.index] += c.arguments;
    }
  };
  for (const auto& s : pieces) absorb(p.push(s));
  absorb(p.finish());
  return o;
}

nlohmann::json weather_tools() {
  return nlohmann::json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
      "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
      "threshold": {"type": "number"}, "tags": {"type": "array"}, "options": {"type": "object"},
      "zip": {"type": "string"}, "note": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
  ])");
}

TEST(ToolCalls, ParsesQwen3CoderXmlAtAnySplit) {
  std::string text =
      "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
      "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
      "<parameter=threshold>\n2.5\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n"
      "<parameter=options>\n{\"x\": {\"y\": null}}\n</parameter>\n<parameter=zip>\n02139\n</parameter>\n"
      "<parameter=note>\nnull\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
      "</function>\n</tool_call>";
  for (const auto& pieces : splits_of(text)) {
    auto o = run_tools(weather_tools(), pieces);
    ASSERT_EQ(o.content, "Let me check.");
    ASSERT_EQ(o.names, (std::vector<std::string>{"get_weather", "get_time"}));
    ASSERT_EQ(o.arguments.size(), 2u);
    auto args = nlohmann::json::parse(o.arguments[0]);
    EXPECT_EQ(args["city"], "New York");
    EXPECT_EQ(args["days"], 3);
    EXPECT_EQ(args["metric"], true);
    EXPECT_EQ(args["threshold"], 2.5);
    EXPECT_EQ(args["tags"], nlohmann::json::parse(R"(["a", 1])"));
    EXPECT_EQ(args["options"], nlohmann::json::parse(R"({"x": {"y": null}})"));
    EXPECT_EQ(args["zip"], "02139");  // a string stays a string, even when it looks like a number
    EXPECT_TRUE(args["note"].is_null());
    // Key order is the model's order.
    EXPECT_EQ(o.arguments[0].substr(0, 20), "{\"city\": \"New York\",");
    ASSERT_EQ(o.arguments[1], "{}");
  }
}

TEST(ToolCalls, WithoutToolsValuesStayStrings) {
  std::string text = "<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n</function>\n</tool_call>";
  auto o = run_tools(nullptr, {text});
  ASSERT_EQ(o.arguments.size(), 1u);
  EXPECT_EQ(o.arguments[0], "{\"n\": \"42\"}");
}

TEST(ToolCalls, MultilineValuesKeepInnerNewlines) {
  std::string text =
      "<tool_call>\n<function=write>\n<parameter=code>\ndef f():\n    return 1\n\n</parameter>\n</function>\n"
      "</tool_call>";
  for (const auto& pieces : splits_of(text)) {
    auto o = run_tools(nullptr, pieces);
    ASSERT_EQ(o.arguments.size(), 1u);
    EXPECT_EQ(nlohmann::json::parse(o.arguments[0])["code"], "def f():\n    return 1\n");
  }
}

TEST(ToolCalls, PlainTextPassesThrough) {
  std::string text = "No tools here: a < b and <tool_ almost.\n";
  for (const auto& pieces : splits_of(text)) {
    auto o = run_tools(weather_tools(), pieces);
    ASSERT_EQ(o.content, text);
    ASSERT_TRUE(o.names.empty());
  }
}

TEST(ToolCalls, TruncatedCallIsClosed) {
  // Generation cut off (max_tokens) inside a parameter: what arrived is still a valid JSON text.
  std::string text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar";
  for (const auto& pieces : splits_of(text)) {
    auto o = run_tools(weather_tools(), pieces);
    ASSERT_EQ(o.names, std::vector<std::string>{"get_weather"});
    auto args = nlohmann::json::parse(o.arguments[0]);
    EXPECT_EQ(args["city"], "Par");
  }
  auto o = run_tools(weather_tools(), {"<tool_call>\n<function=get_time"});
  EXPECT_TRUE(o.names.empty());
}

TEST(ToolCalls, MissingClosingTagsAreTolerated) {
  std::string text =
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</function>\n</tool_call>";
  for (const auto& pieces : splits_of(text)) {
    auto o = run_tools(weather_tools(), pieces);
    ASSERT_EQ(o.names.size(), 1u);
    auto args = nlohmann::json::parse(o.arguments[0]);
    EXPECT_EQ(args["city"], "Oslo");
    EXPECT_EQ(args["days"], 2);
  }
}

TEST(ToolCalls, ContentAfterCallsIsKept) {
  std::string text = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n\nDone.";
  for (const auto& pieces : splits_of(text)) {
    auto o = run_tools(weather_tools(), pieces);
    ASSERT_EQ(o.content, "Done.");
  }
}

TEST(ToolCalls, ConvertValueRules) {
  using nlohmann::json;
  EXPECT_EQ(ToolCallParser::convert_value("5", json{{"type", "integer"}}), 5);
  EXPECT_EQ(ToolCallParser::convert_value("5.0", json{{"type", "integer"}}), "5.0");
  EXPECT_EQ(ToolCallParser::convert_value("5", json{{"type", "number"}}), 5);
  EXPECT_EQ(ToolCallParser::convert_value("1e3", json{{"type", "number"}}), 1000.0);
  EXPECT_EQ(ToolCallParser::convert_value("abc", json{{"type", "number"}}), "abc");
  EXPECT_EQ(ToolCallParser::convert_value("FALSE", json{{"type", "boolean"}}), false);
  EXPECT_EQ(ToolCallParser::convert_value("yes", json{{"type", "boolean"}}), "yes");
  EXPECT_EQ(ToolCallParser::convert_value("[1,2", json{{"type", "array"}}), "[1,2");
  EXPECT_TRUE(ToolCallParser::convert_value("NULL", json{{"type", "string"}}).is_null());
  EXPECT_EQ(ToolCallParser::convert_value("true", json()), "true");
}

}  // namespace
}  // namespace kiln::server
