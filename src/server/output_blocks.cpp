#include "server/output_blocks.h"

namespace kiln::server {

namespace {
bool all_space(const std::string& s) { return s.find_first_not_of(" \t\r\n") == std::string::npos; }
}  // namespace

void OutputBlocks::open(BlockKind kind, int tool_index, const std::string& name, std::vector<BlockEvent>& out) {
  close(out);
  is_open_ = true;
  kind_ = kind;
  tool_index_ = tool_index;
  index_ = next_index_++;
  out.push_back({.op = BlockEvent::open, .kind = kind, .index = index_, .tool_index = tool_index, .name = name});
}

void OutputBlocks::close(std::vector<BlockEvent>& out) {
  if (!is_open_) return;
  is_open_ = false;
  out.push_back({.op = BlockEvent::close, .kind = kind_, .index = index_, .tool_index = tool_index_});
}

void OutputBlocks::append(BlockKind kind, const std::string& text, std::vector<BlockEvent>& out) {
  if (text.empty()) return;
  out.push_back({.op = BlockEvent::append, .kind = kind, .index = index_, .tool_index = tool_index_, .text = text});
}

std::vector<BlockEvent> OutputBlocks::push(const ChoiceDelta& delta) {
  std::vector<BlockEvent> out;
  if (!delta.reasoning.empty()) {
    if (!is_open_ || kind_ != BlockKind::reasoning) open(BlockKind::reasoning, -1, "", out);
    append(BlockKind::reasoning, delta.reasoning, out);
  }
  if (!delta.content.empty()) {
    if (is_open_ && kind_ == BlockKind::text) {
      append(BlockKind::text, delta.content, out);
    } else if (all_space(held_space_ + delta.content)) {
      held_space_ += delta.content;
    } else {
      std::string text = held_space_ + delta.content;
      held_space_.clear();
      open(BlockKind::text, -1, "", out);
      append(BlockKind::text, text, out);
    }
  }
  for (const ToolCallPiece& p : delta.tool_calls) {
    if (!is_open_ || kind_ != BlockKind::tool_call || tool_index_ != p.index) {
      held_space_.clear();
      open(BlockKind::tool_call, p.index, p.name, out);
    }
    append(BlockKind::tool_call, p.arguments, out);
  }
  return out;
}

std::vector<BlockEvent> OutputBlocks::finish() {
  std::vector<BlockEvent> out;
  held_space_.clear();
  close(out);
  return out;
}

}  // namespace kiln::server
