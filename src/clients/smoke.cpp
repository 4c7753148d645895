#include "clients/smoke.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <functional>
#include <thread>

#include "clients/display.h"
#include "clients/guards.h"
#include "clients/openai.h"
#include "core/error.h"

namespace kiln::clients {

namespace {

constexpr const char* kChatPath = "/v1/chat/completions";
// The prompts of the seed deployment's smoke script: short, so that small models are judged on the skill.
constexpr const char* kSimplePrompt = "Reply with just OK";
constexpr const char* kMathPrompt = "What is 17 x 19?";
constexpr const char* kDeterminismPrompt =
    "Write one paragraph of about 80 words about the history of the number zero.";
constexpr const char* kThroughputPrompt =
    "Write a long, detailed story about a lighthouse keeper on a remote island. Make it at least 2000 words long.";
constexpr int kThroughputTokens = 512;
constexpr size_t kEvidenceChars = 100;

struct Context {
  HttpClient& client;
  const SmokeOptions& options;
  std::string model;
};

// The problems one check found; it passes when there are none.
struct Problems {
  std::vector<std::string> list;
  void add(std::string why) { list.push_back(std::move(why)); }
  void add_if(const std::optional<std::string>& why) {
    if (why) list.push_back(*why);
  }
};

std::string join(const std::vector<std::string>& parts, std::string_view separator) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += separator;
    out += parts[i];
  }
  return out;
}

// Where two texts first differ, with a few characters of each from there.
std::string describe_difference(std::string_view a, std::string_view b) {
  size_t at = 0;
  while (at < a.size() && at < b.size() && a[at] == b[at]) ++at;
  size_t from = at > 20 ? at - 20 : 0;
  return fmt::format("differ at byte {}: {} vs {}", at, quote_for_display(a.substr(from), 50),
                     quote_for_display(b.substr(from), 50));
}

nlohmann::json answer_json(const Generation& g) {
  nlohmann::json j = {{"content", g.content},
                      {"reasoning", g.reasoning},
                      {"reasoning_field", g.reasoning_field},
                      {"finish_reason", g.finish_reason}};
  if (g.completion_tokens) j["completion_tokens"] = *g.completion_tokens;
  if (!g.ok) j["error"] = g.error;
  return j;
}

// Evidence lines for one answer: its content, its reasoning (and under which name), how it ended.
void add_answer_evidence(CheckResult& result, const Generation& g, std::string_view label = "") {
  std::string prefix = label.empty() ? "" : std::string(label) + ": ";
  if (!g.ok) {
    result.evidence.push_back(prefix + "error: " + g.error);
    return;
  }
  std::string content = g.content_null ? "null" : quote_for_display(g.content, kEvidenceChars);
  result.evidence.push_back(prefix + "content=" + content);
  if (!g.reasoning.empty())
    result.evidence.push_back(prefix + g.reasoning_field + "=" + quote_for_display(g.reasoning, kEvidenceChars));
  if (!g.finish_reason.empty() && g.finish_reason != "stop")
    result.evidence.push_back(prefix + "finish_reason=" + g.finish_reason);
}

// The guards on both fields of an answer; reasoning may be empty.
void guard_answer(Problems& problems, const Generation& g, std::string_view label = "") {
  std::string prefix = label.empty() ? "" : std::string(label) + " ";
  if (!g.ok) {
    problems.add(prefix + "request failed: " + g.error);
    return;
  }
  if (auto why = check_output(g.content, prefix + "content")) {
    if (g.content.empty() && g.finish_reason == "length")
      problems.add(*why + " (finish_reason=length: max_tokens ran out before the answer)");
    else
      problems.add(*why);
  }
  problems.add_if(check_output(g.reasoning, prefix + "reasoning", /*allow_empty=*/true));
}

// Splits text at the first end-of-turn marker of the common chat formats (ChatML, Llama 3, Mistral, ...).
std::pair<std::string_view, std::string_view> split_at_end_of_turn(std::string_view text) {
  size_t cut = std::string_view::npos;
  for (std::string_view marker : {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "</s>"})
    cut = std::min(cut, text.find(marker));
  if (cut == std::string_view::npos) return {text, {}};
  return {text.substr(0, cut), text.substr(cut)};
}

bool rejects_length(const Generation& g) {
  if (g.ok || !g.error.starts_with("HTTP 400")) return false;
  std::string lower = g.error;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return lower.find("max_tokens") != std::string::npos || lower.find("context") != std::string::npos;
}

