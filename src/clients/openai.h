// OpenAI-compatible generation requests as kiln's clients send them (chat and raw completions),
// and what came back, streamed or not, with the arrival time of every streamed piece.
//
// Reasoning arrives as `reasoning_content` (SGLang, kiln) or `reasoning` (vLLM); both are read.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "clients/http.h"

namespace kiln::clients {

struct GenerationParams {
  int max_tokens = 256;
  double temperature = 0.0;
  std::optional<bool> enable_thinking;  // sent as chat_template_kwargs.enable_thinking when set
  bool ignore_eos = false;              // sent only when true
  bool stream = false;                  // streamed requests also ask for usage (stream_options)
  std::optional<int64_t> seed;
  // Sent as skip_special_tokens when set (SGLang / vLLM / kiln extension): false keeps end-of-turn
  // tokens in the text, so a client can tell the answer from what ignore_eos generated after it.
  std::optional<bool> skip_special_tokens;
};

// POST /v1/chat/completions body with one user message.
nlohmann::json chat_request(const std::string& model, const std::string& user_message, const GenerationParams& params);
// POST /v1/completions body with a raw prompt.
nlohmann::json completion_request(const std::string& model, const std::string& prompt, const GenerationParams& params);

struct Generation {
  bool ok = false;
  std::string error;  // why it failed: HTTP status + the server's message, transport error, bad JSON

  std::string content;          // message.content / delta.content / text (completions)
  std::string reasoning;        // reasoning_content or reasoning
  std::string reasoning_field;  // which name the server used ("" if neither carried text)
  bool content_null = false;    // non-streamed: message.content was null
  std::string finish_reason;
  std::optional<int64_t> prompt_tokens;      // usage, when the server sent it
  std::optional<int64_t> completion_tokens;  // usage, when the server sent it
  std::optional<int64_t> cached_tokens;      // usage.prompt_tokens_details.cached_tokens, when sent

  // Streamed requests only. Times are seconds since the request was sent.
  double e2e_s = 0;                   // until the stream ended
  std::vector<double> token_times_s;  // arrival of each chunk that carried text (content or reasoning)
  bool saw_done = false;              // "data: [DONE]" arrived
};

// Parses a non-streamed chat or completions response body.
Generation parse_generation_response(const std::string& body);

// Folds streamed chunks (the JSON of each SSE event) into a Generation.
class StreamAccumulator {
 public:
  // Takes one event's data at `seconds` since the request was sent. Returns false when the stream
  // reported an error or a chunk was not valid JSON (the generation then holds the error).
  bool add_event(std::string_view data, double seconds);
  // Finishes: checks the stream ended properly. Returns the result.
  Generation finish(double e2e_s);

 private:
  Generation generation_;
  bool failed_ = false;
};

// Sends body to path (streamed when body["stream"] is true) and collects the answer.
// Never throws for server-side problems: they come back as ok=false with the reason.
Generation run_generation(HttpClient& client, const std::string& path, const nlohmann::json& body);

// The model name to send: the first id of GET /v1/models; else "default". Servers that serve one
// model (SGLang, llama-server, kiln) accept any name, vLLM needs the right one.
std::string discover_model_name(HttpClient& client);

}  // namespace kiln::clients
