// `kiln smoke`: checks that an OpenAI-compatible server (kiln, SGLang, vLLM, llama-server) answers
// correctly, not just that it answers. Checks, in order:
//   model-info     GET /get_model_info (else /model_info, else /v1/models): what is served
//   simple         "Reply with just OK" at temperature 0 -> content is exactly "OK"
//   math-no-think  17 x 19 with thinking off -> 323 in content, no reasoning, no think tags
//   math-think     17 x 19 with thinking on -> reasoning present, 323 in content, no think tags,
//                  non-streamed and streamed answers identical (temperature 0)
//   determinism    one temperature-0 request 3x in a row and 3x at once -> 6 identical answers
//   throughput     concurrency 1, 512 streamed tokens (ignore_eos) -> tok/s, TTFT, TPOT
// Every answer judged also passes the guards of guards.h (empty, NUL / U+FFFD, garbage, leaked think
// tags, degenerate repetition).
#pragma once
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "clients/http.h"

namespace kiln::clients {

struct SmokeOptions {
  ServerAddress server;
  std::string model;                     // empty: ask GET /v1/models
  std::vector<std::string> checks;       // empty: all, in the order above
  std::optional<double> baseline_tok_s;  // throughput: also print the ratio to this figure
};

struct CheckResult {
  std::string name;
  bool passed = false;
  double seconds = 0;
  std::vector<std::string> evidence;  // what was judged, one item per line ("content=\"OK\"")
  std::string reason;                 // why it failed (empty when passed)
  nlohmann::json details = nlohmann::json::object();  // numbers and full texts for --json
};

struct SmokeReport {
  std::string url;
  std::string model;
  std::vector<CheckResult> checks;

  bool passed() const;
  nlohmann::json to_json() const;
};

// All check names, in run order.
const std::vector<std::string>& smoke_check_names();
// "simple,math-think" -> names; throws kiln::Error naming the valid checks on an unknown one.
std::vector<std::string> parse_check_list(std::string_view list);

// Runs the checks, printing a table row per check to `out` as each finishes.
// Throws kiln::Error when the server cannot be reached at all.
SmokeReport run_smoke(const SmokeOptions& options, std::FILE* out);

// Does `text` contain `number` as a whole number (not part of a longer one: "3230", "1323", "323.5")?
bool contains_whole_number(std::string_view text, std::string_view number);

}  // namespace kiln::clients
