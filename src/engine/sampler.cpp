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

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

SampleResult SequenceSampler::sample(std::span<float> logits, std::span<const int32_t> history,
                                     size_t generated_begin, int top_logprobs, bool want_logprob) {
  const int64_t V = static_cast<int64_t>(logits.size());
  KILN_CHECK(V > 0, "empty logits");
  float* l = logits.data();

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
  const bool greedy = params_.temperature < 1e-6f;
  if (!greedy && params_.temperature != 1.0f) {
    const float inv = 1.0f / params_.temperature;
    for (int64_t t = 0; t < V; ++t) l[t] *= inv;
  }
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
    int32_t best = 0;
    for (int64_t t = 1; t < V; ++t)
      if (l[t] > l[best]) best = static_cast<int32_t>(t);  // strict: ties keep the lowest id
    res.token = best;
    if (want_logprob) res.logprob = logprob_of(best);
    return res;
  }

  // 3. filters over a candidate list (token ids, ascending) instead of the whole vocabulary: top-k shrinks it to
  // ~k tokens, top-p sorts only as long a prefix as its mass needs. The arithmetic is the full-vocabulary
  // definition's, in the same order (sums in ascending id, the cumulative mass in sorted order), so the chosen
  // token is the same: dropped tokens would contribute exact zeros.
  cand_.clear();
  if (params_.top_k > 0 && params_.top_k < V) {
    std::vector<float> tmp(l, l + V);
    std::nth_element(tmp.begin(), tmp.begin() + (params_.top_k - 1), tmp.end(), std::greater<>());
    const float kth = tmp[params_.top_k - 1];
    for (int64_t t = 0; t < V; ++t)
      if (!(l[t] < kth) && l[t] != kNegInf) cand_.push_back(static_cast<int32_t>(t));  // ties with the k-th stay
  } else {
    cand_.reserve(static_cast<size_t>(V));
    for (int64_t t = 0; t < V; ++t)
      if (l[t] != kNegInf) cand_.push_back(static_cast<int32_t>(t));
  }
  // probs_[i]: the renormalised probability of cand_[i] among the candidates.
  auto softmax_cand = [&] {
    double m = -std::numeric_limits<double>::infinity();
    for (int32_t t : cand_) m = std::max(m, static_cast<double>(l[t]));
    probs_.resize(cand_.size());
    double s = 0;
    for (size_t i = 0; i < cand_.size(); ++i) s += (probs_[i] = std::exp(static_cast<double>(l[cand_[i]]) - m));
    for (double& x : probs_) x /= s;
  };
  auto keep_only = [&](const std::vector<char>& keep) {
    size_t w = 0;
    for (size_t i = 0; i < cand_.size(); ++i)
      if (keep[i]) cand_[w++] = cand_[i];
    cand_.resize(w);
  };
  if (params_.top_p < 1.0f) {
    softmax_cand();
    const size_t n = cand_.size();
    order_.resize(n);
    std::iota(order_.begin(), order_.end(), 0);
    // Candidate indices in descending probability (ties: lower id, i.e. lower index, first); the prefix that is
    // sorted grows until the cumulative mass crosses top_p.
    auto by_prob = [&](int32_t a, int32_t b) { return probs_[a] > probs_[b] || (probs_[a] == probs_[b] && a < b); };
    size_t sorted = std::min<size_t>(n, 256);
    size_t cut = n;  // order_[cut ..] are dropped
    for (;;) {
      std::partial_sort(order_.begin(), order_.begin() + static_cast<std::ptrdiff_t>(sorted), order_.end(), by_prob);
      double cum = 0;
      size_t i = 0;
      for (; i < sorted; ++i) {
        if (cum >= params_.top_p && i > 0) break;  // mass before this token already reaches p
        cum += probs_[order_[i]];
      }
      if (i < sorted) {
        cut = i;
        break;
      }
      if (sorted == n) break;
      sorted = std::min(n, sorted * 8);
    }
    if (cut < n) {
      std::vector<char> keep(n, 0);
      for (size_t i = 0; i < cut; ++i) keep[order_[i]] = 1;
      keep_only(keep);
    }
  }
  if (params_.min_p > 0.0f) {
    softmax_cand();
    const double pmax = *std::max_element(probs_.begin(), probs_.end());
    std::vector<char> keep(cand_.size());
    for (size_t i = 0; i < cand_.size(); ++i) keep[i] = !(probs_[i] < params_.min_p * pmax);
    keep_only(keep);
  }

  // 4. draw
  softmax_cand();
  const double u = rng_.uniform();
  double cum = 0;
  int32_t chosen = -1, last_kept = -1;
  for (size_t i = 0; i < cand_.size(); ++i) {
    if (probs_[i] <= 0) continue;
    last_kept = cand_[i];
    cum += probs_[i];
    if (u < cum) {
      chosen = cand_[i];
      break;
    }
  }
  if (chosen < 0) chosen = last_kept;  // u within rounding of 1
  res.token = chosen;
  if (want_logprob) res.logprob = logprob_of(chosen);
  return res;
}

}  // namespace kiln::engine
