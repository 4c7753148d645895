// `kiln bench`: a serving benchmark in the manner of sglang.bench_serving and vllm bench serve, for
// any OpenAI-compatible server. Random prompts of an exact token length, ignore_eos outputs of a fixed
// length, every request streamed; TTFT / TPOT / ITL / E2E distributions and throughputs (metrics.h)
// per max-concurrency level of a sweep, then a summary across levels.
#pragma once
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "clients/http.h"
#include "clients/metrics.h"

namespace kiln::clients {

enum class BenchEndpoint { completions, chat };

struct BenchOptions {
  ServerAddress server;
  std::string model;  // empty: ask GET /v1/models
  BenchEndpoint endpoint = BenchEndpoint::completions;
  size_t input_len = 1024;
  size_t output_len = 128;
  std::optional<size_t> num_prompts;  // per level; default max(16, 4 x concurrency), 64 when unlimited
  std::vector<size_t> max_concurrency = {0};  // one level each; 0 = unlimited
  double request_rate = std::numeric_limits<double>::infinity();  // requests/s, Poisson arrivals
  uint64_t seed = 1;
  std::string tokenizer_dir;           // count prompt tokens locally instead of with /tokenize
  double max_failed_fraction = 0.05;   // more failed requests than this in a level fails the run
  bool progress = true;                // a live progress bar on stderr when it is a terminal
  // Multi-turn mode (run_multi_turn_bench): `conversations` conversations at once, each of multi_turn turns; turn
  // t sends the whole history (every earlier prompt and answer) plus a new message of input_len tokens.
  size_t multi_turn = 0;
  size_t conversations = 8;
  // Mixed load: request i of a level (0-based) with (i + 1) % long_every == 0 sends a prompt of long_input_len
  // tokens instead of input_len (0: none). The level then also reports TTFT / ITL of the short-prompt and the
  // long-prompt requests apart: what long prompts arriving cost the streams beside them.
  size_t long_input_len = 0;
  size_t long_every = 0;
};

// The prompt length of request i (0-based) of a level: long_input_len for every long_every-th, else input_len.
size_t bench_prompt_len(const BenchOptions& options, size_t i);

struct LevelResult {
  size_t max_concurrency = 0;  // 0 = unlimited
  size_t num_prompts = 0;
  size_t short_outputs = 0;  // successful requests with fewer than output_len tokens
  BenchMetrics metrics;
  // Mixed load (long_every > 0): the short-prompt and the long-prompt requests apart.
  bool mixed = false;
  BenchMetrics short_prompts, long_prompts;
};

struct BenchReport {
  std::string url, model, endpoint, prompt_tokens_counted_by;
  BenchOptions options;
  std::vector<LevelResult> levels;
  bool passed = true;
  std::string failure;  // why the run failed

  nlohmann::json to_json() const;
};

// "1,4,16" -> {1, 4, 16}; "inf" or "unlimited" -> 0. Throws kiln::Error.
std::vector<size_t> parse_concurrency_list(std::string_view list);
// "inf" or a positive number of requests per second. Throws kiln::Error.
double parse_request_rate(std::string_view text);
// Arrival times (seconds from the start) of n requests: the first at 0, then exponential gaps of mean
// 1/rate (a Poisson process); all 0 for an infinite rate.
std::vector<double> poisson_arrival_times(size_t n, double rate, std::mt19937_64& rng);
// The number of prompts a level runs: --num-prompts, else max(16, 4 x concurrency), 64 when unlimited.
size_t prompts_for_level(const BenchOptions& options, size_t max_concurrency);

// One turn of a multi-turn run, over all conversations.
struct TurnResult {
  size_t turn = 0;  // 1-based
  size_t completed = 0, failed = 0;
  double mean_prompt_tokens = 0;  // the server's usage.prompt_tokens
  double mean_cached_tokens = 0;  // the server's usage.prompt_tokens_details.cached_tokens (0 when not sent)
  Distribution ttft_ms, e2e_ms;
  double output_throughput = 0;   // this turn's output tokens / (last end - first start of the turn)
  std::map<std::string, size_t> failure_reasons;
};

struct MultiTurnReport {
  std::string url, model, prompt_tokens_counted_by;
  BenchOptions options;
  std::vector<TurnResult> turns;
  bool passed = true;
  std::string failure;
  nlohmann::json to_json() const;
};

// Multi-turn conversations over /v1/completions (the history is the prompt text: prompt, answer, next message,
// ...), all conversations at once, turn after turn within each. TTFT and throughput per turn: with a prefix
// cache a turn's TTFT stays near that of its new message instead of growing with the history.
MultiTurnReport run_multi_turn_bench(const BenchOptions& options, std::FILE* out);

// Runs the benchmark, printing to `out` (progress to stderr). Throws kiln::Error when the server
// cannot be reached, prompts cannot be built or the warm-up request fails; a level with too many
// failed requests ends the sweep with passed = false.
BenchReport run_bench(const BenchOptions& options, std::FILE* out);

}  // namespace kiln::clients
