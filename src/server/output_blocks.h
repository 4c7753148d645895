// A choice's output as a sequence of typed blocks (reasoning, text, one per tool call) in the order the model
// wrote them, for the APIs whose streams open and close blocks: Anthropic content blocks, Responses output items.
// Text that is only whitespace is held until text that is not arrives (a block of whitespace between the
// reasoning and a tool call is never opened).
#pragma once
#include <string>
#include <vector>

#include "server/choice_output.h"

namespace kiln::server {

enum class BlockKind { reasoning, text, tool_call };

struct BlockEvent {
  enum Op { open, append, close } op = append;
  BlockKind kind = BlockKind::text;
  int index = 0;          // the block's position in the output (0, 1, ...)
  int tool_index = -1;    // tool_call: the call's index in the choice (GenerationJob::Accum::calls)
  std::string name;       // tool_call open: the function
  std::string text;       // append: reasoning / text, or a piece of a call's JSON arguments
};

class OutputBlocks {
 public:
  // The block events a delta makes: a block opens when output of another kind (or a new call) starts, and the
  // block before it closes.
  std::vector<BlockEvent> push(const ChoiceDelta& delta);
  // Closes the open block (held whitespace is dropped).
  std::vector<BlockEvent> finish();
  int blocks_opened() const { return next_index_; }

 private:
  void open(BlockKind kind, int tool_index, const std::string& name, std::vector<BlockEvent>& out);
  void close(std::vector<BlockEvent>& out);
  void append(BlockKind kind, const std::string& text, std::vector<BlockEvent>& out);

  bool is_open_ = false;
  BlockKind kind_ = BlockKind::text;
  int tool_index_ = -1;
  int index_ = -1;
  int next_index_ = 0;
  std::string held_space_;  // whitespace-only text not shown yet
};

}  // namespace kiln::server
