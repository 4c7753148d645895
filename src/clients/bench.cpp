#include "clients/bench.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "clients/display.h"
#include "clients/openai.h"
#include "clients/prompts.h"
#include "core/error.h"

namespace kiln::clients {

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxThreads = 4096;
constexpr size_t kWarmupOutputTokens = 16;

const char* endpoint_path(BenchEndpoint endpoint) {
  return endpoint == BenchEndpoint::chat ? "/v1/chat/completions" : "/v1/completions";
}

std::string concurrency_name(size_t c) { return c == 0 ? "unlimited" : std::to_string(c); }

bool dataset_mode(const BenchOptions& options) { return !options.dataset_path.empty(); }

// Random prompts: ignore_eos, so every output is max_tokens long. Dataset prompts: natural lengths.
nlohmann::json request_body(const BenchOptions& options, const std::string& model, const BenchPrompt& prompt) {
  GenerationParams params;
  params.max_tokens = static_cast<int>(prompt.max_tokens);
  params.temperature = options.temperature;
  params.ignore_eos = !dataset_mode(options);
  params.stream = true;
  if (options.endpoint == BenchEndpoint::chat) {
    params.enable_thinking = prompt.enable_thinking;
    nlohmann::json body = chat_request(model, prompt.text, params);
    if (!prompt.messages.is_null()) body["messages"] = prompt.messages;
    return body;
  }
  nlohmann::json body = completion_request(model, prompt.text, params);
  if (!prompt.prompt_ids.empty()) body["prompt"] = prompt.prompt_ids;
  return body;
}

RequestRecord measure_request(HttpClient& client, const BenchOptions& options, const std::string& model,
                              const BenchPrompt& prompt) {
  Generation g = run_generation(client, endpoint_path(options.endpoint), request_body(options, model, prompt));
  RequestRecord record;
  if (!g.ok) {
    record.error = g.error;
    return record;
  }
  if (g.token_times_s.empty()) {
    record.error = fmt::format("no tokens streamed (finish_reason={})", g.finish_reason.empty() ? "none" : g.finish_reason);
    return record;
  }
  record.ok = true;
  record.ttft_s = g.token_times_s.front();
  record.e2e_s = g.e2e_s;
  record.token_times_s = std::move(g.token_times_s);
  record.output_tokens_from_usage = g.completion_tokens.has_value();
  record.output_tokens = g.completion_tokens ? *g.completion_tokens : static_cast<int64_t>(record.token_times_s.size());
  record.input_tokens = g.prompt_tokens ? *g.prompt_tokens : static_cast<int64_t>(prompt.input_tokens);
  return record;
}

// Redraws one line on stderr while a level runs.
class ProgressBar {
 public:
  ProgressBar(bool enabled, std::string label, size_t total, const std::atomic<size_t>& done,
              const std::atomic<size_t>& failed)
      : enabled_(enabled), label_(std::move(label)), total_(total), done_(done), failed_(failed) {
    if (enabled_) thread_ = std::thread([this] { loop(); });
  }
  ~ProgressBar() { stop(); }

  void stop() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
  }

 private:
  void loop() {
    auto start = Clock::now();
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      size_t done = done_.load(), failed = failed_.load();
      constexpr size_t kWidth = 30;
      size_t filled = total_ ? done * kWidth / total_ : kWidth;
      std::string bar(filled, '#');
      bar.resize(kWidth, '.');
      double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      std::fprintf(stderr, "\r\033[K%s [%s] %zu/%zu requests%s  %.1f s", label_.c_str(), bar.c_str(), done, total_,
                   failed ? fmt::format(" ({} failed)", failed).c_str() : "", elapsed);
      std::fflush(stderr);
      wake_.wait_for(lock, std::chrono::milliseconds(200));
    }
  }

  bool enabled_;
  std::string label_;
  size_t total_;
  const std::atomic<size_t>& done_;
  const std::atomic<size_t>& failed_;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
};

LevelResult run_level(const BenchOptions& options, const std::string& model, const std::vector<BenchPrompt>& prompts,
                      size_t max_concurrency, std::mt19937_64& arrival_rng) {
  const size_t n = prompts.size();
  const size_t workers = max_concurrency == 0 ? n : std::min(max_concurrency, n);
  if (workers > kMaxThreads)
    fail("{} requests at once is more than kiln bench supports ({}): pass --max-concurrency", workers, kMaxThreads);
  std::vector<double> arrivals = poisson_arrival_times(n, options.request_rate, arrival_rng);
  std::vector<RequestRecord> records(n);
  std::atomic<size_t> next{0}, done{0}, failed{0};

  const bool show_progress = options.progress && isatty(STDERR_FILENO);
  ProgressBar progress(show_progress, "concurrency " + concurrency_name(max_concurrency), n, done, failed);
  const auto start = Clock::now();
  // Each worker takes the next request in arrival order and waits for its arrival time: a request
  // starts once it has arrived and one of the max_concurrency slots is free.
  auto worker = [&] {
    std::optional<HttpClient> client;
    for (size_t i = next++; i < n; i = next++) {
      std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                                std::chrono::duration<double>(arrivals[i])));
      try {
        if (!client) client.emplace(options.server);
        records[i] = measure_request(*client, options, model, prompts[i]);
      } catch (const std::exception& e) {
        records[i].error = e.what();
      }
      if (!records[i].ok) ++failed;
      ++done;
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(workers);
  for (size_t w = 0; w < workers; ++w) threads.emplace_back(worker);
  for (auto& t : threads) t.join();
  const double duration_s = std::chrono::duration<double>(Clock::now() - start).count();
  progress.stop();

  LevelResult level;
  level.max_concurrency = max_concurrency;
  level.num_prompts = n;
  level.metrics = compute_bench_metrics(records, duration_s);
  if (options.long_every > 0) {
    std::vector<RequestRecord> short_records, long_records;
    for (size_t i = 0; i < n; ++i)
      ((i + 1) % options.long_every == 0 ? long_records : short_records).push_back(records[i]);
    level.mixed = true;
    level.short_prompts = compute_bench_metrics(short_records, duration_s);
    level.long_prompts = compute_bench_metrics(long_records, duration_s);
  }
  // Random prompts ask for ignore_eos: an output cut short says the server ignored it. Dataset outputs end
  // where the model stops.
  if (!dataset_mode(options))
    for (size_t i = 0; i < n; ++i)
      if (records[i].ok && records[i].output_tokens < static_cast<int64_t>(prompts[i].max_tokens))
        ++level.short_outputs;
  return level;
}

