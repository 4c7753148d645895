// Splits generated text into reasoning and answer, incrementally (--reasoning-parser qwen3).
//
// Qwen3.5's chat template opens the think block in the prompt ("<think>\n"), so the model emits
// reasoning, "</think>", then the answer; Qwen3-style models may also open it themselves with a
// leading "<think>". Rules (the same whether the text arrives at once or in pieces cut anywhere,
// even inside a tag):
//  - in a think block, everything before the first "</think>" is reasoning; the tag is dropped.
//    "<tool_call>" also ends the block (Qwen3.5 sometimes calls a tool without closing it) and stays
//    in the answer text, for the tool-call parser;
//  - reasoning is trimmed of leading and trailing whitespace, the answer of leading whitespace (the
//    "\n\n" after "</think>");
//  - a generation that ends inside the block is all reasoning, with an empty answer;
//  - outside a think block (thinking switched off: the prompt already closed it) all text is answer,
//    untouched.
#pragma once
#include <string>
#include <string_view>

#include "server/text_util.h"

namespace kiln::server {

class ReasoningParser {
 public:
  // start_in_reasoning: the prompt ends inside a think block. Otherwise a "<think>" at the very
  // start of the output (after whitespace) opens one.
  explicit ReasoningParser(bool start_in_reasoning);

  struct Delta {
    std::string reasoning;
    std::string content;
  };
  Delta push(std::string_view text);
  Delta finish();
  // Whether the text pushed so far leaves the parser inside the think block.
  bool in_reasoning() const { return state_ == State::reasoning; }

  // One-shot form of the same rules.
  static Delta parse(std::string_view text, bool start_in_reasoning);

 private:
  enum class State { start, reasoning, content_after_think, content };
  void run(Delta& out, bool at_end);

  State state_;
  std::string buf_;
  WhitespaceTrimmer reasoning_trim_;
  bool content_started_ = false;
};

}  // namespace kiln::server
