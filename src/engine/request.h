// What a client asks the engine for, and what comes back. Plain host types: no HTTP, no JSON.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kiln::grammar {
struct Constraint;  // engine/grammar/token_mask.h
}

namespace kiln::engine {

struct SamplingParams {
  float temperature = 1.0f;      // 0 = greedy
  float top_p = 1.0f;
  int top_k = 0;                 // 0 = off
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::optional<uint64_t> seed;  // same seed, same output
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, bias) added to the raw logits (OpenAI)
};

enum class FinishReason { none, stop, length, abort, error };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "abort", "error"

// One image of a prompt, preprocessed (the model's image processor: patches in transformers' layout). Its
// placeholder run is prompt[offset, offset + tokens) with tokens = grid_t * grid_h * grid_w / merge^2 (the vision
// encoder's merged patches); the engine encodes it with the runner's vision tower when it takes the request.
struct ImageInput {
  int64_t offset = 0;                 // index of the first placeholder token in the prompt
  int64_t grid_t = 1, grid_h = 0, grid_w = 0;  // patch grid (grid_thw), before the spatial merge
  std::vector<float> pixel_values;    // [grid_t * grid_h * grid_w, channels * temporal_patch * patch * patch]
  uint64_t hash = 0;                  // content hash of the decoded image: the prefix cache's key for its tokens
};

struct GenerateRequest {
  std::string id;
  std::vector<int32_t> prompt;
  std::vector<ImageInput> images;  // in prompt order, placeholder runs disjoint; empty for text
  SamplingParams sampling;
  int64_t max_tokens = 256;
  // SGLang / vLLM min_tokens: until this many tokens are generated, the eos and stop_token_ids tokens are masked out
  // of sampling (their logits -inf), so the output cannot end before it (max_tokens and the context still can).
  int64_t min_tokens = 0;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;  // besides the model's eos ids
  int top_logprobs = 0;                 // >0: report that many alternatives per token
  bool want_logprobs = false;
  // Grammar-constrained decoding (null: free). The sequence is sampled on the host with the grammar's token
  // mask (never by the device's argmax / sampling) once the constraint is active; the eos / stop tokens are
  // allowed only where the grammar accepts, and forced where nothing else fits.
  std::shared_ptr<const grammar::Constraint> constraint;
};

struct TokenLogprob {
  int32_t token;
  float logprob;
};

// One generated token (or the end of the stream).
struct TokenEvent {
  int index = 0;                       // which sequence of the submission (0..n-1, for n > 1)
  int32_t token = -1;                  // -1 on the final event when nothing new was generated
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;       // when top_logprobs > 0
  bool finished = false;
  FinishReason finish_reason = FinishReason::none;
  std::string error;                   // when finish_reason == error
  // The token ended the sequence as an eos / stop_token_ids match: counted as generated, but it is
  // not part of the visible text.
  bool is_stop_token = false;
  // Filled on the first event: timing in the engine.
  double queue_ms = 0.0;
  int64_t cached_tokens = 0;           // prompt tokens found in the prefix cache (not prefilled again)
};

}  // namespace kiln::engine