// A chat request. A server with a short context rejects a large max_tokens (HTTP 400): then it is
// halved, down to 256, and the evidence says so.
Generation chat(Context& ctx, CheckResult& result, const std::string& prompt, GenerationParams params) {
  Generation g = run_generation(ctx.client, kChatPath, chat_request(ctx.model, prompt, params));
  while (rejects_length(g) && params.max_tokens > 256) {
    params.max_tokens = std::max(256, params.max_tokens / 2);
    std::string note = fmt::format("max_tokens lowered to {} ({})", params.max_tokens, g.error);
    if (std::find(result.evidence.begin(), result.evidence.end(), note) == result.evidence.end())
      result.evidence.push_back(note);
    g = run_generation(ctx.client, kChatPath, chat_request(ctx.model, prompt, params));
  }
  return g;
}

void check_model_info(Context& ctx, CheckResult& result, Problems& problems) {
  std::vector<std::string> failures;
  for (const char* path : {"/get_model_info", "/model_info"}) {
    HttpResponse response = ctx.client.get(path);
    auto root = response.ok() ? nlohmann::json::parse(response.body, nullptr, false) : nlohmann::json();
    if (!response.ok() || !root.is_object()) {
      failures.push_back(fmt::format("GET {}: {}", path,
                                     response.ok() ? "not a JSON object" : response.describe_failure()));
      continue;
    }
    result.details["source"] = path;
    result.details["model_info"] = root;
    std::string line = fmt::format("GET {}:", path);
    for (const char* key : {"model_path", "model_type", "architectures", "is_generation"})
      if (root.contains(key) && !root[key].is_null())
        line += fmt::format(" {}={}", key, root[key].dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    result.evidence.push_back(line);
    if (!root.contains("model_path") || !root["model_path"].is_string() || root["model_path"].get<std::string>().empty())
      problems.add(fmt::format("GET {} has no model_path", path));
    result.evidence.push_back("requests use model=" + quote_for_display(ctx.model));
    return;
  }
  HttpResponse response = ctx.client.get("/v1/models");
  auto root = response.ok() ? nlohmann::json::parse(response.body, nullptr, false) : nlohmann::json();
  if (root.is_object() && root.contains("data") && root["data"].is_array() && !root["data"].empty()) {
    std::vector<std::string> ids;
    for (const auto& m : root["data"])
      if (m.is_object() && m.contains("id") && m["id"].is_string()) ids.push_back(m["id"].get<std::string>());
    result.details["source"] = "/v1/models";
    result.details["models"] = root;
    result.evidence.push_back("GET /v1/models: " + join(ids, ", ") + " (no /get_model_info)");
    result.evidence.push_back("requests use model=" + quote_for_display(ctx.model));
    if (ids.empty()) problems.add("GET /v1/models lists no model id");
    return;
  }
  failures.push_back("GET /v1/models: " + (response.ok() ? std::string("no models listed") : response.describe_failure()));
  problems.add("no model information: " + join(failures, "; "));
}

void check_simple(Context& ctx, CheckResult& result, Problems& problems) {
  GenerationParams params;
  params.max_tokens = 1024;  // room for reasoning when the server thinks by default
  Generation g = chat(ctx, result, kSimplePrompt, params);
  add_answer_evidence(result, g);
  result.details["answer"] = answer_json(g);
  guard_answer(problems, g);
  if (g.ok && trim(g.content) != "OK")
    problems.add("expected the content to be exactly \"OK\", got " + quote_for_display(g.content, 60));
}

void check_math_no_think(Context& ctx, CheckResult& result, Problems& problems) {
  GenerationParams params;
  params.max_tokens = 256;
  params.enable_thinking = false;
  Generation g = chat(ctx, result, kMathPrompt, params);
  add_answer_evidence(result, g);
  result.details["answer"] = answer_json(g);
  guard_answer(problems, g);
  if (!g.ok) return;
  if (!trim(g.reasoning).empty())
    problems.add(fmt::format("thinking was off but the answer has {} ({} bytes)", g.reasoning_field, g.reasoning.size()));
  if (!contains_whole_number(g.content, "323"))
    problems.add("the content does not contain the answer 323: " + quote_for_display(g.content, 60));
}

void judge_thinking_answer(Problems& problems, const Generation& g, std::string_view label) {
  guard_answer(problems, g, label);
  if (!g.ok) return;
  if (trim(g.reasoning).empty())
    problems.add(fmt::format("{}: no reasoning in thinking mode (neither reasoning_content nor reasoning has text)",
                             label));
  if (!contains_whole_number(g.content, "323"))
    problems.add(fmt::format("{}: the content does not contain the answer 323: {}", label,
                             quote_for_display(g.content, 60)));
}

void check_math_think(Context& ctx, CheckResult& result, Problems& problems) {
  GenerationParams params;
  params.max_tokens = 4096;
  params.enable_thinking = true;
  Generation plain = chat(ctx, result, kMathPrompt, params);
  params.stream = true;
  Generation streamed = chat(ctx, result, kMathPrompt, params);
  add_answer_evidence(result, plain, "non-streamed");
  add_answer_evidence(result, streamed, "streamed");
  result.details["non_streamed"] = answer_json(plain);
  result.details["streamed"] = answer_json(streamed);
  judge_thinking_answer(problems, plain, "non-streamed");
  judge_thinking_answer(problems, streamed, "streamed");
  if (!plain.ok || !streamed.ok) return;
  // Servers strip the whitespace around the </think> split differently in the two modes.
  if (trim(plain.reasoning) != trim(streamed.reasoning))
    problems.add("streamed and non-streamed reasoning at temperature 0 " +
                 describe_difference(trim(plain.reasoning), trim(streamed.reasoning)));
  if (trim(plain.content) != trim(streamed.content))
    problems.add("streamed and non-streamed content at temperature 0 " +
                 describe_difference(trim(plain.content), trim(streamed.content)));
  if (problems.list.empty()) result.evidence.push_back("streamed deltas reassemble to the non-streamed answer");
}

void check_determinism(Context& ctx, CheckResult& result, Problems& problems) {
  GenerationParams params;
  params.max_tokens = 128;
  params.enable_thinking = false;
  params.seed = 1234;
  nlohmann::json body = chat_request(ctx.model, kDeterminismPrompt, params);
  std::vector<Generation> answers(6);
  for (int i = 0; i < 3; ++i) answers[i] = run_generation(ctx.client, kChatPath, body);
  std::vector<std::thread> threads;
  for (int i = 3; i < 6; ++i)
    threads.emplace_back([&, i] {
      try {
        HttpClient client(ctx.options.server);
        answers[i] = run_generation(client, kChatPath, body);
      } catch (const std::exception& e) {
        answers[i].error = e.what();
      }
    });
  for (auto& t : threads) t.join();

  // Answers 1-3 were sequential, 4-6 concurrent. Problems shared by several answers are reported once.
  std::vector<std::pair<std::string, std::vector<int>>> grouped;  // problem -> answer numbers
  auto note = [&](const std::string& problem, int i) {
    for (auto& [text, who] : grouped)
      if (text == problem) return who.push_back(i + 1);
    grouped.push_back({problem, {i + 1}});
  };
  result.details["answers"] = nlohmann::json::array();
  for (int i = 0; i < 6; ++i) {
    result.details["answers"].push_back(answer_json(answers[i]));
    Problems own;
    guard_answer(own, answers[i]);
    for (const auto& p : own.list) note(p, i);
  }
  add_answer_evidence(result, answers[0], "answer 1");
  size_t identical = 1;
  std::vector<int> differing;
  std::string first_difference;
  for (int i = 1; i < 6; ++i) {
    if (!answers[i].ok || !answers[0].ok) continue;
    if (answers[i].content == answers[0].content && answers[i].reasoning == answers[0].reasoning) {
      ++identical;
      continue;
    }
    differing.push_back(i + 1);
    if (first_difference.empty()) {
      const bool content_differs = answers[i].content != answers[0].content;
      first_difference = fmt::format("answer {} {} {}", i + 1, content_differs ? "content" : "reasoning",
                                     content_differs ? describe_difference(answers[0].content, answers[i].content)
                                                     : describe_difference(answers[0].reasoning, answers[i].reasoning));
    }
  }
  auto numbers = [](const std::vector<int>& who) {
    std::vector<std::string> parts;
    for (int n : who) parts.push_back(std::to_string(n));
    return (who.size() > 1 ? "answers " : "answer ") + join(parts, ",");
  };
  for (const auto& [text, who] : grouped) problems.add(numbers(who) + ": " + text);
  if (!differing.empty())
    problems.add(fmt::format("nondeterministic at temperature 0: {} of 6 differ from answer 1 (1-3 sequential, 4-6 "
                             "concurrent): {}; {}",
                             differing.size(), numbers(differing), first_difference));
  result.details["identical"] = identical;
  result.evidence.push_back(fmt::format("{} of 6 answers identical to answer 1 (1-3 sequential, 4-6 concurrent)", identical));
}

void check_throughput(Context& ctx, CheckResult& result, Problems& problems) {
  GenerationParams params;
  params.max_tokens = kThroughputTokens;
  params.enable_thinking = false;
  params.ignore_eos = true;
  params.skip_special_tokens = false;
  params.stream = true;
  Generation g = chat(ctx, result, kThroughputPrompt, params);
  bool ignore_eos_rejected = false;
  if (!g.ok && (g.error.starts_with("HTTP 400") || g.error.starts_with("HTTP 422"))) {
    // Servers that reject the ignore_eos extension: rely on the prompt asking for a long text.
    ignore_eos_rejected = true;
    result.evidence.push_back("ignore_eos rejected (" + g.error + "); retried without it");
    params.ignore_eos = false;
    g = chat(ctx, result, kThroughputPrompt, params);
  }
  if (params.ignore_eos) {
    // The answer is the text up to the model's end-of-turn token (kept in the text by
    // skip_special_tokens=false); what ignore_eos generated after it is not an answer, so only the
    // character guards apply there. A server that drops the marker gets the whole text judged.
    auto [answer, past] = split_at_end_of_turn(g.content);
    Generation head = g;
    head.content = std::string(answer);
    guard_answer(problems, head);
    if (auto why = check_bad_characters(past)) problems.add("content after the end of the answer: " + *why);
  } else {
    guard_answer(problems, g);
  }
  if (!g.ok) {
    add_answer_evidence(result, g);
    return;
  }
  const bool from_usage = g.completion_tokens.has_value();
  const int64_t tokens = from_usage ? *g.completion_tokens : static_cast<int64_t>(g.token_times_s.size());
  if (g.token_times_s.empty() || tokens < 2) {
    problems.add(fmt::format("too few tokens streamed to measure ({} tokens, {} chunks)", tokens, g.token_times_s.size()));
    add_answer_evidence(result, g);
    return;
  }
  const double ttft_s = g.token_times_s.front();
  const double tpot_s = (g.e2e_s - ttft_s) / static_cast<double>(tokens - 1);
  const double tok_s = static_cast<double>(tokens) / g.e2e_s;
  result.evidence.push_back(fmt::format("{:.1f} tok/s: {} tokens ({}) in {:.2f} s; TTFT {:.0f} ms, TPOT {:.2f} ms "
                                        "({:.1f} tok/s decode)",
                                        tok_s, tokens, from_usage ? "from usage" : "counted as streamed chunks",
                                        g.e2e_s, ttft_s * 1000, tpot_s * 1000, 1.0 / tpot_s));
  if (ctx.options.baseline_tok_s) {
    double ratio = tok_s / *ctx.options.baseline_tok_s;
    result.evidence.push_back(fmt::format("{:.2f}x the baseline of {:g} tok/s", ratio, *ctx.options.baseline_tok_s));
    result.details["baseline_tok_s"] = *ctx.options.baseline_tok_s;
    result.details["baseline_ratio"] = ratio;
  }
  if (tokens < kThroughputTokens)
    result.evidence.push_back(fmt::format("note: the server stopped after {} of {} tokens (finish_reason={}){}", tokens,
                                          kThroughputTokens, g.finish_reason,
                                          ignore_eos_rejected ? "" : ": it ignores ignore_eos"));
  add_answer_evidence(result, g);
  result.details["tokens"] = tokens;
  result.details["token_count_source"] = from_usage ? "usage" : "chunks";
  result.details["chunks"] = g.token_times_s.size();
  result.details["seconds"] = g.e2e_s;
  result.details["tok_s"] = tok_s;
  result.details["ttft_ms"] = ttft_s * 1000;
  result.details["tpot_ms"] = tpot_s * 1000;
  result.details["decode_tok_s"] = 1.0 / tpot_s;
  result.details["ignore_eos"] = !ignore_eos_rejected;
  result.details["answer"] = answer_json(g);
}

using CheckFn = std::function<void(Context&, CheckResult&, Problems&)>;

const std::vector<std::pair<std::string, CheckFn>>& check_table() {
  static const std::vector<std::pair<std::string, CheckFn>> table = {
      {"model-info", check_model_info},   {"simple", check_simple},           {"math-no-think", check_math_no_think},
      {"math-think", check_math_think},   {"determinism", check_determinism}, {"throughput", check_throughput}};
  return table;
}

constexpr int kNameWidth = 14;
constexpr int kEvidenceIndent = kNameWidth + 1 + 6 + 1 + 9 + 2;

void print_row(std::FILE* out, const CheckResult& r) {
  std::vector<std::string> lines;
  if (!r.passed) lines.push_back("why: " + r.reason);
  lines.insert(lines.end(), r.evidence.begin(), r.evidence.end());
  if (lines.empty()) lines.push_back("");
  fmt::print(out, "{:<{}} {:<6} {:>9}  {}\n", r.name, kNameWidth, r.passed ? "PASS" : "FAIL",
             fmt::format("{:.2f} s", r.seconds), lines[0]);
  for (size_t i = 1; i < lines.size(); ++i) fmt::print(out, "{:{}}{}\n", "", kEvidenceIndent, lines[i]);
  std::fflush(out);
}

}  // namespace