std::string token_source(const BenchMetrics& m) {
  if (m.completed == 0) return "none";
  if (m.output_tokens_from_usage == m.completed) return "usage";
  if (m.output_tokens_from_usage == 0) return "chunks";
  return "mixed";
}

std::string token_source_text(const BenchMetrics& m) {
  std::string source = token_source(m);
  if (source == "usage") return "counted from the server's usage";
  if (source == "chunks") return "counted as streamed chunks: the server sent no usage";
  if (source == "mixed")
    return fmt::format("usage for {} requests, streamed chunks for {}", m.output_tokens_from_usage,
                       m.completed - m.output_tokens_from_usage);
  return "no successful request";
}

std::string fmt_number(double v, int decimals = 2) {
  if (std::isnan(v)) return "-";
  return fmt::format("{:.{}f}", v, decimals);
}

void print_level(std::FILE* out, const BenchOptions& options, const LevelResult& level) {
  const BenchMetrics& m = level.metrics;
  fmt::print(out, "\n{:-^74}\n", fmt::format(" max concurrency {}: {} requests ", concurrency_name(level.max_concurrency),
                                            level.num_prompts));
  auto row = [out](std::string_view name, std::string value) { fmt::print(out, "{:<36}{}\n", name, value); };
  row("Request rate (req/s):", std::isinf(options.request_rate) ? "inf" : fmt_number(options.request_rate));
  row("Successful requests:", std::to_string(m.completed));
  row("Failed requests:", std::to_string(m.failed));
  row("Benchmark duration (s):", fmt_number(m.duration_s));
  row("Total input tokens:", std::to_string(m.total_input_tokens));
  row("Total generated tokens:", fmt::format("{} ({})", m.total_output_tokens, token_source_text(m)));
  if (dataset_mode(options) && m.completed > 0)
    row("Mean output tokens per request:",
        fmt_number(static_cast<double>(m.total_output_tokens) / static_cast<double>(m.completed), 1));
  row("Request throughput (req/s):", fmt_number(m.request_throughput));
  row("Output token throughput (tok/s):", fmt_number(m.output_throughput));
  row("Total token throughput (tok/s):", fmt_number(m.total_throughput));
  row("Per-user tok/s (1000/TPOT ms):",
      fmt::format("{} (mean TPOT), {} (median TPOT)", fmt_number(m.per_user_tok_s_mean_tpot),
                  fmt_number(m.per_user_tok_s_median_tpot)));
  fmt::print(out, "{:<20}{:>12}{:>12}{:>12}{:>12}\n", "", "mean", "median", "p90", "p99");
  auto dist = [out](std::string_view name, const Distribution& d) {
    fmt::print(out, "{:<20}{:>12}{:>12}{:>12}{:>12}\n", name, fmt_number(d.mean), fmt_number(d.median),
               fmt_number(d.p90), fmt_number(d.p99));
  };
  dist("TTFT (ms)", m.ttft_ms);
  dist("TPOT (ms)", m.tpot_ms);
  dist("ITL (ms)", m.itl_ms);
  dist("E2E latency (ms)", m.e2e_ms);
  if (level.mixed) {
    dist(fmt::format("TTFT, {}-tok (ms)", options.input_len), level.short_prompts.ttft_ms);
    dist(fmt::format("ITL, {}-tok (ms)", options.input_len), level.short_prompts.itl_ms);
    dist(fmt::format("TTFT, {}-tok (ms)", options.long_input_len), level.long_prompts.ttft_ms);
    dist(fmt::format("ITL, {}-tok (ms)", options.long_input_len), level.long_prompts.itl_ms);
  }
  if (level.short_outputs)
    fmt::print(out, "note: {} requests returned fewer than {} tokens: the server may not honour ignore_eos\n",
               level.short_outputs, options.output_len);
  if (!m.failure_reasons.empty()) {
    fmt::print(out, "Failure reasons:\n");
    for (const auto& [reason, count] : m.failure_reasons) fmt::print(out, "  {} x {}\n", count, reason);
  }
  std::fflush(out);
}

// Speculative decoding's counters on the server's /metrics (kiln's names), when it exposes them.
struct SpecCounters {
  double drafted = 0, accepted = 0, verifies = 0, verified_tokens = 0;
  double steps = 0, step_draft_lengths = 0;  // steps with decoding sequences, and the sum of their chosen K
};

