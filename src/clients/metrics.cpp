#include "clients/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace kiln::clients {

namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double percentile_of_sorted(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return kNaN;
  double rank = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(sorted.size() - 1);
  size_t below = static_cast<size_t>(std::floor(rank));
  size_t above = std::min(below + 1, sorted.size() - 1);
  double weight = rank - static_cast<double>(below);
  return sorted[below] + (sorted[above] - sorted[below]) * weight;
}

std::vector<double> times_1000(const std::vector<double>& seconds) {
  std::vector<double> ms(seconds.size());
  std::transform(seconds.begin(), seconds.end(), ms.begin(), [](double s) { return s * 1000.0; });
  return ms;
}
}  // namespace

double percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  return percentile_of_sorted(values, p);
}

Distribution describe(const std::vector<double>& values) {
  Distribution d;
  d.count = values.size();
  if (values.empty()) {
    d.mean = d.median = d.p90 = d.p99 = d.min = d.max = kNaN;
    return d;
  }
  std::vector<double> sorted = values;
  std::sort(sorted.begin(), sorted.end());
  d.mean = std::accumulate(sorted.begin(), sorted.end(), 0.0) / static_cast<double>(sorted.size());
  d.median = percentile_of_sorted(sorted, 50);
  d.p90 = percentile_of_sorted(sorted, 90);
  d.p99 = percentile_of_sorted(sorted, 99);
  d.min = sorted.front();
  d.max = sorted.back();
  return d;
}

std::optional<double> time_per_output_token_s(double e2e_s, double ttft_s, int64_t output_tokens) {
  if (output_tokens < 2) return std::nullopt;
  return (e2e_s - ttft_s) / static_cast<double>(output_tokens - 1);
}

std::vector<double> inter_token_latencies_s(const std::vector<double>& token_times_s) {
  std::vector<double> gaps;
  for (size_t i = 1; i < token_times_s.size(); ++i) gaps.push_back(token_times_s[i] - token_times_s[i - 1]);
  return gaps;
}

BenchMetrics compute_bench_metrics(const std::vector<RequestRecord>& records, double duration_s) {
  BenchMetrics m;
  m.duration_s = duration_s;
  std::vector<double> ttft, tpot, itl, e2e;
  for (const auto& r : records) {
    if (!r.ok) {
      ++m.failed;
      ++m.failure_reasons[r.error.empty() ? "unknown error" : r.error];
      continue;
    }
    ++m.completed;
    m.total_input_tokens += r.input_tokens;
    m.total_output_tokens += r.output_tokens;
    if (r.output_tokens_from_usage) ++m.output_tokens_from_usage;
    ttft.push_back(r.ttft_s);
    e2e.push_back(r.e2e_s);
    if (auto t = time_per_output_token_s(r.e2e_s, r.ttft_s, r.output_tokens)) tpot.push_back(*t);
    auto gaps = inter_token_latencies_s(r.token_times_s);
    itl.insert(itl.end(), gaps.begin(), gaps.end());
  }
  if (duration_s > 0) {
    m.request_throughput = static_cast<double>(m.completed) / duration_s;
    m.output_throughput = static_cast<double>(m.total_output_tokens) / duration_s;
    m.total_throughput = static_cast<double>(m.total_input_tokens + m.total_output_tokens) / duration_s;
  }
  m.ttft_ms = describe(times_1000(ttft));
  m.tpot_ms = describe(times_1000(tpot));
  m.itl_ms = describe(times_1000(itl));
  m.e2e_ms = describe(times_1000(e2e));
  m.per_user_tok_s_mean_tpot = m.tpot_ms.count && m.tpot_ms.mean > 0 ? 1000.0 / m.tpot_ms.mean : kNaN;
  m.per_user_tok_s_median_tpot = m.tpot_ms.count && m.tpot_ms.median > 0 ? 1000.0 / m.tpot_ms.median : kNaN;
  return m;
}

}  // namespace kiln::clients
