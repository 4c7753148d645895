// One choice's way from engine tokens to API text: incremental detokenisation, stop strings (never
// showing a partial one), reasoning split, tool-call parsing, logprobs and token counts. Streamed
// responses send each delta; non-streamed ones concatenate them, so both always agree.
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/request.h"
#include "server/reasoning_parser.h"
#include "server/stop_strings.h"
#include "server/tool_parser.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {

struct ChoiceOptions {
  std::vector<std::string> stop;
  bool skip_special_tokens = true;
  bool parse_reasoning = false;     // split reasoning_content from content
  bool start_in_reasoning = false;  // the prompt ends inside a think block
  bool parse_tool_calls = false;
  nlohmann::json tools;             // the request's tools (schemas for value conversion; calls of others are dropped)
  int max_tool_calls = -1;          // parallel_tool_calls false: 1 (later calls are dropped); -1: no limit
  bool want_logprobs = false;
};

struct LogprobEntry {
  int32_t token = -1;
  float logprob = 0.0f;
  std::vector<engine::TokenLogprob> top;
};

struct ChoiceDelta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCallPiece> tool_calls;
  std::vector<LogprobEntry> logprobs;  // the tokens that arrived since the last delta
  bool has_text() const { return !reasoning.empty() || !content.empty() || !tool_calls.empty(); }
};

class ChoiceOutput {
 public:
  ChoiceOutput(const tok::Tokenizer& tokenizer, ChoiceOptions options);

  // Feeds one engine event of this choice; appends what can be shown now to `delta`.
  void on_event(const engine::TokenEvent& ev, ChoiceDelta& delta);
  // Ends the choice as if the engine had (used when the request fails as a whole).
  void fail(const std::string& message, ChoiceDelta& delta);
  // Text the server put into the sequence (not generated: no token counted), read as if the model wrote it.
  void inject_text(std::string_view text, ChoiceDelta& delta) { feed(text, delta); }
  bool in_reasoning() const { return reasoning_ && reasoning_->in_reasoning(); }

  bool finished() const { return finished_; }
  // A stop string matched: the engine must be told to stop this sequence (once).
  bool take_cancel_request();
  // "stop", "length", "tool_calls", "abort" or "error"; null while running.
  nlohmann::json finish_reason_json() const;
  // The matched stop: the eos / stop token id or the stop string; null otherwise.
  nlohmann::json matched_stop_json() const { return num_tool_calls() > 0 ? nlohmann::json() : matched_stop_; }
  const std::string& error() const { return error_; }
  engine::FinishReason engine_reason() const { return reason_; }
  int64_t completion_tokens() const { return completion_tokens_; }
  int64_t reasoning_tokens() const { return reasoning_tokens_; }
  int num_tool_calls() const { return tools_ ? tools_->num_calls() : 0; }
  // Tool calls the parser dropped (unknown function, over max_tool_calls): their names.
  std::vector<std::string> dropped_tool_calls() const { return tools_ ? tools_->dropped() : std::vector<std::string>{}; }

 private:
  void feed(std::string_view text, ChoiceDelta& delta);
  void pass_to_tools(std::string_view text, ChoiceDelta& delta);
  void finish_parsers(ChoiceDelta& delta);

  const tok::Tokenizer& tokenizer_;
  ChoiceOptions opts_;
  tok::StreamDecoder decoder_;
  StopStringMatcher stops_;
  std::optional<ReasoningParser> reasoning_;
  std::optional<ToolCallParser> tools_;
  bool finished_ = false;
  bool stop_matched_ = false;
  bool cancel_pending_ = false;
  engine::FinishReason reason_ = engine::FinishReason::none;
  nlohmann::json matched_stop_;
  std::string error_;
  int64_t completion_tokens_ = 0;
  int64_t reasoning_tokens_ = 0;
};

}  // namespace kiln::server
