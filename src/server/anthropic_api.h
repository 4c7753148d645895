// The Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) over the chat path.
//
// A Messages body is translated into an OpenAI chat body and parsed by protocol.h, so the chat template, the
// answer grammar (tool_choice any / tool as OpenAI's required / named, strict tools) and the output parsers are
// the chat route's own:
//   system (string or text blocks)        -> a system message
//   text blocks                           -> message content (joined with newlines)
//   tool_use {id, name, input}            -> the assistant's tool_calls
//   tool_result {tool_use_id, content}    -> a tool message (is_error: the content is prefixed "Error: ")
//   thinking {thinking}                   -> the assistant's reasoning_content
//   tools [{name, description, input_schema}], tool_choice {auto | any | tool {name} | none,
//   disable_parallel_tool_use}, stop_sequences, temperature (0..1), top_p, top_k, max_tokens, stream
//   thinking {type: enabled, budget_tokens}: the template's thinking on (off when absent or disabled);
//   budget_tokens caps the reasoning: at the cap the sequence is stopped and continued from its tokens plus
//   "</think>" (GenerationJob::close_reasoning), so the answer follows within the same max_tokens.
// metadata and service_tier are accepted and ignored; other fields, images and documents are a 400.
// AnthropicJob renders the output: content blocks (thinking, text, tool_use), stop_reason (end_turn,
// max_tokens, stop_sequence, tool_use), usage (input_tokens excludes the prompt tokens read from the prefix
// cache, which are cache_read_input_tokens), and the event stream (message_start, ping, content_block_start /
// delta (thinking_delta, text_delta, input_json_delta) / stop, message_delta, message_stop; error events).
#pragma once
#include <optional>
#include <string_view>

#include "server/output_blocks.h"
#include "server/protocol.h"
#include "server/response.h"

namespace kiln::server {

struct MessagesRequest {
  ChatRequest chat;
  bool thinking = false;
  std::optional<int64_t> thinking_budget;  // budget_tokens
};

// count_only: /v1/messages/count_tokens (no max_tokens needed). Errors are ApiErrors (400) naming the field.
MessagesRequest parse_messages_request(const ojson& body, const ProtocolLimits& limits, bool count_only = false);

struct AnthropicJob : GenerationJob {
  AnthropicJob() { call_id_prefix = "toolu_"; }

  std::string stream_prologue() override;
  std::string stream_events(std::vector<ChoiceDelta>& deltas) override;
  nlohmann::json final_response() override;

  nlohmann::json anthropic_usage() const;
  // end_turn, max_tokens, stop_sequence or tool_use (choice 0).
  std::string stop_reason() const;
  nlohmann::json stop_sequence() const;

 private:
  std::string event(const char* name, const nlohmann::json& data) const;
  std::string message_start();
  std::string block_event(const BlockEvent& e);
  std::string finish_events();

  OutputBlocks blocks_;
  bool message_started_ = false;
};

}  // namespace kiln::server
