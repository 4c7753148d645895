#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>

namespace kiln::model {
namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
}  // namespace

void scale_logits(float* l, int64_t V, float temperature) {
  if (temperature == 1.0f) return;
  const float inv = 1.0f / temperature;
  for (int64_t t = 0; t < V; ++t) l[t] *= inv;
}

int32_t greedy_token(const float* l, int64_t V) {
  int32_t best = 0;
  for (int64_t t = 1; t < V; ++t)
    if (l[t] > l[best]) best = static_cast<int32_t>(t);  // strict: ties keep the lowest id
  return best;
}

void filter_scaled_logits(const float* l, int64_t V, int32_t top_k, float top_p, float min_p,
                          SampleScratch& scratch) {
  // Filters over a candidate list (token ids, ascending) instead of the whole vocabulary: top-k shrinks it to
  // ~k tokens, top-p sorts only as long a prefix as its mass needs. The arithmetic is the full-vocabulary
  // definition's, in the same order (sums in ascending id, the cumulative mass in sorted order), so the chosen
  // token is the same: dropped tokens would contribute exact zeros.
  std::vector<int32_t>& cand = scratch.cand;
  std::vector<int32_t>& order = scratch.order;
  std::vector<double>& probs = scratch.probs;
  std::vector<char>& keep = scratch.keep;
  cand.clear();
  if (top_k > 0 && top_k < V) {
    std::vector<float>& tmp = scratch.values;
    tmp.assign(l, l + V);
    std::nth_element(tmp.begin(), tmp.begin() + (top_k - 1), tmp.end(), std::greater<>());
    const float kth = tmp[top_k - 1];
    for (int64_t t = 0; t < V; ++t)
      if (!(l[t] < kth) && l[t] != kNegInf) cand.push_back(static_cast<int32_t>(t));  // ties with the k-th stay
  } else {
    cand.reserve(static_cast<size_t>(V));
    for (int64_t t = 0; t < V; ++t)
      if (l[t] != kNegInf) cand.push_back(static_cast<int32_t>(t));
  }
  // probs[i]: the renormalised probability of cand[i] among the candidates.
  auto softmax_cand = [&] {
    double m = -std::numeric_limits<double>::infinity();
    for (int32_t t : cand) m = std::max(m, static_cast<double>(l[t]));
    probs.resize(cand.size());
    double s = 0;
    for (size_t i = 0; i < cand.size(); ++i) s += (probs[i] = std::exp(static_cast<double>(l[cand[i]]) - m));
    for (double& x : probs) x /= s;
  };
  auto keep_only = [&] {
    size_t w = 0;
    for (size_t i = 0; i < cand.size(); ++i)
      if (keep[i]) cand[w++] = cand[i];
    cand.resize(w);
  };
  if (top_p < 1.0f) {
    softmax_cand();
    const size_t n = cand.size();
    order.resize(n);
    std::iota(order.begin(), order.end(), 0);
    // Candidate indices in descending probability (ties: lower id, i.e. lower index, first); the prefix that is
    // sorted grows until the cumulative mass crosses top_p.
    auto by_prob = [&](int32_t a, int32_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); };
    size_t sorted = std::min<size_t>(n, 256);
    size_t cut = n;  // order[cut ..] are dropped
    for (;;) {
      std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(sorted), order.end(), by_prob);
      double cum = 0;
      size_t i = 0;
      for (; i < sorted; ++i) {
        if (cum >= top_p && i > 0) break;  // mass before this token already reaches p
        cum += probs[order[i]];
      }
      if (i < sorted) {
        cut = i;
        break;
      }
      if (sorted == n) break;
      sorted = std::min(n, sorted * 8);
    }
    if (cut < n) {
      keep.assign(n, 0);
      for (size_t i = 0; i < cut; ++i) keep[order[i]] = 1;
      keep_only();
    }
  }
  if (min_p > 0.0f) {
    softmax_cand();
    const double pmax = *std::max_element(probs.begin(), probs.end());
    keep.assign(cand.size(), 0);
    for (size_t i = 0; i < cand.size(); ++i) keep[i] = !(probs[i] < min_p * pmax);
    keep_only();
  }

  softmax_cand();
}

int32_t sample_scaled_logits(const float* l, int64_t V, int32_t top_k, float top_p, float min_p, double u,
                             SampleScratch& scratch) {
  filter_scaled_logits(l, V, top_k, top_p, min_p, scratch);
  const std::vector<int32_t>& cand = scratch.cand;
  const std::vector<double>& probs = scratch.probs;
  // The draw.
  double cum = 0;
  int32_t chosen = -1, last_kept = -1;
  for (size_t i = 0; i < cand.size(); ++i) {
    if (probs[i] <= 0) continue;
    last_kept = cand[i];
    cum += probs[i];
    if (u < cum) {
      chosen = cand[i];
      break;
    }
  }
  if (chosen < 0) chosen = last_kept;  // u within rounding of 1
  return chosen;
}

int32_t sample_row_host(const float* logits, int64_t V, const RowSampling& row, SampleScratch& scratch) {
  if (V <= 0) return -1;
  const bool greedy = greedy_temperature(row.temperature);
  const float* l = logits;
  if (!greedy && row.temperature != 1.0f) {
    scratch.scaled.assign(logits, logits + V);
    scale_logits(scratch.scaled.data(), V, row.temperature);
    l = scratch.scaled.data();
  }
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < V; ++t) max_logit = std::max(max_logit, static_cast<double>(l[t]));
  if (!std::isfinite(max_logit)) return -1;
  if (greedy) return greedy_token(l, V);
  return sample_scaled_logits(l, V, row.top_k, row.top_p, row.min_p, row.u, scratch);
}

int32_t sample_row_host(const float* logits, int64_t V, const RowSampling& row) {
  SampleScratch scratch;
  return sample_row_host(logits, V, row, scratch);
}

}  // namespace kiln::model