bool contains_whole_number(std::string_view text, std::string_view number) {
  auto is_digit = [](char c) { return c >= '0' && c <= '9'; };
  for (size_t at = text.find(number); at != std::string_view::npos; at = text.find(number, at + 1)) {
    size_t end = at + number.size();
    // "1.323" and "3,323" are other numbers; so are "323.5" and "323,000".
    bool digit_before = at > 0 && (is_digit(text[at - 1]) || ((text[at - 1] == '.' || text[at - 1] == ',') && at > 1 &&
                                                              is_digit(text[at - 2])));
    bool digit_after = end < text.size() && (is_digit(text[end]) ||
                                             ((text[end] == '.' || text[end] == ',') && end + 1 < text.size() &&
                                              is_digit(text[end + 1])));
    if (!digit_before && !digit_after) return true;
  }
  return false;
}

bool SmokeReport::passed() const {
  for (const auto& c : checks)
    if (!c.passed) return false;
  return !checks.empty();
}

nlohmann::json SmokeReport::to_json() const {
  nlohmann::json j = {{"tool", "kiln smoke"}, {"url", url}, {"model", model}, {"passed", passed()}};
  j["checks"] = nlohmann::json::array();
  for (const auto& c : checks)
    j["checks"].push_back({{"name", c.name},
                           {"passed", c.passed},
                           {"seconds", c.seconds},
                           {"evidence", join(c.evidence, "\n")},
                           {"reason", c.reason},
                           {"details", c.details}});
  return j;
}