std::optional<SpecCounters> read_spec_counters(HttpClient& client) {
  HttpResponse r;
  try {
    r = client.get("/metrics");
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (r.status != 200) return std::nullopt;
  SpecCounters c;
  bool seen = false;
  std::istringstream lines(r.body);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) continue;
    const std::string name = line.substr(0, line.find('{') < space ? line.find('{') : space);
    double* field = name == "kiln:spec_draft_tokens_total"      ? &c.drafted
                    : name == "kiln:spec_accepted_tokens_total" ? &c.accepted
                    : name == "kiln:spec_accept_length_count"   ? &c.verifies
                    : name == "kiln:spec_accept_length_sum"     ? &c.verified_tokens
                    : name == "kiln:spec_step_draft_length_count" ? &c.steps
                    : name == "kiln:spec_step_draft_length_sum"   ? &c.step_draft_lengths
                                                                : nullptr;
    if (!field) continue;
    *field = std::strtod(line.c_str() + space + 1, nullptr);
    seen = true;
  }
  return seen ? std::optional<SpecCounters>(c) : std::nullopt;
}

// The level's mean accept length (tokens a sequence got per verify step: accepted drafts + 1) from the counters'
// difference over the level.
void print_spec_counters(std::FILE* out, const std::optional<SpecCounters>& before,
                         const std::optional<SpecCounters>& after) {
  if (!before || !after) return;
  const double verifies = after->verifies - before->verifies;
  const double drafted = after->drafted - before->drafted, accepted = after->accepted - before->accepted;
  if (verifies <= 0) {
    fmt::print(out, "{:<36}{}\n", "Speculative decoding:", "no verify steps in this level (server /metrics)");
  } else {
    fmt::print(out, "{:<36}{} ({} verify steps; {} of {} draft tokens accepted, {:.1f}%; server /metrics)\n",
               "Mean accept length (spec):", fmt_number((after->verified_tokens - before->verified_tokens) / verifies),
               static_cast<uint64_t>(verifies), static_cast<uint64_t>(accepted), static_cast<uint64_t>(drafted),
               drafted > 0 ? 100 * accepted / drafted : 0.0);
  }
  const double steps = after->steps - before->steps;  // servers before the per-step histogram report none
  if (steps > 0)
    fmt::print(out, "{:<36}{} ({} steps with decoding sequences)\n", "Mean draft length per step (spec):",
               fmt_number((after->step_draft_lengths - before->step_draft_lengths) / steps),
               static_cast<uint64_t>(steps));
  std::fflush(out);
}

void print_summary(std::FILE* out, const BenchReport& report) {
  const BenchOptions& options = report.options;
  const std::string what =
      dataset_mode(options)
          ? fmt::format(" Summary: {} endpoint, dataset {} ({} prompts), natural output lengths ", report.endpoint,
                        options.dataset_path, report.dataset_prompts)
          : fmt::format(" Summary: {} endpoint, input {} tokens, output {} tokens ", report.endpoint,
                        options.input_len, options.output_len);
  fmt::print(out, "\n{:=^120}\n", what);
  fmt::print(out, "{:>11} {:>8} {:>6} {:>8} {:>10} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n", "concurrency",
             "requests", "failed", "req/s", "out tok/s", "total tok/s", "TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms",
             "E2E p50 ms", "user tok/s");
  for (const auto& level : report.levels) {
    const BenchMetrics& m = level.metrics;
    fmt::print(out, "{:>11} {:>8} {:>6} {:>8} {:>10} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
               concurrency_name(level.max_concurrency), level.num_prompts, m.failed, fmt_number(m.request_throughput),
               fmt_number(m.output_throughput, 1), fmt_number(m.total_throughput, 1), fmt_number(m.ttft_ms.median),
               fmt_number(m.tpot_ms.median), fmt_number(m.itl_ms.median), fmt_number(m.e2e_ms.median, 1),
               fmt_number(m.per_user_tok_s_median_tpot, 1));
  }
  fmt::print(out, "(user tok/s = 1000 / median TPOT ms)\n");
  std::fflush(out);
}

// What every run starts with: the server answers, the report names it and the model (asked of the server when
// --model is not given).
template <class Report>
void start_report(const BenchOptions& options, HttpClient& client, Report& report) {
  require_reachable(client);
  report.options = options;
  report.url = options.server.display();
  report.model = options.model.empty() ? discover_model_name(client) : options.model;
}

// The prompt tokens' counter: a local tokenizer (--tokenizer), else the server's /tokenize.
std::unique_ptr<TokenCounter> make_token_counter(const BenchOptions& options, const std::string& model) {
  return options.tokenizer_dir.empty() ? make_server_token_counter(options.server, model)
                                       : make_local_token_counter(options.tokenizer_dir);
}

// The input tokens of a prompt sent as text or chat messages (the message contents; the chat template adds its own).
size_t count_text_tokens(TokenCounter& counter, const BenchPrompt& prompt, BenchEndpoint endpoint) {
  if (endpoint == BenchEndpoint::completions || prompt.messages.is_null()) return counter.tokenize(prompt.text).size();
  size_t n = 0;
  for (const auto& message : prompt.messages) {
    auto content = message.find("content");
    if (content == message.end()) continue;
    if (content->is_string()) {
      n += counter.tokenize(content->get<std::string>()).size();
    } else if (content->is_array()) {
      for (const auto& part : *content)
        if (part.is_object() && part.contains("text") && part["text"].is_string())
          n += counter.tokenize(part["text"].get<std::string>()).size();
    }
  }
  return n;
}

nlohmann::json distribution_json(const Distribution& d) {
  return {{"mean", d.mean}, {"median", d.median}, {"p90", d.p90}, {"p99", d.p99},
          {"min", d.min},   {"max", d.max},       {"count", d.count}};
}

}  // namespace

