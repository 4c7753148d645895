#include "engine/speculative.h"

#include <algorithm>

#include "core/error.h"

namespace kiln::engine {

std::vector<int32_t> accept_greedy(std::span<const int32_t> drafts, std::span<const int32_t> target_argmax) {
  KILN_CHECK(target_argmax.size() == drafts.size() + 1, "accept_greedy: {} drafts, {} target tokens", drafts.size(),
             target_argmax.size());
  std::vector<int32_t> out;
  size_t j = 0;
  while (j < drafts.size() && drafts[j] == target_argmax[j]) out.push_back(drafts[j++]);
  out.push_back(target_argmax[j]);
  return out;
}

int32_t draw_index(std::span<const double> w, double u) {
  double total = 0;
  for (double x : w) total += std::max(x, 0.0);
  if (!(total > 0)) return -1;
  const double target = u * total;
  double acc = 0;
  int32_t last = -1;
  for (size_t i = 0; i < w.size(); ++i) {
    if (w[i] <= 0) continue;
    last = static_cast<int32_t>(i);
    acc += w[i];
    if (target < acc) return last;
  }
  return last;
}

SampledAccept accept_sampled(std::span<const int32_t> drafts, std::span<const float> target_probs,
                             std::span<const float> draft_probs, int64_t vocab, const std::function<double()>& uniform) {
  const size_t K = drafts.size(), V = static_cast<size_t>(vocab);
  KILN_CHECK(target_probs.size() == (K + 1) * V, "accept_sampled: target rows {} for {} drafts of vocab {}",
             target_probs.size(), K, V);
  KILN_CHECK(draft_probs.empty() || draft_probs.size() == K * V, "accept_sampled: draft rows {} for {} drafts",
             draft_probs.size(), K);
  auto row_sum = [&](std::span<const float> rows, size_t j) {
    double s = 0;
    for (size_t i = 0; i < V; ++i) s += rows[j * V + i];
    return s;
  };
  SampledAccept r;
  std::vector<double> w(V);
  for (size_t j = 0; j < K; ++j) {
    const int32_t d = drafts[j];
    KILN_CHECK(d >= 0 && static_cast<size_t>(d) < V, "accept_sampled: draft token {} outside the vocabulary", d);
    const double p_sum = row_sum(target_probs, j);
    const double q_sum = draft_probs.empty() ? 1.0 : row_sum(draft_probs, j);
    auto p = [&](size_t i) { return p_sum > 0 ? target_probs[j * V + i] / p_sum : 0.0; };
    auto q = [&](size_t i) {
      if (draft_probs.empty()) return i == static_cast<size_t>(d) ? 1.0 : 0.0;
      return q_sum > 0 ? draft_probs[j * V + i] / q_sum : 0.0;
    };
    const double qd = q(static_cast<size_t>(d)), pd = p(static_cast<size_t>(d));
    // qd == 0 cannot happen for a token drawn from q; treat it as a reject (p's residual is then p itself).
    if (qd > 0 && uniform() < std::min(1.0, pd / qd)) {
      r.tokens.push_back(d);
      ++r.accepted;
      continue;
    }
    for (size_t i = 0; i < V; ++i) w[i] = std::max(0.0, p(i) - q(i));
    int32_t t = draw_index(w, uniform());
    if (t < 0) {  // p == q exactly: the residual is empty, and p itself is the right distribution
      for (size_t i = 0; i < V; ++i) w[i] = p(i);
      t = draw_index(w, uniform());
    }
    KILN_CHECK(t >= 0, "accept_sampled: the target row {} has no probability mass", j);
    r.tokens.push_back(t);
    return r;
  }
  for (size_t i = 0; i < V; ++i) w[i] = target_probs[K * V + i];
  const int32_t bonus = draw_index(w, uniform());
  KILN_CHECK(bonus >= 0, "accept_sampled: the target's last row has no probability mass");
  r.tokens.push_back(bonus);
  return r;
}

}  // namespace kiln::engine
