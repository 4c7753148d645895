// `kiln bench`: a serving benchmark in the manner of sglang.bench_serving and vllm bench serve, for
// any OpenAI-compatible server. Random prompts of an exact token length with ignore_eos outputs of a fixed
// length, or (dataset mode, --dataset-path) the prompts of a file with natural output lengths (the model
// stops at its end token); every request streamed; TTFT / TPOT / ITL / E2E distributions and throughputs
// (metrics.h) per max-concurrency level of a sweep, then a summary across levels.
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
  // Dataset mode (not empty): the prompts of this file (load_dataset) instead of random ones, sent without
  // ignore_eos, at most output_len tokens each (or an item's max_tokens). num_prompts takes the first N items
  // (after a shuffle seeded by `seed` when dataset_shuffle); default: all of them, at every level.
  std::string dataset_path;
  bool dataset_shuffle = false;
  double temperature = 0.0;  // every request's; 0 = greedy
};

// What one benchmark request sends: to /v1/completions `prompt_ids` when not empty, else `text`; to
// /v1/chat/completions `messages` when not null, else `text` as one user message.
struct BenchPrompt {
  std::string text;
  std::vector<int64_t> prompt_ids;
  nlohmann::json messages;              // null: none
  std::optional<bool> enable_thinking;  // chat: sent as chat_template_kwargs.enable_thinking when set
  size_t input_tokens = 0;              // counted by kiln bench; the server's usage.prompt_tokens wins when sent
  size_t max_tokens = 0;
};

// One item of a dataset file. Read per item (other fields are ignored; null is absent):
//   "prompt_ids"       token ids, the completions prompt (exact: no tokenizer in between)
//   "prompt"           text, already chat-formatted: the completions prompt without prompt_ids; the chat user
//                      message without messages
//   "messages"         chat messages (the chat endpoint)
//   "enable_thinking"  true / false: sent with messages as chat_template_kwargs.enable_thinking
//   "max_tokens"       this item's output limit instead of --output-len
struct DatasetItem {
  std::string where;  // "items[3]", "[3]" or "line 4": how errors name it
  std::optional<std::vector<int64_t>> prompt_ids;
  std::optional<std::string> prompt;
  nlohmann::json messages;  // null: none
  std::optional<bool> enable_thinking;
  std::optional<size_t> max_tokens;
};

// A dataset file's items, in file order. Layouts: a JSON object with an "items" array (tools/tiny/eval_prompts.json),
// a JSON array of items, or JSONL (one item per line). `path` names the file in errors. Throws kiln::Error for an
// empty file, text that is no JSON, no items, or an item with none of prompt_ids / prompt / messages or a field of
// the wrong type.
std::vector<DatasetItem> parse_dataset(const std::string& text, const std::string& path);
std::vector<DatasetItem> load_dataset(const std::string& path);
// The items a run sends: shuffled with options.seed when options.dataset_shuffle, then the first
// options.num_prompts (all when unset). Throws kiln::Error when num_prompts is more than there are.
std::vector<DatasetItem> select_dataset_items(std::vector<DatasetItem> items, const BenchOptions& options);
// What an item sends to options.endpoint (completions: prompt_ids, else prompt; chat: messages, else prompt as one
// user message), max_tokens = its max_tokens, else options.output_len; input_tokens = the length of prompt_ids
// (0 for text: the caller counts it). Throws kiln::Error naming the item when it has neither field the endpoint takes.
BenchPrompt dataset_prompt(const DatasetItem& item, const BenchOptions& options);

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
  size_t dataset_prompts = 0;  // dataset mode: the prompts each level sends
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
// The number of random prompts a level runs: --num-prompts, else max(16, 4 x concurrency), 64 when unlimited.
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

// Runs the benchmark, printing to `out` (progress to stderr). Throws kiln::Error when the dataset file is
// unusable (read before the server is asked anything), the server cannot be reached, prompts cannot be built or
// counted, or the warm-up request fails; a level with too many failed requests ends the sweep with passed = false.
// Dataset mode refuses long_every (the mixed load is of random prompts); run_multi_turn_bench refuses dataset_path.
BenchReport run_bench(const BenchOptions& options, std::FILE* out);

}  // namespace kiln::clients