std::vector<size_t> parse_concurrency_list(std::string_view list) {
  std::vector<size_t> levels;
  size_t start = 0;
  while (true) {
    size_t comma = list.find(',', start);
    std::string item(trim(list.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start)));
    if (item == "inf" || item == "unlimited") {
      levels.push_back(0);
    } else {
      size_t value = 0;
      size_t used = 0;
      try {
        long long parsed = std::stoll(item, &used);
        if (parsed <= 0 || used != item.size()) throw std::invalid_argument("");
        value = static_cast<size_t>(parsed);
      } catch (const std::exception&) {
        fail("--max-concurrency: '{}' is not a positive integer (give a comma list like 1,4,16, or inf)", item);
      }
      levels.push_back(value);
    }
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return levels;
}

double parse_request_rate(std::string_view text) {
  std::string s(trim(text));
  if (s == "inf" || s == "unlimited") return std::numeric_limits<double>::infinity();
  try {
    size_t used = 0;
    double rate = std::stod(s, &used);
    if (used == s.size() && rate > 0 && std::isfinite(rate)) return rate;
  } catch (const std::exception&) {
  }
  fail("--request-rate: '{}' is not a positive number of requests per second (or inf)", text);
}

std::vector<double> poisson_arrival_times(size_t n, double rate, std::mt19937_64& rng) {
  std::vector<double> times(n, 0.0);
  if (std::isinf(rate)) return times;
  std::exponential_distribution<double> gap(rate);
  for (size_t i = 1; i < n; ++i) times[i] = times[i - 1] + gap(rng);
  return times;
}

size_t bench_prompt_len(const BenchOptions& options, size_t i) {
  return options.long_every > 0 && (i + 1) % options.long_every == 0 ? options.long_input_len : options.input_len;
}

size_t prompts_for_level(const BenchOptions& options, size_t max_concurrency) {
  if (options.num_prompts) return *options.num_prompts;
  if (max_concurrency == 0) return 64;
  return std::max<size_t>(16, 4 * max_concurrency);
}

namespace {

constexpr const char* kDatasetLayouts =
    "a JSON object with an \"items\" array, a JSON array of items, or JSONL (one JSON object per line)";

DatasetItem parse_dataset_item(const nlohmann::json& j, std::string where, const std::string& path) {
  if (!j.is_object())
    fail("{}: {} is not a JSON object (expected an item with \"prompt_ids\", \"prompt\" or \"messages\")", path,
         where);
  DatasetItem item;
  item.where = std::move(where);
  auto field = [&](const char* name) -> const nlohmann::json* {
    auto it = j.find(name);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  if (const auto* ids = field("prompt_ids")) {
    if (!ids->is_array() || ids->empty())
      fail("{}: {}: \"prompt_ids\" must be a non-empty array of token ids", path, item.where);
    std::vector<int64_t> v;
    for (const auto& id : *ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0)
        fail("{}: {}: \"prompt_ids\" holds {}, not a token id (a non-negative integer)", path, item.where, id.dump());
      v.push_back(id.get<int64_t>());
    }
    item.prompt_ids = std::move(v);
  }
  if (const auto* prompt = field("prompt")) {
    if (!prompt->is_string())
      fail("{}: {}: \"prompt\" must be a string (got {})", path, item.where, prompt->type_name());
    item.prompt = prompt->get<std::string>();
  }
  if (const auto* messages = field("messages")) {
    bool ok = messages->is_array() && !messages->empty();
    for (const auto& m : ok ? *messages : nlohmann::json::array()) ok = ok && m.is_object() && m.contains("role");
    if (!ok)
      fail("{}: {}: \"messages\" must be a non-empty array of chat messages ({{\"role\": ..., \"content\": ...}})",
           path, item.where);
    item.messages = *messages;
  }
  if (const auto* thinking = field("enable_thinking")) {
    if (!thinking->is_boolean())
      fail("{}: {}: \"enable_thinking\" must be true or false (got {})", path, item.where, thinking->dump());
    item.enable_thinking = thinking->get<bool>();
  }
  if (const auto* max_tokens = field("max_tokens")) {
    if (!max_tokens->is_number_integer() || max_tokens->get<int64_t>() <= 0)
      fail("{}: {}: \"max_tokens\" must be a positive integer (got {})", path, item.where, max_tokens->dump());
    item.max_tokens = max_tokens->get<size_t>();
  }
  if (!item.prompt_ids && !item.prompt && item.messages.is_null())
    fail("{}: {} has none of \"prompt_ids\", \"prompt\", \"messages\" (the fields kiln bench sends)", path, item.where);
  return item;
}

}  // namespace

std::vector<DatasetItem> parse_dataset(const std::string& text, const std::string& path) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) fail("{} is empty: expected {}", path, kDatasetLayouts);
  std::vector<DatasetItem> items;
  nlohmann::json root;
  std::string whole_error;
  try {
    root = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    whole_error = e.what();
  }
  if (whole_error.empty() && root.is_object() && root.contains("items")) {
    if (!root["items"].is_array()) fail("{}: \"items\" is not an array (expected {})", path, kDatasetLayouts);
    for (size_t i = 0; i < root["items"].size(); ++i)
      items.push_back(parse_dataset_item(root["items"][i], fmt::format("items[{}]", i), path));
  } else if (whole_error.empty() && root.is_array()) {
    for (size_t i = 0; i < root.size(); ++i) items.push_back(parse_dataset_item(root[i], fmt::format("[{}]", i), path));
  } else if (whole_error.empty() && !root.is_object()) {
    fail("{} holds a JSON {}, not a dataset: expected {}", path, root.type_name(), kDatasetLayouts);
  } else if (whole_error.empty() && !root.contains("prompt_ids") && !root.contains("prompt") &&
             !root.contains("messages")) {
    fail("{} is a JSON object without an \"items\" array: expected {}", path, kDatasetLayouts);
  } else if (!whole_error.empty() && text[first] != '{') {
    fail("{} is not valid JSON: {} (expected {})", path, whole_error, kDatasetLayouts);
  } else {
    // JSONL (a one-line file is also one JSON object).
    std::istringstream lines(text);
    size_t line_no = 0;
    for (std::string line; std::getline(lines, line);) {
      ++line_no;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        fail("{} line {} is not valid JSON: {} (expected {})", path, line_no, e.what(), kDatasetLayouts);
      }
      items.push_back(parse_dataset_item(j, fmt::format("line {}", line_no), path));
    }
  }
  if (items.empty()) fail("{} holds no items: expected {}", path, kDatasetLayouts);
  return items;
}

