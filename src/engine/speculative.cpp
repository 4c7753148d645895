#include "engine/speculative.h"

#include <algorithm>
#include <cmath>

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

// ---- DraftLengthChooser ----

namespace {
constexpr double kPriorAlpha = 0.8;
constexpr double kPriorWeight = 2.0;   // pseudo-observations behind the prior
constexpr double kAcceptDecay = 0.995;  // per observation: about the last 200 verifies count
}  // namespace

DraftLengthChooser::DraftLengthChooser(int max_k, int explore_period)
    : max_k_(std::clamp(max_k, 0, kMaxSteps)), explore_period_(explore_period) {
  for (int j = 1; j <= kMaxSteps; ++j) {
    attempts_[j] = kPriorWeight;
    accepts_[j] = kPriorWeight * kPriorAlpha;
  }
}

int DraftLengthChooser::bucket_of(double n) {
  int b = 0;
  while (b + 1 < kBuckets && n >= static_cast<double>(int64_t(1) << (b + 1))) ++b;
  return b;
}

namespace {

// The lower quartile of v[0 .. n) (1 <= n <= kWindow): the (n / 4 + 1)-th smallest value.
double lower_quartile(const double* v, int n) {
  std::array<double, DraftLengthChooser::kWindow> t{};
  std::copy(v, v + n, t.begin());
  std::nth_element(t.begin(), t.begin() + n / 4, t.begin() + n);
  return t[n / 4];
}

}  // namespace

void DraftLengthChooser::Table::observe(double n, double s) {
  const int b = bucket_of(n);
  if (!warmed[b]) {
    warmed[b] = true;
    return;
  }
  sizes[b][next[b]] = n;
  secs[b][next[b]] = s;
  next[b] = (next[b] + 1) % kWindow;
  count[b] = std::min(count[b] + 1, kWindow);
  // Two observations before the bucket counts (with one, a single slow step would stand for it).
  if (count[b] < 2) return;
  seconds[b] = lower_quartile(secs[b].data(), count[b]);
  size[b] = lower_quartile(sizes[b].data(), count[b]);
  seen[b] = true;
}

bool DraftLengthChooser::Table::any() const {
  return std::any_of(seen.begin(), seen.end(), [](bool x) { return x; });
}

double DraftLengthChooser::Table::estimate(double n, bool optimistic) const {
  int lo = -1, hi = -1;
  for (int b = 0; b < kBuckets; ++b) {
    if (!seen[b]) continue;
    if (size[b] <= n) lo = b;  // sizes grow with the bucket: the last one at or below n
    else if (hi < 0) hi = b;
  }
  if (lo < 0 && hi < 0) return -1;
  if (lo < 0) return seconds[hi];                                  // below the smallest: flat
  if (hi < 0) return optimistic ? seconds[lo] : seconds[lo] * (n / std::max(size[lo], 1.0));  // above the largest
  const double t = (n - size[lo]) / std::max(size[hi] - size[lo], 1e-9);
  return seconds[lo] + t * (seconds[hi] - seconds[lo]);
}

void DraftLengthChooser::observe_decode(int batch, double seconds) {
  if (batch > 0 && seconds > 0) decode_.observe(batch, seconds);
}

void DraftLengthChooser::observe_multi(int64_t tokens, double seconds) {
  if (tokens > 0 && seconds > 0) multi_.observe(static_cast<double>(tokens), seconds);
}

void DraftLengthChooser::observe_draft(int batch, int steps, double seconds) {
  if (batch > 0 && steps > 0 && seconds > 0) draft_.observe(batch, seconds / steps);
}

void DraftLengthChooser::observe_accepts(int drafted, int accepted) {
  drafted = std::min(drafted, kMaxSteps);
  accepted = std::clamp(accepted, 0, drafted);
  // Draft j was judged when the drafts before it were accepted: j = 1 .. min(accepted + 1, drafted).
  for (int j = 1; j <= std::min(accepted + 1, drafted); ++j) {
    attempts_[j] = attempts_[j] * kAcceptDecay + 1;
    accepts_[j] = accepts_[j] * kAcceptDecay + (j <= accepted ? 1 : 0);
  }
}

double DraftLengthChooser::acceptance(int j) const {
  if (j < 1 || j > kMaxSteps) return 0;
  return attempts_[j] > 0 ? accepts_[j] / attempts_[j] : 0;
}

