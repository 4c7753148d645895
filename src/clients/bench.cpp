#include "clients/bench.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cmath>
#include <condition_variable>
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

nlohmann::json request_body(const BenchOptions& options, const std::string& model, const std::string& prompt,
                            size_t output_len) {
  GenerationParams params;
  params.max_tokens = static_cast<int>(output_len);
  params.temperature = 0.0;
  params.ignore_eos = true;
  params.stream = true;
  return options.endpoint == BenchEndpoint::chat ? chat_request(model, prompt, params)
                                                 : completion_request(model, prompt, params);
}

RequestRecord measure_request(HttpClient& client, const BenchOptions& options, const std::string& model,
                              const std::string& prompt, size_t input_len, size_t output_len) {
  Generation g = run_generation(client, endpoint_path(options.endpoint), request_body(options, model, prompt, output_len));
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
  record.input_tokens = g.prompt_tokens ? *g.prompt_tokens : static_cast<int64_t>(input_len);
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

LevelResult run_level(const BenchOptions& options, const std::string& model, const std::vector<std::string>& prompts,
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
        records[i] = measure_request(*client, options, model, prompts[i], bench_prompt_len(options, i),
                                     options.output_len);
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
  for (const auto& r : records)
    if (r.ok && r.output_tokens < static_cast<int64_t>(options.output_len)) ++level.short_outputs;
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
  std::fflush(out);
}

void print_summary(std::FILE* out, const BenchReport& report) {
  fmt::print(out, "\n{:=^120}\n",
             fmt::format(" Summary: {} endpoint, input {} tokens, output {} tokens ", report.endpoint,
                         report.options.input_len, report.options.output_len));
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
// --model is not given), and the prompt tokens' counter (a local tokenizer, else the server's).
template <class Report>
std::unique_ptr<TokenCounter> start_report(const BenchOptions& options, HttpClient& client, Report& report) {
  require_reachable(client);
  report.options = options;
  report.url = options.server.display();
  report.model = options.model.empty() ? discover_model_name(client) : options.model;
  std::unique_ptr<TokenCounter> counter = options.tokenizer_dir.empty()
                                              ? make_server_token_counter(options.server, report.model)
                                              : make_local_token_counter(options.tokenizer_dir);
  report.prompt_tokens_counted_by = counter->describe();
  return counter;
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

nlohmann::json BenchReport::to_json() const {
  nlohmann::json j = {{"tool", "kiln bench"},
                      {"url", url},
                      {"model", model},
                      {"endpoint", endpoint},
                      {"input_len", options.input_len},
                      {"long_input_len", options.long_input_len},
                      {"long_every", options.long_every},
                      {"output_len", options.output_len},
                      {"request_rate", std::isinf(options.request_rate) ? nlohmann::json("inf")
                                                                        : nlohmann::json(options.request_rate)},
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

BenchReport run_bench(const BenchOptions& options, std::FILE* out) {
  if (options.output_len == 0) fail("--output-len must be at least 1");
  if (options.max_concurrency.empty()) fail("--max-concurrency names no level");
  if (!(options.max_failed_fraction >= 0 && options.max_failed_fraction <= 1))
    fail("--max-failed-fraction must be between 0 and 1 (got {})", options.max_failed_fraction);
  if ((options.long_every > 0) != (options.long_input_len > 0))
    fail("--long-input-len and --long-every go together (got {} and {})", options.long_input_len, options.long_every);
  HttpClient client(options.server);
  BenchReport report;
  const std::unique_ptr<TokenCounter> counter = start_report(options, client, report);
  report.endpoint = options.endpoint == BenchEndpoint::chat ? "chat" : "completions";

  size_t total_prompts = 0;
  for (size_t c : options.max_concurrency) total_prompts += prompts_for_level(options, c);
  fmt::print(out, "kiln bench: {} (model \"{}\"), POST {} streamed\n", report.url, report.model,
             endpoint_path(options.endpoint));
  fmt::print(out, "random prompts of exactly {} tokens (counted by {}), {} output tokens each (ignore_eos), "
             "request rate {}, max concurrency {}\n",
             options.input_len, report.prompt_tokens_counted_by, options.output_len,
             std::isinf(options.request_rate) ? "inf" : fmt_number(options.request_rate),
             [&] {
               std::string s;
               for (size_t c : options.max_concurrency) s += (s.empty() ? "" : ",") + concurrency_name(c);
               return s;
             }());
  if (options.long_every > 0)
    fmt::print(out, "mixed load: every {}th request of a level sends {} prompt tokens instead\n", options.long_every,
               options.long_input_len);
  if (options.endpoint == BenchEndpoint::chat)
    fmt::print(out, "(chat: the input length is the user message's; the chat template adds its own tokens, and the "
               "input totals below are the server's usage.prompt_tokens when it reports them)\n");
  std::fflush(out);

  // Every prompt distinct (across levels too), so no level gains from the prefix cache of another.
  std::mt19937_64 prompt_rng(options.seed);
  std::string warmup_prompt = prompt_of_exact_length(*counter, options.input_len, prompt_rng);
  std::vector<std::vector<std::string>> level_prompts;
  auto build_start = Clock::now();
  for (size_t c : options.max_concurrency) {
    std::vector<std::string> prompts;
    for (size_t i = 0, n = prompts_for_level(options, c); i < n; ++i)
      prompts.push_back(prompt_of_exact_length(*counter, bench_prompt_len(options, i), prompt_rng));
    level_prompts.push_back(std::move(prompts));
  }
  fmt::print(out, "built {} prompts in {:.1f} s\n", total_prompts + 1,
             std::chrono::duration<double>(Clock::now() - build_start).count());

  RequestRecord warmup = measure_request(client, options, report.model, warmup_prompt, options.input_len,
                                         std::min(options.output_len, kWarmupOutputTokens));
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
  if (options.endpoint != BenchEndpoint::completions)
    fail("--multi-turn sends the history as the prompt of /v1/completions; leave --endpoint at completions");
  HttpClient client(options.server);
  MultiTurnReport report;
  const std::unique_ptr<TokenCounter> counter = start_report(options, client, report);
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
        Generation g = run_generation(*http, "/v1/completions", request_body(options, report.model, history,
                                                                             options.output_len));
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