std::vector<DatasetItem> load_dataset(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) fail("cannot open --dataset-path {}: {}", path, std::strerror(errno));
  std::ostringstream text;
  text << file.rdbuf();
  return parse_dataset(text.str(), path);
}

std::vector<DatasetItem> select_dataset_items(std::vector<DatasetItem> items, const BenchOptions& options) {
  if (options.dataset_shuffle) {
    std::mt19937_64 rng(options.seed);
    std::shuffle(items.begin(), items.end(), rng);
  }
  if (options.num_prompts) {
    if (*options.num_prompts == 0) fail("--num-prompts must be at least 1");
    if (*options.num_prompts > items.size())
      fail("--num-prompts {} is more than the {} items of {}: pass at most {}", *options.num_prompts, items.size(),
           options.dataset_path, items.size());
    items.resize(*options.num_prompts);
  }
  return items;
}

BenchPrompt dataset_prompt(const DatasetItem& item, const BenchOptions& options) {
  BenchPrompt p;
  p.max_tokens = item.max_tokens.value_or(options.output_len);
  if (options.endpoint == BenchEndpoint::completions) {
    if (item.prompt_ids) {
      p.prompt_ids = *item.prompt_ids;
      p.input_tokens = p.prompt_ids.size();
    } else if (item.prompt) {
      p.text = *item.prompt;
    } else {
      fail("{}: {} has neither \"prompt_ids\" nor \"prompt\", which --endpoint completions sends (it has "
           "\"messages\": pass --endpoint chat)",
           options.dataset_path, item.where);
    }
  } else {
    if (!item.messages.is_null()) {
      p.messages = item.messages;
      p.enable_thinking = item.enable_thinking;
    } else if (item.prompt) {
      p.text = *item.prompt;
    } else {
      fail("{}: {} has neither \"messages\" nor \"prompt\", which --endpoint chat sends (it has only "
           "\"prompt_ids\": pass --endpoint completions)",
           options.dataset_path, item.where);
    }
  }
  return p;
}

nlohmann::json BenchReport::to_json() const {
  nlohmann::json j = {{"tool", "kiln bench"},
                      {"url", url},
                      {"model", model},
                      {"endpoint", endpoint},
                      {"mode", dataset_mode(options) ? "dataset" : "random"},
                      {"dataset", dataset_mode(options) ? nlohmann::json{{"path", options.dataset_path},
                                                                         {"num_prompts", dataset_prompts},
                                                                         {"shuffled", options.dataset_shuffle}}
                                                        : nlohmann::json(nullptr)},
                      {"input_len",
                       dataset_mode(options) ? nlohmann::json(nullptr) : nlohmann::json(options.input_len)},
                      {"long_input_len", options.long_input_len},
                      {"long_every", options.long_every},
                      {"output_len", options.output_len},
                      {"request_rate", std::isinf(options.request_rate) ? nlohmann::json("inf")
                                                                        : nlohmann::json(options.request_rate)},
                      {"temperature", options.temperature},
                      {"ignore_eos", !dataset_mode(options)},
                      {"seed", options.seed},
                      {"prompt_tokens_counted_by", prompt_tokens_counted_by},
                      {"passed", passed},
                      {"failure", failure}};
  j["levels"] = nlohmann::json::array();
  for (const auto& level : levels) {
    const BenchMetrics& m = level.metrics;
    nlohmann::json reasons = nlohmann::json::object();
    for (const auto& [reason, count] : m.failure_reasons) reasons[reason] = count;
    j["levels"].push_back({
        {"max_concurrency", level.max_concurrency == 0 ? nlohmann::json(nullptr) : nlohmann::json(level.max_concurrency)},
        {"num_prompts", level.num_prompts},
        {"completed", m.completed},
        {"failed", m.failed},
        {"failure_reasons", reasons},
        {"duration_s", m.duration_s},
        {"total_input_tokens", m.total_input_tokens},
        {"total_output_tokens", m.total_output_tokens},
        {"output_tokens_counted_from", token_source(m)},
        {"short_outputs", level.short_outputs},
        {"request_throughput", m.request_throughput},
        {"output_throughput", m.output_throughput},
        {"total_throughput", m.total_throughput},
        {"per_user_tok_s", {{"from_mean_tpot", m.per_user_tok_s_mean_tpot},
                            {"from_median_tpot", m.per_user_tok_s_median_tpot}}},
        {"ttft_ms", distribution_json(m.ttft_ms)},
        {"tpot_ms", distribution_json(m.tpot_ms)},
        {"itl_ms", distribution_json(m.itl_ms)},
        {"e2e_ms", distribution_json(m.e2e_ms)},
    });
    if (level.mixed) {
      auto part = [&](const BenchMetrics& pm, size_t len) {
        return nlohmann::json{{"input_len", len},
                              {"completed", pm.completed},
                              {"ttft_ms", distribution_json(pm.ttft_ms)},
                              {"itl_ms", distribution_json(pm.itl_ms)},
                              {"tpot_ms", distribution_json(pm.tpot_ms)}};
      };
      j["levels"].back()["short_prompts"] = part(level.short_prompts, options.input_len);
      j["levels"].back()["long_prompts"] = part(level.long_prompts, options.long_input_len);
    }
  }
  return j;
}