double DraftLengthChooser::expected_accept_length(int k) const {
  double length = 1, all = 1;
  for (int j = 1; j <= k; ++j) {
    all *= acceptance(j);
    length += all;
  }
  return length;
}

double DraftLengthChooser::expected_step_seconds(int batch, int k, int64_t prompt_tokens) const {
  const double b = std::max(batch, 1);
  double decode = decode_.estimate(b);
  auto multi = [&](double n, bool optimistic = false) {
    const double m = multi_.estimate(n, optimistic);
    if (m >= 0) return m;
    const double d = decode_.estimate(n);
    return d >= 0 ? d : 1.0;  // nothing measured yet: every pass costs the same
  };
  // With prompt tokens the decode rows ride the prompts' pass; drafts add the verify pass (see the header).
  const double prompts = prompt_tokens > 0 ? multi(static_cast<double>(prompt_tokens) + b) : 0.0;
  if (prompt_tokens > 0 && k == 0) return prompts;
  if (k == 0) return decode >= 0 ? decode : multi(b);
  double all = 1;
  for (int j = 1; j <= k; ++j) all *= acceptance(j);
  const double draft = std::max(draft_.estimate(b), 0.0);
  const double replay_chance = replays_ ? 1 - std::pow(all, b) : 0.0;
  // The verify pass of a plain step (timed) is estimated optimistically above what was measured: the choice then
  // tries that length, and its measured cost replaces the guess (a proportional guess, far too high for a launch-bound
  // pass, kept such a length unmeasured until exploration reached it). A step with prompts is not timed: there the
  // guess stays on the safe side.
  const int chain_steps = carried_first_ ? k - 1 : k;
  return prompts + multi(b * (k + 1), prompt_tokens == 0) + chain_steps * draft +
         replay_chance * multi(b * expected_accept_length(k));
}

double DraftLengthChooser::expected_tokens_per_second(int batch, int k, int64_t prompt_tokens) const {
  const double t = expected_step_seconds(batch, k, prompt_tokens);
  return t > 0 ? std::max(batch, 1) * expected_accept_length(k) / t : 0;
}

int DraftLengthChooser::best_length(int batch, int64_t prompt_tokens) const {
  int best = 0;
  double best_rate = -1;
  for (int k = 0; k <= max_k_; ++k) {
    const double rate = expected_tokens_per_second(batch, k, prompt_tokens);
    if (rate > best_rate * (1 + 1e-9)) {
      best = k;
      best_rate = rate;
    }
  }
  return best;
}

int DraftLengthChooser::choose(int batch, int64_t prompt_tokens) {
  if (max_k_ == 0 || batch <= 0) return 0;
  if (prompt_tokens > 0) return best_length(batch, prompt_tokens);  // a step with prompts: the model alone (header)
  // Measure before trusting the model: in a batch bucket with no plain decode step timed yet, a plain step; then,
  // with no draft chain timed, a full-length draft. (Estimates from other buckets alone once kept a model whose
  // passes are launch-bound drafting although every plain step was faster.)
  if (!decode_.seen_at(batch)) return 0;
  if (!draft_.seen_at(batch) && (max_k_ > 1 || !carried_first_)) return max_k_;
  const int best = best_length(batch, 0);
  // Exploration: the other draft lengths in turn, one every explore_period choices of this bucket (and, while the
  // bucket is young, at its 4th, 8th, 16th ... choice, so that an early estimate is soon checked).
  int& n = choices_[bucket_of(batch)];
  ++n;
  if (explore_period_ > 0 && n < explore_period_ && n >= 4 && (n & (n - 1)) == 0) {
    int young = 0;  // 4 -> 0, 8 -> 1, 16 -> 2, ...
    for (int m = n; m > 4; m /= 2) ++young;
    const int other = young % max_k_;  // the lengths other than best, in turn (0 first)
    return other < best ? other : other + 1;
  }
  if (explore_period_ > 0 && n % explore_period_ == 0) {
    const int other = (n / explore_period_) % max_k_;  // 0 .. max_k - 1: the lengths other than best, in turn
    return other < best ? other : other + 1;
  }
  return best;
}

}  // namespace kiln::engine
