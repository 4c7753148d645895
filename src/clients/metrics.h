// Serving-benchmark maths (REFERENCE §6, the definitions sglang.bench_serving and vllm bench serve use):
//   TTFT  request sent -> first streamed token
//   TPOT  (E2E - TTFT) / (output tokens - 1), per request with at least 2 output tokens
//   ITL   gap between consecutive streamed chunks that carry text, pooled over all requests
//   E2E   request sent -> end of the stream
//   output tok/s = all output tokens / benchmark duration; total tok/s adds the input tokens;
//   requests/s = successful requests / duration; per-user tok/s = 1000 / TPOT in ms.
// Percentiles interpolate linearly between closest ranks (numpy.percentile's default).
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace kiln::clients {

// p in [0, 100]; rank p/100 * (n - 1) between the sorted values. NaN for no values.
double percentile(std::vector<double> values, double p);

struct Distribution {
  size_t count = 0;
  double mean = 0, median = 0, p90 = 0, p99 = 0, min = 0, max = 0;  // all NaN when count == 0
};
Distribution describe(const std::vector<double>& values);

// TPOT in seconds; nullopt when there are fewer than 2 output tokens.
std::optional<double> time_per_output_token_s(double e2e_s, double ttft_s, int64_t output_tokens);
// Gaps between consecutive arrival times.
std::vector<double> inter_token_latencies_s(const std::vector<double>& token_times_s);

// One benchmark request as measured.
struct RequestRecord {
  bool ok = false;
  std::string error;  // why it failed
  double ttft_s = 0;
  double e2e_s = 0;
  std::vector<double> token_times_s;  // since the request was sent
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;
  bool output_tokens_from_usage = false;  // else counted as streamed chunks
};

struct BenchMetrics {
  size_t completed = 0;
  size_t failed = 0;
  double duration_s = 0;
  int64_t total_input_tokens = 0;
  int64_t total_output_tokens = 0;
  double request_throughput = 0;  // successful requests / s
  double output_throughput = 0;   // output tok/s
  double total_throughput = 0;    // (input + output) tok/s
  Distribution ttft_ms, tpot_ms, itl_ms, e2e_ms;
  double per_user_tok_s_mean_tpot = 0;    // 1000 / mean TPOT (ms)
  double per_user_tok_s_median_tpot = 0;  // 1000 / median TPOT (ms)
  size_t output_tokens_from_usage = 0;    // successful requests whose count came from usage
  std::map<std::string, size_t> failure_reasons;  // reason -> number of requests
};

// Numbers from the successful requests only; failures are counted with their reasons.
BenchMetrics compute_bench_metrics(const std::vector<RequestRecord>& records, double duration_s);

}  // namespace kiln::clients