namespace {

std::string concurrency_list(const BenchOptions& options) {
  std::string s;
  for (size_t c : options.max_concurrency) s += (s.empty() ? "" : ",") + concurrency_name(c);
  return s;
}

std::string sampling_text(const BenchOptions& options) {
  return options.temperature == 0 ? "greedy" : fmt::format("temperature {:g}", options.temperature);
}

// Random mode: distinct prompts of exact lengths for every level (across levels too, so no level gains from the
// prefix cache of another), and the warm-up's.
std::vector<std::vector<BenchPrompt>> random_level_prompts(const BenchOptions& options, BenchReport& report,
                                                           BenchPrompt& warmup, std::FILE* out) {
  const std::unique_ptr<TokenCounter> counter = make_token_counter(options, report.model);
  report.prompt_tokens_counted_by = counter->describe();
  fmt::print(out, "random prompts of exactly {} tokens (counted by {}), {} output tokens each (ignore_eos), {}, "
             "request rate {}, max concurrency {}\n",
             options.input_len, report.prompt_tokens_counted_by, options.output_len, sampling_text(options),
             std::isinf(options.request_rate) ? "inf" : fmt_number(options.request_rate), concurrency_list(options));
  if (options.long_every > 0)
    fmt::print(out, "mixed load: every {}th request of a level sends {} prompt tokens instead\n", options.long_every,
               options.long_input_len);
  if (options.endpoint == BenchEndpoint::chat)
    fmt::print(out, "(chat: the input length is the user message's; the chat template adds its own tokens, and the "
               "input totals below are the server's usage.prompt_tokens when it reports them)\n");
  std::fflush(out);

  std::mt19937_64 prompt_rng(options.seed);
  auto random_prompt = [&](size_t input_len, size_t max_tokens) {
    BenchPrompt p;
    p.text = prompt_of_exact_length(*counter, input_len, prompt_rng);
    p.input_tokens = input_len;
    p.max_tokens = max_tokens;
    return p;
  };
  const auto build_start = Clock::now();
  warmup = random_prompt(options.input_len, std::min(options.output_len, kWarmupOutputTokens));
  std::vector<std::vector<BenchPrompt>> levels;
  size_t total = 1;
  for (size_t c : options.max_concurrency) {
    std::vector<BenchPrompt> prompts;
    for (size_t i = 0, n = prompts_for_level(options, c); i < n; ++i)
      prompts.push_back(random_prompt(bench_prompt_len(options, i), options.output_len));
    total += prompts.size();
    levels.push_back(std::move(prompts));
  }
  fmt::print(out, "built {} prompts in {:.1f} s\n", total,
             std::chrono::duration<double>(Clock::now() - build_start).count());
  return levels;
}

// Dataset mode: what the file's selected items send (read before the server is asked anything, so a bad file
// fails first).
std::vector<BenchPrompt> read_dataset_prompts(const BenchOptions& options) {
  std::vector<BenchPrompt> prompts;
  for (const auto& item : select_dataset_items(load_dataset(options.dataset_path), options))
    prompts.push_back(dataset_prompt(item, options));
  return prompts;
}

// Dataset mode: the prompts counted, the same at every level; the warm-up sends the first of them.
std::vector<std::vector<BenchPrompt>> dataset_level_prompts(const BenchOptions& options,
                                                            std::vector<BenchPrompt> prompts, BenchReport& report,
                                                            BenchPrompt& warmup, std::FILE* out) {
  size_t from_ids = 0, longest_output = 0;
  for (const auto& p : prompts) {
    if (!p.prompt_ids.empty()) ++from_ids;
    longest_output = std::max(longest_output, p.max_tokens);
  }
  // Text prompts are counted with a tokenizer; token-id prompts need none.
  std::string counted_by = from_ids > 0 ? "the length of prompt_ids" : "";
  if (from_ids < prompts.size()) {
    const std::unique_ptr<TokenCounter> counter = make_token_counter(options, report.model);
    for (auto& p : prompts)
      if (p.prompt_ids.empty()) p.input_tokens = count_text_tokens(*counter, p, options.endpoint);
    counted_by = (counted_by.empty() ? "" : counted_by + " and ") + counter->describe();
  }
  report.prompt_tokens_counted_by = counted_by;
  report.dataset_prompts = prompts.size();
  fmt::print(out, "dataset {}: {} prompts{}, natural output lengths (at most {} tokens), {}; input tokens counted by "
             "{}; request rate {}, max concurrency {}\n",
             options.dataset_path, prompts.size(),
             options.dataset_shuffle ? fmt::format(" (shuffled, seed {})", options.seed) : "",
             longest_output, sampling_text(options), counted_by,
             std::isinf(options.request_rate) ? "inf" : fmt_number(options.request_rate), concurrency_list(options));
  if (options.max_concurrency.size() > 1)
    fmt::print(out, "(every level sends the same {} prompts: a prefix cache may serve a later level's prompts from "
               "an earlier one's)\n", prompts.size());
  std::fflush(out);
  warmup = prompts.front();
  warmup.max_tokens = std::min(warmup.max_tokens, kWarmupOutputTokens);
  return std::vector<std::vector<BenchPrompt>>(options.max_concurrency.size(), prompts);
}

}  // namespace

