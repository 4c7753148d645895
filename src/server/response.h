// OpenAI response rendering: one generation request in flight (its engine channel, per-choice
// outputs, timing) and the JSON it answers with: SSE chunks, the non-streamed body, logprobs, usage,
// and its request-log line. The routes drive it (generation.h); protocol.h parses the requests.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/channel.h"
#include "engine/request.h"
#include "server/api_error.h"
#include "server/choice_output.h"
#include "server/connection_probe.h"
#include "server/protocol.h"

namespace kiln::engine {
class Engine;
}

namespace kiln::server {

using Clock = std::chrono::steady_clock;
// How long a handler waits for engine events before it looks at the client's socket again.
inline constexpr auto kWaitSlice = std::chrono::milliseconds(200);

// The error a request gets when a shutdown that timed out aborted it (503 shutting_down): streamed as the last
// SSE event (no [DONE] follows), or the answer of a non-streamed request.
ApiError shutdown_abort_error();

// JSON text as sent (invalid UTF-8 replaced, never thrown on).
std::string dump_json(const nlohmann::json& j);
std::string random_hex(size_t n);
int64_t unix_now();

// Shared by the handler and, for streamed responses, the chunked content provider that outlives it.
// The OpenAI rendering is the default; the Anthropic Messages and Responses jobs override the virtual methods.
struct GenerationJob {
  std::atomic<int>* active = nullptr;  // the server's count of requests in flight
  virtual ~GenerationJob();

  bool chat = true;
  std::vector<engine::ImageInput> images;  // the prompt's images (chat; one prompt), handed to every choice's request
  std::string id;
  std::string request_id;  // the client's X-Request-Id (sanitised), else id: the X-Request-Id answered and logged
  std::string endpoint;
  int64_t created = 0;
  std::string model_name;
  GenerationFields fields;
  int64_t prompt_tokens = 0;
  std::vector<std::string> echo_texts;  // completions with echo, per choice: its prompt's text, shown first
  bool stream_reasoning = true;          // false: streamed reasoning_content comes in one piece when it ends
  std::shared_ptr<engine::RequestChannel> channel;
  std::vector<ChoiceOutput> choices;
  const tok::Tokenizer* tokenizer = nullptr;
  std::string call_id_prefix = "call_";  // tool-call ids: prefix + random hex (Anthropic's are "toolu_")

  // A thinking budget (Anthropic budget_tokens; one choice): once choice 0 has generated this many reasoning
  // tokens and is still inside its think block, its sequence is stopped and a new one continues from the prompt,
  // the tokens so far and think_close (the block closed): the answer follows within the same max_tokens.
  int64_t reasoning_budget = -1;
  std::string think_close = "\n</think>\n\n";
  engine::Engine* engine = nullptr;       // set by the generation driver when there is a budget
  engine::GenerateRequest submitted;      // choice 0's request as submitted (the continuation's template)
  std::vector<int32_t> generated;         // choice 0's tokens so far
  bool budget_spent = false;

  // Per choice: accumulated output (non-streamed), pending logprobs (streamed), tool-call ids.
  struct Accum {
    std::string reasoning, content;
    struct Call {
      std::string id, name, arguments;
    };
    std::vector<Call> calls;
    std::vector<LogprobEntry> logprobs;   // all (non-streamed) or not yet sent (streamed)
    int64_t text_offset = 0;              // completions logprobs: offset of the next token's text
    std::string held_reasoning;           // streamed with stream_reasoning false: reasoning not yet sent
    bool finish_sent = false;
  };
  std::vector<Accum> acc;

  Clock::time_point start = Clock::now();
  Clock::time_point first_token{};
  bool got_first_token = false;
  double queue_ms = 0.0;
  int64_t cached_tokens = 0;  // prompt tokens served from the prefix cache (first choice)
  ConnectionProbe probe;
  Clock::time_point last_probe = Clock::now();
  // Whether it is time to look at the client's socket again (a few times a second).
  bool probe_due();
  bool started = false;
  bool done = false;
  bool client_gone = false;
  int status = 200;

  bool all_finished() const;

  // Feeds engine events into the choices; returns the new deltas per choice.
  std::vector<ChoiceDelta> absorb(const std::vector<engine::TokenEvent>& events);
  // The thinking budget is spent: stop the sequence, close the think block, continue with the answer.
  bool budget_due() const;
  void close_reasoning(ChoiceDelta& delta);

  int64_t completion_tokens() const {
    int64_t n = 0;
    for (const auto& c : choices) n += c.completion_tokens();
    return n;
  }

  nlohmann::json usage() const;

  std::string token_text(int32_t id) const;

  static nlohmann::json bytes_of(const std::string& s);

  // OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}.
  nlohmann::json chat_logprobs(const std::vector<LogprobEntry>& entries) const;

  // OpenAI completions logprobs: {tokens, token_logprobs, top_logprobs, text_offset}.
  nlohmann::json completion_logprobs(const std::vector<LogprobEntry>& entries, int64_t* text_offset) const;

  nlohmann::json chunk_base() const;

  // One SSE event.
  std::string sse(const nlohmann::json& j) const;

  nlohmann::json with_usage(nlohmann::json chunk) const;

  // A streamed chat chunk for one choice.
  std::string chat_chunk(int index, nlohmann::json delta, nlohmann::json finish_reason, nlohmann::json matched_stop,
                         bool attach_logprobs);

  std::string completion_chunk(int index, const std::string& text, nlohmann::json finish_reason,
                               nlohmann::json matched_stop);

  // The SSE text for the first call: role deltas (chat) or the echoed prompt (completions).
  virtual std::string stream_prologue();

  // SSE text for new deltas, finish chunks, and (when everything ended) usage and [DONE].
  virtual std::string stream_events(std::vector<ChoiceDelta>& deltas);

  // The whole response body of a non-streamed request (all choices finished).
  virtual nlohmann::json final_response();

  void accumulate_text(const std::vector<ChoiceDelta>& deltas);

  std::string finish_summary() const;
  const std::string& echo_of(size_t choice) const;
  std::string dropped_tool_calls() const;

  void log_line() const;
};

}  // namespace kiln::server
