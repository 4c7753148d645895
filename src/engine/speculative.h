// Speculative decoding's acceptance rules: what a verify pass over [pending token, d_1 .. d_K] turns into, per
// sequence. Host maths only (no runner): the engine's speculative step drafts with the model's MTP head
// (model::ModelRunner::draft), verifies K + 1 positions in one pass (SeqChunk::logits_tokens), applies these rules,
// then restores the recurrent state and runs the accepted tokens again when a draft was rejected
// (ModelRunner::save_state / restore_state).
//
// Greedy: accept while d_j equals the target's argmax after position j - 1, then emit the target's own token there
// (the correction, or the bonus token after all K): the output is token for token the target's greedy output.
// Sampling: speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023): accept d_j with probability
// min(1, p_j(d_j) / q_j(d_j)); on a reject draw from normalise(max(0, p_j - q_j)) and stop; all accepted: a bonus
// draw from p_K. The emitted tokens are distributed exactly as the target's own samples. A greedy drafter (the MTP
// chain takes its argmax) is the case q_j = one-hot(d_j).
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace kiln::engine {

// The tokens to emit (1 .. K + 1): the accepted drafts, then the target's token at the first mismatch (or after the
// last draft). target_argmax [K + 1]: the target's greedy token after each verified position.
std::vector<int32_t> accept_greedy(std::span<const int32_t> drafts, std::span<const int32_t> target_argmax);

struct SampledAccept {
  std::vector<int32_t> tokens;  // accepted drafts, then the resampled / bonus token
  int accepted = 0;             // drafts accepted (tokens.size() - 1)
};

// Rejection sampling. drafts [K]; target_probs [(K + 1) x V] (row j: the target's distribution after position j of
// the verify pass, after temperature / top-k / top-p as the sampler applies them); draft_probs [K x V] or empty for
// a greedy drafter (q_j = one-hot(d_j)); uniform() draws in [0, 1). Rows need not be normalised (they are
// divided by their sums).
SampledAccept accept_sampled(std::span<const int32_t> drafts, std::span<const float> target_probs,
                             std::span<const float> draft_probs, int64_t vocab, const std::function<double()>& uniform);

// Draws an index of the (unnormalised, non-negative) weights w with the uniform u in [0, 1); the last positive
// index when rounding leaves u past the total; -1 when no weight is positive.
int32_t draw_index(std::span<const double> w, double u);

}  // namespace kiln::engine