const std::vector<std::string>& smoke_check_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const auto& [name, fn] : check_table()) n.push_back(name);
    return n;
  }();
  return names;
}

std::vector<std::string> parse_check_list(std::string_view list) {
  std::vector<std::string> chosen;
  const auto& valid = smoke_check_names();
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    std::string name(trim(list.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start)));
    if (!name.empty()) {
      if (std::find(valid.begin(), valid.end(), name) == valid.end())
        fail("unknown check '{}' in --tests (checks: {})", name, join(valid, ", "));
      if (std::find(chosen.begin(), chosen.end(), name) == chosen.end()) chosen.push_back(name);
    }
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  if (chosen.empty()) fail("--tests names no check (checks: {})", join(valid, ", "));
  return chosen;
}

SmokeReport run_smoke(const SmokeOptions& options, std::FILE* out) {
  HttpClient client(options.server);
  require_reachable(client);
  Context ctx{client, options, options.model.empty() ? discover_model_name(client) : options.model};

  SmokeReport report;
  report.url = options.server.display();
  report.model = ctx.model;
  fmt::print(out, "kiln smoke: {} (model \"{}\")\n", report.url, ctx.model);
  fmt::print(out, "{:<{}} {:<6} {:>9}  {}\n", "CHECK", kNameWidth, "RESULT", "TIME", "EVIDENCE");
  std::fflush(out);

  for (const auto& [name, fn] : check_table()) {
    if (!options.checks.empty() && std::find(options.checks.begin(), options.checks.end(), name) == options.checks.end())
      continue;
    CheckResult result;
    result.name = name;
    Problems problems;
    auto start = std::chrono::steady_clock::now();
    try {
      fn(ctx, result, problems);
    } catch (const std::exception& e) {
      problems.add(std::string("error: ") + e.what());
    }
    result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    result.passed = problems.list.empty();
    result.reason = join(problems.list, "; ");
    print_row(out, result);
    report.checks.push_back(std::move(result));
  }

  std::vector<std::string> failed;
  for (const auto& c : report.checks)
    if (!c.passed) failed.push_back(c.name);
  if (failed.empty())
    fmt::print(out, "result: all {} checks passed\n", report.checks.size());
  else
    fmt::print(out, "result: {} of {} checks passed; FAILED: {}\n", report.checks.size() - failed.size(),
               report.checks.size(), join(failed, ", "));
  std::fflush(out);
  return report;
}

}  // namespace kiln::clients
