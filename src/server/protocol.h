// OpenAI request bodies -> validated kiln requests. Every wrong value throws ApiError (400) naming the
// parameter, so nothing malformed reaches the engine.
#pragma once
#include <nlohmann/json.hpp>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "engine/request.h"

namespace kiln::server {

using ojson = nlohmann::ordered_json;

// Limits and defaults the validation needs from the running server.
struct ProtocolLimits {
  // Token ids a request may name: [0, vocab_size). The tokenizer's vocabulary, not the embedding's rows: the rows
  // past it are padding (empty tokens) that no request may ask for.
  int64_t vocab_size = 0;
  int max_n = 64;
  int max_top_logprobs = 20;
  int max_stop_strings = 16;
  engine::SamplingParams default_sampling;  // from the model's generation_config.json, else OpenAI's
  int max_images = 16;  // image parts per request (--limit-mm-per-prompt image=N); 0: the model reads no images
};

// An image a chat request names (an OpenAI image_url part; the Messages and Responses bodies translate theirs into
// one), in prompt order; prepare_chat reads, decodes and preprocesses it.
struct ImageRef {
  std::string url;    // data: URL, file path / file:// URL, or http(s) URL (media/image_source.h decides)
  std::string where;  // the request field, for errors: "messages[1].content[0]"
};

// What chat and text completions share.
struct GenerationFields {
  std::optional<std::string> model;
  engine::SamplingParams sampling;
  std::optional<int64_t> max_tokens;  // absent: up to the context length
  int64_t min_tokens = 0;             // SGLang / vLLM: eos and stop tokens cannot end the output before this many
  int n = 1;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  bool stream = false;
  bool include_usage = false;           // stream_options.include_usage
  bool continuous_usage_stats = false;  // stream_options.continuous_usage_stats
  bool logprobs = false;
  int top_logprobs = 0;
  bool skip_special_tokens = true;
  ojson response_format;  // null or {type: text | json_object | json_schema, ...} (checked by structured_output)
  // SGLang's constrained-decoding fields: the whole output matches a regular expression / an EBNF grammar
  // (GBNF-style, root rule "root"). At most one of response_format (json), regex, ebnf.
  std::optional<std::string> regex;
  std::optional<std::string> ebnf;
  // Set by the server from response_format / tool_choice (server/structured_output.h): the engine's grammar.
  std::shared_ptr<const grammar::Constraint> constraint;
};

struct ChatRequest : GenerationFields {
  // messages (text parts joined; a message with images keeps its parts as the template's items: {type: text, text}
  // and {type: image}), tools, chat_template_kwargs, add_generation_prompt
  ojson template_input;
  std::vector<ImageRef> images;  // the image parts of the messages, in order
  ojson tools;           // null when none
  bool tool_choice_none = false;
  ojson tool_choice;                // null, "none" / "auto" / "required", or {type: function, function: {name}}
  bool parallel_tool_calls = true;  // false: at most one tool call per choice (later ones are dropped)
  bool separate_reasoning = true;
  bool stream_reasoning = true;     // false: streamed reasoning_content comes in one piece when it ends
  std::optional<bool> enable_thinking;  // chat_template_kwargs.enable_thinking (or reasoning_effort none / minimal)
  // vLLM's assistant prefill: the last message is an assistant turn rendered without its end of turn, and the
  // output continues it (template_input carries continue_final_message, add_generation_prompt false).
  bool continue_final_message = false;
};

// One prompt of a completion request: text, or token ids.
using CompletionPrompt = std::variant<std::string, std::vector<int32_t>>;

struct CompletionRequest : GenerationFields {
  std::vector<CompletionPrompt> prompts;  // a list of prompts gives n choices per prompt, in order
  bool echo = false;
};

// Parses the body (malformed JSON is a 400 too).
ChatRequest parse_chat_request(std::string_view body, const ProtocolLimits& limits);
// The same from a parsed body (the Anthropic Messages and Responses routes translate their bodies into this one).
ChatRequest parse_chat_body(const ojson& body, const ProtocolLimits& limits);
CompletionRequest parse_completion_request(std::string_view body, const ProtocolLimits& limits);

// Parses a JSON body that must be an object (400 otherwise, saying where UTF-8 or JSON goes wrong).
ojson parse_json_object(std::string_view body);

}  // namespace kiln::server
