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
//
// DraftLengthChooser: the adaptive draft length. Verifying K + 1 tokens per sequence pays off while a pass is
// memory-bound (small batches) and costs throughput once it is compute-bound (large batches; peers lose at
// concurrency 16). Instead of a constant crossover the engine times its steps and this class picks, per step, the K
// with the most expected tokens per second (model below); unit-tested with synthetic costs.
#pragma once
#include <array>
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

// Chooses the draft length K (0 .. max_k) of each decode step from measured costs.
//
// Measurements (seconds per power-of-two bucket: the median of its last kWindow observations, so that a few slow
// steps, such as one that captured a CUDA graph for a new shape, do not move it):
//   decode(b)  a plain decode pass of b sequences (one token each);
//   multi(n)   a pass of n tokens made of multi-token chunks (a verify pass: b x (K + 1); a replay);
//   draft(b)   one step of the draft chain for b sequences;
//   alpha_j    the chance that draft j is accepted given drafts 1 .. j - 1 were (decayed counts; prior 0.8).
// Model of a step of b sequences with K drafts:
//   accept length  L(K) = 1 + sum_{j=1..K} prod_{i<=j} alpha_i           (tokens per sequence per step)
//   seconds        T(b, 0) = decode(b)
//                  T(b, K) = multi(b (K + 1)) + (K - c) draft(b) + (1 - prod_{j<=K} alpha_j ^ b) multi(b L(K))
//   (c = 1 when the first draft is carried from the step before: set_carried_first; else 0)
//                  (the last term: restoring the recurrent state and replaying the accepted tokens, which a step
//                  needs as soon as one of its sequences rejected a draft; none with a runner's position
//                  checkpoints, set_replays(false): taking one is a state copy, inside the measured step)
//   choice         argmax_K b L(K) / T(b, K) (ties: the smaller K).
// A step that also runs prompt tokens (p of them): without drafts its decode rows ride the prompts' pass, with drafts
// the verify rows take a pass of their own (the recurrence keeps the position checkpoints; model::Runner::forward).
// So there T(b, 0) = multi(p + b) and T(b, K) = multi(p + b) + [T(b, K) above]: drafting adds a whole pass, which pays
// only where the prompts' pass is long against it. Such steps are not timed (a prompt would swamp the table), never
// explore, and need no measurement in the batch's bucket first.
// A cost never measured is estimated from the measured buckets of its table: linear between the nearest two, flat
// below the smallest, proportional to the tokens above the largest (but for the verify pass of a step without
// prompts: the largest one's cost, a lower bound, so that the length gets tried and measured); a multi-token pass
// with no measurement at all
// falls back to the decode table, and a draft with none costs 0 (so an engine starts by speculating and measures).
// Every `explore_period`-th choice for a batch bucket takes another K instead (each in turn), so that every
// length's costs keep being measured (a cost estimated from other buckets may be far off).
class DraftLengthChooser {
 public:
  static constexpr int kBuckets = 20;  // powers of two up to 2^19 tokens / sequences
  static constexpr int kMaxSteps = 8;

  static constexpr int kWindow = 9;    // observations per bucket behind its estimate (the median of the last ones)

  explicit DraftLengthChooser(int max_k, int explore_period = 64);

  int max_k() const { return max_k_; }
  void set_replays(bool replays) { replays_ = replays; }  // false: a rejected draft costs no replay pass
  // true: the first draft comes from the step before (ModelRunner::forward_argmax_carry), so K drafts cost K - 1
  // chain steps.
  void set_carried_first(bool carried) { carried_first_ = carried; }
  int choose(int batch, int64_t prompt_tokens = 0);

  void observe_decode(int batch, double seconds);
  void observe_multi(int64_t tokens, double seconds);
  void observe_draft(int batch, int steps, double seconds);  // a whole chain of `steps` chain steps (run, not drafts)
  void observe_accepts(int drafted, int accepted);           // one sequence's verify

  double acceptance(int j) const;            // alpha_j, j = 1 .. max_k
  double expected_accept_length(int k) const;  // L(k)
  double expected_step_seconds(int batch, int k, int64_t prompt_tokens = 0) const;
  double expected_tokens_per_second(int batch, int k, int64_t prompt_tokens = 0) const;

 private:
  // Per bucket the last kWindow observations (size, seconds); its estimate is their medians, so a few slow steps
  // (a CUDA graph captured for a new shape, host jitter) do not move it: with a moving average one such step made
  // the length just measured look worse than the others until it was explored again.
  struct Table {
    std::array<std::array<double, kWindow>, kBuckets> sizes{}, secs{};
    std::array<int, kBuckets> count{};     // observations kept (<= kWindow) ...
    std::array<int, kBuckets> next{};      // ... and the ring slot the next one takes
    std::array<double, kBuckets> seconds{};  // the medians of the window
    std::array<double, kBuckets> size{};     // (tokens / sequences)
    std::array<bool, kBuckets> seen{};
    std::array<bool, kBuckets> warmed{};  // a bucket's first observation is a warm-up (lazy setup, cold caches): dropped
    void observe(double n, double s);
    bool any() const;
    // < 0: nothing measured. Above the largest bucket measured: proportional to n, or with `optimistic` that
    // bucket's own cost (a lower bound: a pass costs no less for more tokens).
    double estimate(double n, bool optimistic = false) const;
    bool seen_at(double n) const { return seen[bucket_of(n)]; }
  };
  static int bucket_of(double n);
  int best_length(int batch, int64_t prompt_tokens) const;  // argmax_K of the model (ties: the smaller K)

  int max_k_;
  int explore_period_;
  bool replays_ = true;
  bool carried_first_ = false;
  Table decode_, multi_, draft_;
  std::array<double, kMaxSteps + 1> attempts_{}, accepts_{};  // per draft position j (index j), decayed
  std::array<int, kBuckets> choices_{};
};

}  // namespace kiln::engine
