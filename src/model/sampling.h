// Token sampling from one row of fp32 logits, without penalties: the definition that the engine's SequenceSampler
// (engine/sampler.h, which adds penalties and logprobs around it) and every backend's Ops::sample_rows follow.
//
//   1. temperature < 1e-6: greedy, the first index of the largest logit (lowest id on ties); otherwise every logit is
//      multiplied by inv = 1.0f / temperature, in float (a temperature of exactly 1 leaves the logits as they are);
//   2. a row whose largest (non-NaN) value is not finite (all -inf, or +inf after scaling) has no token: -1;
//   3. filters on the scaled logits, in this order (HF's warpers):
//      - top-k (0 < top_k < V): kth = the k-th largest value; the candidates are the tokens with !(l < kth) and
//        l != -inf, so every token tying the k-th stays; without top-k every token but the -inf ones is a candidate;
//      - top-p (top_p < 1): p_i = exp(l_i - m) / s over the candidates (doubles; m the largest logit, s the sum in
//        ascending id); candidates sorted by p descending, equal p by ascending id; the kept prefix ends at the first
//        token whose cumulative sum (in that order) reaches top_p: the crossing token is kept, tokens of the same
//        probability after it (higher ids) are not;
//      - min-p (min_p > 0): p renormalised over the survivors as above; tokens with p < min_p * max p are dropped;
//   4. one draw: p renormalised over the survivors (as above), cum summed in ascending id over the tokens with p > 0,
//      the first token with u < cum; when rounding leaves u >= every cum, the last token with p > 0.
// Probabilities and sums are doubles. NaN logits are not supported (the result is unspecified).
#pragma once
#include <cstdint>
#include <vector>

namespace kiln::model {

// One row's sampling parameters and its draw.
struct RowSampling {
  float temperature = 0.0f;  // < 1e-6: greedy (u unused)
  int32_t top_k = 0;         // 0 (or >= V): off
  float top_p = 1.0f;        // (0, 1]; 1: off
  float min_p = 0.0f;        // [0, 1]; 0: off
  double u = 0.0;            // the draw's uniform in [0, 1)
};

inline bool greedy_temperature(float temperature) { return temperature < 1e-6f; }

// Reusable buffers of the filters (no allocation per row once grown).
struct SampleScratch {
  std::vector<int32_t> order;  // candidate indices sorted by probability
  std::vector<int32_t> cand;   // surviving token ids, ascending
  std::vector<double> probs;
  std::vector<float> values;   // top-k's selection
  std::vector<float> scaled;   // sample_row_host's temperature-scaled copy of the row
  std::vector<char> keep;
};

// Step 1's scaling, in place: l[t] *= 1.0f / temperature unless temperature is 1 (call only when not greedy).
void scale_logits(float* l, int64_t V, float temperature);
// The first index of the largest value (strict >, from index 0).
int32_t greedy_token(const float* l, int64_t V);
// Step 3 over temperature-scaled logits whose largest value is finite: scratch.cand holds the surviving token ids
// (ascending) and scratch.probs their probabilities renormalised over them (the distribution step 4 draws from;
// speculative rejection sampling needs it whole).
void filter_scaled_logits(const float* l, int64_t V, int32_t top_k, float top_p, float min_p, SampleScratch& scratch);
// Steps 3-4 over temperature-scaled logits whose largest value is finite: the chosen token id.
int32_t sample_scaled_logits(const float* l, int64_t V, int32_t top_k, float top_p, float min_p, double u,
                             SampleScratch& scratch);
// Steps 1-4 over raw logits: the chosen token, or -1 when the row has no finite largest value.
int32_t sample_row_host(const float* logits, int64_t V, const RowSampling& row, SampleScratch& scratch);
int32_t sample_row_host(const float* logits, int64_t V, const RowSampling& row);

}  // namespace kiln::model
