// Incremental text parsers: stop strings, reasoning, Qwen3-Coder tool calls. Every case is checked
// at once and cut into pieces everywhere (every split point, plus random multi-way splits): the
// results must agree, and match the expected values written from the formats' definitions.
#include <gtest/gtest.h>

#include <random>

#include "server/reasoning_parser.h"
#include "server/stop_strings.h"
#include "server/tool_parser.h"

namespace kiln::server {
namespace {

// All ways to cut `text` in two, and some random many-piece cuts.
std::vector<std::vector<std::string>> splits_of(const std::string& text) {
  std::vector<std::vector<std::string>> out;
  out.push_back({text});
  for (size_t i = 0; i <= text.size(); ++i) out.push_back({text.substr(0, i), text.substr(i)});
  std::mt19937 rng(1234);
  for (int r = 0; r < 30; ++r) {
    std::vector<std::string> pieces;
    size_t pos = 0;
    while (pos < text.size()) {
      size_t n = 1 + rng() % 4;
      pieces.push_back(text.substr(pos, n));
      pos += n;
    }
    out.push_back(pieces);
  }
  // One byte at a time.
  std::vector<std::string> bytes;
  for (char c : text) bytes.push_back(std::string(1, c));
  out.push_back(bytes);
  return out;
}

// --- stop strings ---

struct StopOutcome {
  std::string text;
  bool stopped;
};

StopOutcome run_stop(const std::vector<std::string>& stops, const std::vector<std::string>& pieces,
                     std::vector<std::string>* shown = nullptr) {
  StopStringMatcher m(stops);
  StopOutcome o{"", false};
  for (const auto& p : pieces) {
    auto r = m.push(p);
    if (shown) shown->push_back(r.text);
    o.text += r.text;
    if (r.stopped) {
      o.stopped = true;
      return o;
    }
  }
  o.text += m.flush();
  return o;
}

TEST(StopStrings, CutsBeforeTheFirstMatchAtAnySplit) {
  struct Case {
    std::vector<std::string> stops;
    std::string text;
    std::string expect;
    bool stopped;
  };
  std::vector<Case> cases = {
      {{"STOP"}, "hello STOP world", "hello ", true},
      {{"STOP"}, "hello STO", "hello STO", false},
      {{"\n\n"}, "line one\nline two\n\nrest", "line one\nline two", true},
      {{"ab", "b"}, "xxab", "xx", true},           // earliest match wins
      {{"abc", "ab"}, "--abc", "--", true},
      {{"aab"}, "aaab", "a", true},                // overlapping prefix
      {{"é!"}, "caf\xc3\xa9 ok caf\xc3\xa9!", "caf\xc3\xa9 ok caf", true},
      {{}, "nothing to stop", "nothing to stop", false},
  };
  for (const auto& c : cases)
    for (const auto& pieces : splits_of(c.text)) {
      auto o = run_stop(c.stops, pieces);
      EXPECT_EQ(o.text, c.expect) << c.text;
      EXPECT_EQ(o.stopped, c.stopped) << c.text;
    }
}

TEST(StopStrings, NeverShowsAPartialStopString) {
  std::vector<std::string> shown;
  run_stop({"</answer>"}, {"The result </ans", "wer> and more"}, &shown);
  ASSERT_EQ(shown.size(), 2u);
  EXPECT_EQ(shown[0], "The result ");
  EXPECT_EQ(shown[1], "");
  shown.clear();
  auto o = run_stop({"</answer>"}, {"a </an", "d b"}, &shown);
  EXPECT_EQ(shown[0], "a ");
  EXPECT_EQ(o.text, "a </and b");
}

// --- reasoning ---

ReasoningParser::Delta run_reasoning(bool start_in, const std::vector<std::string>& pieces) {
  ReasoningParser p(start_in);
  ReasoningParser::Delta all;
  for (const auto& s : pieces) {
    auto d = p.push(s);
    all.reasoning += d.reasoning;
    all.content += d.content;
  }
  auto d = p.finish();
  all.reasoning += d.reasoning;
  all.content += d.content;
  return all;
}

TEST(Reasoning, SplitsAtThinkCloseAtAnySplit) {
  struct Case {
    bool start_in;
    std::string text, reasoning, content;
  };
  std::vector<Case> cases = {
      // Qwen3.5 thinking mode: the prompt opened the block.
      {true, "Let me think.\nTwo plus two.\n</think>\n\nThe answer is 4.", "Let me think.\nTwo plus two.",
       "The answer is 4."},
      // Stops before </think>: all reasoning, empty answer.
      {true, "Still thinking about it ", "Still thinking about it", ""},
      {true, "", "", ""},
      // <tool_call> closes the block implicitly and stays in the content.
      {true, "I should call a tool.\n<tool_call>\n<function=f>", "I should call a tool.",
       "<tool_call>\n<function=f>"},
      // The model opens the block itself (Qwen3 style).
      {false, "<think>\nhmm\n</think>\n\nHi!", "hmm", "Hi!"},
      {false, "  <think>x</think>y", "x", "y"},
      // Thinking off: everything is content, untouched.
      {false, "Hello </think> world\n", "", "Hello </think> world\n"},
      {false, "<thin", "", "<thin"},
      // Only the first </think> closes; later tags are content.
      {true, "a</think>b</think>c", "a", "b</think>c"},
      {true, "  \n</think>\n\n  answer  ", "", "answer  "},
      {true, "r1 <thi nk> r2</think>", "r1 <thi nk> r2", ""},
  };
  for (const auto& c : cases) {
    auto once = ReasoningParser::parse(c.text, c.start_in);
    EXPECT_EQ(once.reasoning, c.reasoning) << c.text;
    EXPECT_EQ(once.content, c.content) << c.text;
    for (const auto& pieces : splits_of(c.text)) {
      auto d = run_reasoning(c.start_in, pieces);
      ASSERT_EQ(d.reasoning, c.reasoning) << c.text;
      ASSERT_EQ(d.content, c.content) << c.text;
    }
  }
}

TEST(Reasoning, StreamsReasoningBeforeTheEnd) {
  ReasoningParser p(true);
  auto d1 = p.push("First idea");
  EXPECT_EQ(d1.reasoning, "First idea");
  auto d2 = p.push(", second idea\n</thi");
  EXPECT_EQ(d2.reasoning, ", second idea");
  auto d3 = p.push("nk>\n\nDone");
  EXPECT_EQ(d3.reasoning, "");
  EXPECT_EQ(d3.content, "Done");
}

// --- tool calls ---

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
