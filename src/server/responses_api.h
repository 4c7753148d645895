// The OpenAI Responses API (POST /v1/responses) over the chat path.
//
// A Responses body is translated into an OpenAI chat body and parsed by protocol.h, so the chat template, the
// answer grammar and the output parsers are the chat route's own:
//   instructions                                  -> a system message (not carried to later turns)
//   input: a string                               -> a user message
//   input items: message {role, content: string | input_text / output_text parts}
//                function_call {call_id, name, arguments}    -> the assistant's tool_calls
//                function_call_output {call_id, output}     -> a tool message
//                reasoning {content / summary text}         -> the next assistant message's reasoning_content
//   tools [{type: function, name, description, parameters, strict}], tool_choice (auto | none | required |
//   {type: function, name}), parallel_tool_calls, max_output_tokens, temperature, top_p, text.format
//   (text | json_object | json_schema {name, schema, strict}), reasoning.effort (none / minimal: thinking off)
//   previous_response_id: the stored conversation of that response comes first (404 when unknown or expired);
//   store (default true): the conversation including this response is kept (server/response_store.h).
// metadata, user, include, prompt_cache_key, safety_identifier, service_tier, truncation and text.verbosity are
// accepted and ignored; other fields, other tool types and image / file inputs are a 400.
// ResponsesJob renders the output items (reasoning, message with output_text, function_call), usage (input_tokens
// with input_tokens_details.cached_tokens, output_tokens with output_tokens_details.reasoning_tokens), status
// (completed, or incomplete with reason max_output_tokens), and the event stream: response.created,
// response.in_progress, response.output_item.added / .done, response.content_part.added / .done,
// response.reasoning_text.delta / .done, response.output_text.delta / .done,
// response.function_call_arguments.delta / .done, response.completed (or .incomplete / .failed).
#pragma once
#include <optional>
#include <string>

#include "server/output_blocks.h"
#include "server/protocol.h"
#include "server/response.h"
#include "server/response_store.h"

namespace kiln::server {

struct ResponsesRequest {
  ChatRequest chat;
  ojson conversation;                          // the chat messages without the instructions (for the store)
  std::optional<std::string> previous_response_id;
  bool store = true;
  nlohmann::json echo;                         // request fields the response object repeats
};

// previous: the stored conversation of previous_response_id (null when none). Errors are ApiErrors (400).
ResponsesRequest parse_responses_request(const ojson& body, const ProtocolLimits& limits, const ojson& previous);

struct ResponsesJob : GenerationJob {
  ResponseStore* store = nullptr;  // null: not stored
  ojson conversation;
  nlohmann::json echo;
  std::optional<std::string> previous_response_id;

  std::string stream_prologue() override;
  std::string stream_events(std::vector<ChoiceDelta>& deltas) override;
  nlohmann::json final_response() override;

  // The response object: status "in_progress" until the choice finished.
  nlohmann::json response_object(nlohmann::json output) const;
  // The response's status: in_progress, completed, incomplete (max_output_tokens) or failed (an error, a shutdown).
  const char* status_word() const;
  nlohmann::json responses_usage() const;

 private:
  std::string event(const std::string& type, nlohmann::json data);
  std::string block_event(const BlockEvent& e);
  std::string finish_events();
  void keep(const nlohmann::json& response);  // into the store, with the conversation so far

  OutputBlocks blocks_;
  std::vector<nlohmann::json> items_;  // streamed: the output items as they stand
  std::vector<std::string> texts_;     // streamed: each item's text (reasoning, output_text, arguments)
  // The status a message or function call item gets when its block closes: "completed", or, for the blocks the
  // response's end closes when the response itself did not complete (max_output_tokens, a shutdown), "incomplete".
  std::string closing_status_ = "completed";
  int64_t sequence_ = 0;
};

}  // namespace kiln::server
