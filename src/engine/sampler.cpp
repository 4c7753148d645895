#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace kiln::engine {
namespace {

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

}  // namespace

Xoshiro256::Xoshiro256(uint64_t seed) {
  for (uint64_t& s : s_) s = splitmix64(seed);
}

uint64_t Xoshiro256::next() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Xoshiro256::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

SequenceSampler::SequenceSampler(const SamplingParams& params, uint64_t seed) : params_(params), rng_(seed) {
  if (!(params_.temperature >= 0.0f)) fail("temperature must be >= 0, got {}", params_.temperature);
  if (!(params_.top_p > 0.0f && params_.top_p <= 1.0f)) fail("top_p must be in (0, 1], got {}", params_.top_p);
  if (params_.top_k < 0) fail("top_k must be >= 0 (0 = off), got {}", params_.top_k);
  if (!(params_.min_p >= 0.0f && params_.min_p <= 1.0f)) fail("min_p must be in [0, 1], got {}", params_.min_p);
  if (!(params_.repetition_penalty > 0.0f))
    fail("repetition_penalty must be > 0, got {}", params_.repetition_penalty);
}

void SequenceSampler::set_constraint(std::shared_ptr<const grammar::Constraint> constraint,
                                     std::vector<int32_t> stop_ids) {
  if (!constraint) return;
  KILN_CHECK(constraint->grammar && constraint->tokens, "a constraint without a grammar or a token table");
  stop_ids_ = std::move(stop_ids);
  // A shared compiled grammar (the request's other choices, earlier requests with the same grammar) when the server
  // gave one, else one of its own.
  matcher_ = constraint->compiled ? std::make_unique<grammar::Matcher>(constraint->compiled, stop_ids_)
                                  : std::make_unique<grammar::Matcher>(constraint->grammar, constraint->tokens, stop_ids_);
  constraint_start_token_ = constraint->start_after_token;
  constraint_active_ = constraint_start_token_ < 0;
}

void SequenceSampler::observe(int32_t token) {
  if (matcher_ && !constraint_active_ && token == constraint_start_token_) constraint_active_ = true;
}

SampleResult SequenceSampler::sample(std::span<float> logits, std::span<const int32_t> history,
                                     size_t generated_begin, int top_logprobs, bool want_logprob) {
  if (!constrained_now()) {
    SampleResult r = sample_free(logits, history, generated_begin, top_logprobs, want_logprob);
    observe(r.token);
    return r;
  }
  SampleResult r;
  if (matcher_->apply(logits) == 0) {
    // The grammar allows nothing more (complete, or a dead end no token can leave): end the sequence.
    if (stop_ids_.empty()) fail("constrained decoding: the grammar is complete but the model has no end-of-sequence token");
    r.token = stop_ids_.front();
    forced_end_ = true;
    return r;
  }
  r = sample_free(logits, history, generated_begin, top_logprobs, want_logprob);
  if (!matcher_->accept(r.token)) fail("constrained decoding: sampled token {} does not fit the grammar", r.token);
  return r;
}

SampleResult SequenceSampler::sample_free(std::span<float> logits, std::span<const int32_t> history,
                                          size_t generated_begin, int top_logprobs, bool want_logprob) {
  const int64_t V = static_cast<int64_t>(logits.size());
  KILN_CHECK(V > 0, "empty logits");
  float* l = logits.data();

  // 0. logit bias (OpenAI: added to the model's logits before anything else)
  for (const auto& [t, bias] : params_.logit_bias)
    if (t >= 0 && t < V) l[t] += bias;

  // 1. penalties
  if (params_.repetition_penalty != 1.0f) {
    std::vector<bool> seen(V, false);
    for (int32_t t : history)
      if (t >= 0 && t < V && !seen[t]) {
        seen[t] = true;
        l[t] = l[t] > 0 ? l[t] / params_.repetition_penalty : l[t] * params_.repetition_penalty;
      }
  }
  if (params_.frequency_penalty != 0.0f || params_.presence_penalty != 0.0f) {
    counts_.assign(V, 0);
    for (size_t i = std::min(generated_begin, history.size()); i < history.size(); ++i)
      if (history[i] >= 0 && history[i] < V) ++counts_[history[i]];
    for (int64_t t = 0; t < V; ++t)
      if (counts_[t] > 0) l[t] -= params_.frequency_penalty * counts_[t] + params_.presence_penalty;
  }

  // 2. temperature (logprobs are taken from this distribution)
  const bool greedy = model::greedy_temperature(params_.temperature);
  if (!greedy) model::scale_logits(l, V, params_.temperature);
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < V; ++t) max_logit = std::max(max_logit, static_cast<double>(l[t]));
  if (!std::isfinite(max_logit)) fail("sampling: no finite logit (all -inf or NaN)");
  // log Z of this distribution: a pass of exp over the vocabulary, only when a logprob is reported. The filters below
  // never write to l, so logprob_of reads the temperature-scaled logits.
  double log_z = 0;
  if (want_logprob || top_logprobs > 0) {
    double sum = 0;
    for (int64_t t = 0; t < V; ++t) sum += std::exp(static_cast<double>(l[t]) - max_logit);
    log_z = max_logit + std::log(sum);
  }
  auto logprob_of = [&](int32_t t) { return static_cast<float>(static_cast<double>(l[t]) - log_z); };

  SampleResult res;
  if (top_logprobs > 0) {
    order_.resize(V);
    std::iota(order_.begin(), order_.end(), 0);
    const int64_t n = std::min<int64_t>(top_logprobs, V);
    std::partial_sort(order_.begin(), order_.begin() + n, order_.end(),
                      [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    for (int64_t i = 0; i < n; ++i) res.top.push_back({order_[i], logprob_of(order_[i])});
  }

  if (greedy) {
    res.token = model::greedy_token(l, V);
    if (want_logprob) res.logprob = logprob_of(res.token);
    return res;
  }

  // 3. filters and 4. the draw (model/sampling.h: the definition the GPU's sample_rows follows).
  res.token = model::sample_scaled_logits(l, V, params_.top_k, params_.top_p, params_.min_p, rng_.uniform(), scratch_);
  if (want_logprob) res.logprob = logprob_of(res.token);
  return res;
}

model::RowSampling SequenceSampler::next_row_sampling() {
  model::RowSampling r;
  r.temperature = params_.temperature;
  r.top_k = params_.top_k;
  r.top_p = params_.top_p;
  r.min_p = params_.min_p;
  if (!model::greedy_temperature(params_.temperature)) r.u = rng_.uniform();
  return r;
}

}  // namespace kiln::engine
