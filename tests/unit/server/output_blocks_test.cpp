// OutputBlocks (src/server/output_blocks.cpp): deltas into typed blocks, opened and closed in order; whitespace
// between blocks never opens a text block.
#include "server/output_blocks.h"

#include <gtest/gtest.h>

#include <string>

namespace kiln::server {
namespace {

// A compact trace: "open:reasoning#0", "+reasoning#0:text", "close:reasoning#0", ...
std::string trace(const std::vector<BlockEvent>& events) {
  std::string out;
  for (const auto& e : events) {
    const char* kind = e.kind == BlockKind::reasoning ? "reasoning" : e.kind == BlockKind::text ? "text" : "tool";
    if (!out.empty()) out += " ";
    if (e.op == BlockEvent::open) out += std::string("open:") + kind + "#" + std::to_string(e.index) + (e.name.empty() ? "" : "(" + e.name + ")");
    else if (e.op == BlockEvent::close) out += std::string("close:") + kind + "#" + std::to_string(e.index);
    else out += std::string("+") + kind + "#" + std::to_string(e.index) + ":" + e.text;
  }
  return out;
}

ChoiceDelta reasoning(const std::string& s) {
  ChoiceDelta d;
  d.reasoning = s;
  return d;
}
ChoiceDelta content(const std::string& s) {
  ChoiceDelta d;
  d.content = s;
  return d;
}
ChoiceDelta call(int index, const std::string& name, const std::string& args) {
  ChoiceDelta d;
  d.tool_calls.push_back({index, name, args});
  return d;
}

TEST(OutputBlocks, ReasoningTextAndCallsInOrder) {
  OutputBlocks b;
  std::string t;
  t += trace(b.push(reasoning("think"))) + " | ";
  t += trace(b.push(reasoning("ing"))) + " | ";
  t += trace(b.push(content("Hi"))) + " | ";
  t += trace(b.push(call(0, "f", "{\"a\":"))) + " | ";
  t += trace(b.push(call(0, "", "1}"))) + " | ";
  t += trace(b.push(call(1, "g", "{}"))) + " | ";
  t += trace(b.finish());
  EXPECT_EQ(t,
            "open:reasoning#0 +reasoning#0:think | +reasoning#0:ing | close:reasoning#0 open:text#1 +text#1:Hi | "
            "close:text#1 open:tool#2(f) +tool#2:{\"a\": | +tool#2:1} | close:tool#2 open:tool#3(g) +tool#3:{} | "
            "close:tool#3");
  EXPECT_EQ(b.blocks_opened(), 4);
}

TEST(OutputBlocks, WhitespaceIsHeldUntilTextFollows) {
  OutputBlocks b;
  std::string t;
  t += trace(b.push(reasoning("r"))) + " | ";
  t += trace(b.push(content("\n\n"))) + " | ";
  t += trace(b.push(content("A"))) + " | ";
  t += trace(b.push(content(" "))) + " | ";
  EXPECT_EQ(t, "open:reasoning#0 +reasoning#0:r |  | close:reasoning#0 open:text#1 +text#1:\n\nA | +text#1:  | ");
  // Whitespace before a call opens nothing.
  OutputBlocks c;
  std::string u = trace(c.push(content("\n"))) + " | ";
  u += trace(c.push(call(0, "f", "{}"))) + " | ";
  u += trace(c.finish());
  EXPECT_EQ(u, " | open:tool#0(f) +tool#0:{} | close:tool#0");
}

TEST(OutputBlocks, FinishWithNothingOpenIsEmpty) {
  OutputBlocks b;
  EXPECT_TRUE(b.push(content("  ")).empty());
  EXPECT_TRUE(b.finish().empty());
  EXPECT_EQ(b.blocks_opened(), 0);
}

}  // namespace
}  // namespace kiln::server