BenchReport run_bench(const BenchOptions& options, std::FILE* out) {
  if (options.output_len == 0) fail("--output-len must be at least 1");
  if (options.max_concurrency.empty()) fail("--max-concurrency names no level");
  if (!(options.max_failed_fraction >= 0 && options.max_failed_fraction <= 1))
    fail("--max-failed-fraction must be between 0 and 1 (got {})", options.max_failed_fraction);
  if (!(options.temperature >= 0 && std::isfinite(options.temperature)))
    fail("--temperature must be 0 (greedy) or more (got {})", options.temperature);
  if ((options.long_every > 0) != (options.long_input_len > 0))
    fail("--long-input-len and --long-every go together (got {} and {})", options.long_input_len, options.long_every);
  if (dataset_mode(options) && options.long_every > 0)
    fail("--long-input-len / --long-every and --dataset-path do not go together: the mixed load sends random prompts "
         "of two lengths; drop one of them");
  std::vector<BenchPrompt> dataset_prompts;
  if (dataset_mode(options)) dataset_prompts = read_dataset_prompts(options);
  HttpClient client(options.server);
  BenchReport report;
  start_report(options, client, report);
  report.endpoint = options.endpoint == BenchEndpoint::chat ? "chat" : "completions";
  fmt::print(out, "kiln bench: {} (model \"{}\"), POST {} streamed\n", report.url, report.model,
             endpoint_path(options.endpoint));

  BenchPrompt warmup_prompt;
  const std::vector<std::vector<BenchPrompt>> level_prompts =
      dataset_mode(options) ? dataset_level_prompts(options, std::move(dataset_prompts), report, warmup_prompt, out)
                            : random_level_prompts(options, report, warmup_prompt, out);

  RequestRecord warmup = measure_request(client, options, report.model, warmup_prompt);
  if (!warmup.ok)
    fail("the warm-up request to {}{} failed: {} (check the server with `kiln smoke --url {}`)", report.url,
         endpoint_path(options.endpoint), warmup.error, report.url);
  fmt::print(out, "warm-up request: TTFT {:.1f} ms, {} tokens in {:.1f} ms\n", warmup.ttft_s * 1000,
             warmup.output_tokens, warmup.e2e_s * 1000);
  std::fflush(out);

  std::mt19937_64 arrival_rng(options.seed ^ 0x9E3779B97F4A7C15ull);
  for (size_t li = 0; li < options.max_concurrency.size(); ++li) {
    size_t c = options.max_concurrency[li];
    const std::optional<SpecCounters> spec_before = read_spec_counters(client);
    LevelResult level = run_level(options, report.model, level_prompts[li], c, arrival_rng);
    print_level(out, options, level);
    print_spec_counters(out, spec_before, read_spec_counters(client));
    report.levels.push_back(level);
    const BenchMetrics& m = level.metrics;
    double failed_fraction = static_cast<double>(m.failed) / static_cast<double>(level.num_prompts);
    if (m.completed == 0 || failed_fraction > options.max_failed_fraction) {
      auto top = std::max_element(m.failure_reasons.begin(), m.failure_reasons.end(),
                                  [](auto& a, auto& b) { return a.second < b.second; });
      report.passed = false;
      report.failure = fmt::format(
          "at max concurrency {}, {} of {} requests failed ({:.0f}%, more than --max-failed-fraction {:g}); "
          "most common reason: {}",
          concurrency_name(c), m.failed, level.num_prompts, 100 * failed_fraction, options.max_failed_fraction,
          top == m.failure_reasons.end() ? "none" : top->first);
      break;
    }
  }
  if (report.levels.size() > 1 || report.passed) print_summary(out, report);
  return report;
}

nlohmann::json MultiTurnReport::to_json() const {
  nlohmann::json j = {{"tool", "kiln bench --multi-turn"},
                      {"url", url},
                      {"model", model},
                      {"input_len", options.input_len},
                      {"output_len", options.output_len},
                      {"turns", options.multi_turn},
                      {"conversations", options.conversations},
                      {"seed", options.seed},
                      {"prompt_tokens_counted_by", prompt_tokens_counted_by},
                      {"passed", passed},
                      {"failure", failure}};
  j["per_turn"] = nlohmann::json::array();
  for (const auto& t : turns) {
    nlohmann::json reasons = nlohmann::json::object();
    for (const auto& [reason, count] : t.failure_reasons) reasons[reason] = count;
    j["per_turn"].push_back({{"turn", t.turn},
                             {"completed", t.completed},
                             {"failed", t.failed},
                             {"failure_reasons", reasons},
                             {"mean_prompt_tokens", t.mean_prompt_tokens},
                             {"mean_cached_tokens", t.mean_cached_tokens},
                             {"ttft_ms", distribution_json(t.ttft_ms)},
                             {"e2e_ms", distribution_json(t.e2e_ms)},
                             {"output_throughput", t.output_throughput}});
  }
  return j;
}

