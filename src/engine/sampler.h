// Per-request token sampling over one step's fp32 logits.
//
// Order of operations (HF / vLLM conventions):
//   0. logit_bias added to the raw logits (OpenAI);
//   1. penalties on the raw logits: repetition_penalty over prompt + generated ids (HF / vLLM: a positive
//      logit is divided by the penalty, a negative one multiplied); frequency_penalty * count and
//      presence_penalty * [count > 0] subtracted over generated ids only (OpenAI semantics);
//   2. temperature 0: greedy argmax (ties: lowest id); otherwise logits / temperature;
//   3. top-k (keeps every token whose logit ties the k-th largest), top-p (smallest prefix of the sorted
//      distribution whose mass reaches p; the crossing token is kept), min-p (drops tokens whose probability is
//      below min_p x the largest), each on the temperature-scaled distribution, in that order (HF's warpers);
//   4. one draw from the renormalised survivors with the sequence's own xoshiro256** generator (seeded by
//      splitmix64 from `seed`; uniform doubles from the top 53 bits), walking tokens in ascending id.
//   Steps 2-4 are model::sample_row_host's (model/sampling.h, the exact definition), which the GPU's
//   Ops::sample_rows follows: the engine samples rows there when no sequence of a step needs penalties or logprobs.
// Reported logprobs (the chosen token's and the top-N alternatives) are the log-softmax of the penalised,
// temperature-scaled logits BEFORE top-k / top-p / min-p (vLLM's "processed" logprobs; temperature 0 counts as

#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "engine/grammar/token_mask.h"
#include "engine/request.h"
#include "model/sampling.h"

namespace kiln::engine {

struct SampleResult {
  int32_t token = -1;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;  // top_logprobs entries, highest first (ties: lower id first)
};

// xoshiro256** (Blackman & Vigna), seeded through splitmix64: same seed, same stream on every platform.
class Xoshiro256 {
 public:
  explicit Xoshiro256(uint64_t seed);
  uint64_t next();
  double uniform();  // [0, 1), 53 random bits

 private:
  uint64_t s_[4];
};

class SequenceSampler {
 public:
  SequenceSampler(const SamplingParams& params, uint64_t seed);  // seed: params.seed or a random one from the caller
  // logits: [vocab] fp32 (modified in place). history: prompt + generated ids; generated ids start at
  // generated_begin. top_logprobs: how many alternatives to report (0: none). want_logprob: fill
  // SampleResult::logprob (false skips a pass over the vocabulary; the token is the same either way).
  SampleResult sample(std::span<float> logits, std::span<const int32_t> history, size_t generated_begin,
                      int top_logprobs, bool want_logprob = true);

  // The parameters and the uniform of the next draw for a device that samples this sequence's row itself
  // (model::sample_row_host semantics: steps 2-4 above). Only valid without penalties and logprobs. A non-greedy
  // row takes the one rng_.uniform() that sample() would have drawn, so the sequence's random stream stays the one
  // of host sampling; a greedy row draws nothing (u = 0).
  model::RowSampling next_row_sampling();

  const SamplingParams& params() const { return params_; }

  // Grammar constraint (engine/grammar). stop_ids: the tokens that may end the sequence (allowed only where
  // the grammar accepts). While it is active, sample() masks the logits, forces a stop token when nothing
  // else fits, and advances the grammar over the chosen token; before it is active (reasoning), sample()
  // only watches for the start token.
  void set_constraint(std::shared_ptr<const grammar::Constraint> constraint, std::vector<int32_t> stop_ids);
  // The next token must be sampled on the host with the mask.
  bool constrained_now() const { return matcher_ != nullptr && constraint_active_; }
  // The grammar took a stop token: the sequence is complete.
  bool constraint_finished() const { return matcher_ && (matcher_->finished() || forced_end_); }
  // A token chosen without sample() (the device picked it): starts the constraint on its start token.
  void observe(int32_t token);

 private:
  SampleResult sample_free(std::span<float> logits, std::span<const int32_t> history, size_t generated_begin,
                           int top_logprobs, bool want_logprob);

  SamplingParams params_;
  Xoshiro256 rng_;
  std::vector<int32_t> order_;   // scratch: token ids sorted by logit (top_logprobs)
  model::SampleScratch scratch_; // scratch of the filters and the draw
  std::vector<int32_t> counts_;  // scratch: generated-token counts
  std::unique_ptr<grammar::Matcher> matcher_;
  std::vector<int32_t> stop_ids_;
  int32_t constraint_start_token_ = -1;
  bool constraint_active_ = false;
  bool forced_end_ = false;
};

}  // namespace kiln::engine
