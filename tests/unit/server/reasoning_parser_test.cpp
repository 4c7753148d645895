// The reasoning split at </think>: checked on the whole text and cut into pieces everywhere; the results
// must agree and match the expected values written from the format's definition.
#include <gtest/gtest.h>

#include "server/reasoning_parser.h"
#include "split_points.h"

namespace kiln::server {
namespace {

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

}  // namespace
}  // namespace kiln::server