MultiTurnReport run_multi_turn_bench(const BenchOptions& options, std::FILE* out) {
  if (options.multi_turn == 0) fail("--multi-turn must be at least 1");
  if (options.conversations == 0) fail("--conversations must be at least 1");
  if (options.conversations > kMaxThreads)
    fail("--conversations {} is more than kiln bench supports ({})", options.conversations, kMaxThreads);
  if (options.output_len == 0) fail("--output-len must be at least 1");
  if (!(options.temperature >= 0 && std::isfinite(options.temperature)))
    fail("--temperature must be 0 (greedy) or more (got {})", options.temperature);
  if (options.endpoint != BenchEndpoint::completions)
    fail("--multi-turn sends the history as the prompt of /v1/completions; leave --endpoint at completions");
  if (dataset_mode(options))
    fail("--multi-turn and --dataset-path do not go together: multi-turn conversations are built of random "
         "messages; drop one of them");
  HttpClient client(options.server);
  MultiTurnReport report;
  start_report(options, client, report);
  const std::unique_ptr<TokenCounter> counter = make_token_counter(options, report.model);
  report.prompt_tokens_counted_by = counter->describe();
  const size_t T = options.multi_turn, N = options.conversations;
  fmt::print(out, "kiln bench --multi-turn: {} (model \"{}\"), POST /v1/completions streamed\n", report.url,
             report.model);
  fmt::print(out, "{} conversations at once x {} turns; each turn sends the history + a new message of {} tokens "
             "(counted by {}), {} output tokens (ignore_eos)\n",
             N, T, options.input_len, report.prompt_tokens_counted_by, options.output_len);
  std::fflush(out);
  // Every conversation's messages drawn up front (distinct across conversations).
  std::mt19937_64 rng(options.seed);
  std::vector<std::vector<std::string>> messages(N);
  for (auto& conv : messages)
    for (size_t t = 0; t < T; ++t) conv.push_back(prompt_of_exact_length(*counter, options.input_len, rng));

  struct Turn {
    bool ok = false;
    std::string error;
    double start_s = 0, end_s = 0, ttft_s = 0;
    int64_t prompt_tokens = 0, output_tokens = 0, cached_tokens = 0;
  };
  std::vector<std::vector<Turn>> results(N, std::vector<Turn>(T));
  const auto start = Clock::now();
  auto since = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  auto worker = [&](size_t c) {
    std::optional<HttpClient> http;
    std::string history;
    for (size_t t = 0; t < T; ++t) {
      Turn& r = results[c][t];
      history += messages[c][t];
      try {
        if (!http) http.emplace(options.server);
        r.start_s = since();
        BenchPrompt prompt;
        prompt.text = history;
        prompt.max_tokens = options.output_len;
        Generation g = run_generation(*http, "/v1/completions", request_body(options, report.model, prompt));
        r.end_s = since();
        if (!g.ok) {
          r.error = g.error;
        } else if (g.token_times_s.empty()) {
          r.error = "no tokens streamed";
        } else {
          r.ok = true;
          r.ttft_s = g.token_times_s.front();
          r.prompt_tokens = g.prompt_tokens.value_or(0);
          r.cached_tokens = g.cached_tokens.value_or(0);
          r.output_tokens = g.completion_tokens.value_or(static_cast<int64_t>(g.token_times_s.size()));
          history += g.content;
        }
      } catch (const std::exception& e) {
        r.error = e.what();
      }
      if (!r.ok) break;  // a conversation without its answer cannot go on
    }
  };
  std::vector<std::thread> threads;
  for (size_t c = 0; c < N; ++c) threads.emplace_back(worker, c);
  for (auto& th : threads) th.join();

  fmt::print(out, "\n{:>5} {:>9} {:>7} {:>12} {:>12} {:>13} {:>13} {:>13} {:>11}\n", "turn", "completed", "failed",
             "prompt tok", "cached tok", "TTFT mean ms", "TTFT p50 ms", "E2E mean ms", "out tok/s");
  for (size_t t = 0; t < T; ++t) {
    TurnResult tr;
    tr.turn = t + 1;
    std::vector<double> ttft, e2e;
    double first = 0, last = 0, prompt_sum = 0, cached_sum = 0;
    int64_t out_tokens = 0;
    for (size_t c = 0; c < N; ++c) {
      const Turn& r = results[c][t];
      if (r.ok) {
        if (tr.completed == 0 || r.start_s < first) first = r.start_s;
        last = std::max(last, r.end_s);
        ++tr.completed;
        ttft.push_back(r.ttft_s * 1000);
        e2e.push_back((r.end_s - r.start_s) * 1000);
        prompt_sum += static_cast<double>(r.prompt_tokens);
        cached_sum += static_cast<double>(r.cached_tokens);
        out_tokens += r.output_tokens;
      } else if (!r.error.empty()) {
        ++tr.failed;
        ++tr.failure_reasons[r.error];
      }
    }
    tr.ttft_ms = describe(ttft);
    tr.e2e_ms = describe(e2e);
    tr.mean_prompt_tokens = tr.completed ? prompt_sum / static_cast<double>(tr.completed) : 0;
    tr.mean_cached_tokens = tr.completed ? cached_sum / static_cast<double>(tr.completed) : 0;
    tr.output_throughput = last > first ? static_cast<double>(out_tokens) / (last - first) : 0;
    fmt::print(out, "{:>5} {:>9} {:>7} {:>12} {:>12} {:>13} {:>13} {:>13} {:>11}\n", tr.turn, tr.completed, tr.failed,
               fmt_number(tr.mean_prompt_tokens, 0), fmt_number(tr.mean_cached_tokens, 0), fmt_number(tr.ttft_ms.mean),
               fmt_number(tr.ttft_ms.median),
               fmt_number(tr.e2e_ms.mean, 1), fmt_number(tr.output_throughput, 1));
    if (tr.failed && report.passed) {
      report.passed = false;
      report.failure = fmt::format("turn {}: {} of {} requests failed: {}", tr.turn, tr.failed, N,
                                   tr.failure_reasons.begin()->first);
    }
    report.turns.push_back(std::move(tr));
  }
  fmt::print(out, "(prompt tok / cached tok: the server's usage.prompt_tokens / prompt_tokens_details.cached_tokens, "
             "means; out tok/s: the turn's output tokens over "
             "the span from its first request to its last answer)\n");
  std::fflush(out);
  return report;
}

}  // namespace kiln::clients
