// kiln tokenize: text <-> token ids with a model's tokenizer.
//
//   echo -n "Hello world" | kiln tokenize [--model-path DIR]          -> [9707,1879]
//   echo "[9707,1879]" | kiln tokenize --model-path DIR --decode      -> Hello world (and a newline)
//   kiln tokenize --model-path DIR --jsonl < strings.jsonl            -> one id array per input line
//   kiln tokenize --model-path DIR --bench FILE                       -> single-thread encode throughput
// Without --model-path: the embedded model's tokenizer.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/command.h"
#include "core/error.h"
#include "format/model_dir.h"
#include "tokenizer/tokenizer.h"

namespace {

struct TokenizeOptions {
  std::string model_path;
  bool decode = false;
  bool jsonl = false;
  bool no_parse_special = false;
  bool skip_special = false;
  std::string bench_file;
  int bench_reps = 5;
};

std::vector<int32_t> parse_ids(const std::string& text, size_t line_number, int64_t vocab_size) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    j = nullptr;
  }
  if (!j.is_array())
    kiln::fail("--decode expects a JSON array of token ids (input line {}), e.g. [9707, 1879]", line_number);
  std::vector<int32_t> ids;
  for (const auto& v : j) {
    if (!v.is_number_integer())
      kiln::fail("--decode: token ids must be integers (input line {})", line_number);
    if (v.get<int64_t>() < 0 || v.get<int64_t>() >= vocab_size)
      kiln::fail("--decode: token id {} is outside this tokenizer's ids [0, {}) (input line {})", v.get<int64_t>(),
                 vocab_size, line_number);
    ids.push_back(v.get<int32_t>());
  }
  return ids;
}

std::string ids_json(const std::vector<int32_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(ids[i]);
  }
  return out + "]";
}

double thread_cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// Single-threaded encode throughput on a text file, two ways: each line encoded on its own and the
// whole file as one string. The first run of each fills the word cache and is reported apart.
int run_bench(const kiln::tok::Tokenizer& tokenizer, const TokenizeOptions& opts, double load_seconds) {
  std::ifstream in(opts.bench_file, std::ios::binary);
  if (!in) kiln::fail("--bench: cannot read {}", opts.bench_file);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string_view> lines;
  for (size_t pos = 0; pos <= text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    lines.push_back(std::string_view(text).substr(pos, end - pos));
    pos = end + 1;
  }
  std::printf(
      "kiln: tokenizer loaded in %.2f s; %s: %zu bytes, %zu lines; %d runs each (after one cold run)\n",
      load_seconds, opts.bench_file.c_str(), text.size(), lines.size(), opts.bench_reps);
  auto measure = [&](const char* what, auto&& encode_all) {
    std::vector<double> wall, cpu;
    size_t tokens = 0;
    for (int r = 0; r <= opts.bench_reps; ++r) {
      auto start = std::chrono::steady_clock::now();
      double cpu_start = thread_cpu_seconds();
      tokens = encode_all();
      double cpu_s = thread_cpu_seconds() - cpu_start;
      double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (r == 0) {
        std::printf("kiln %s: cold run %.2f MB/s\n", what, text.size() / wall_s / 1e6);
        continue;
      }
      wall.push_back(wall_s);
      cpu.push_back(cpu_s);
    }
    std::sort(wall.begin(), wall.end());
    std::sort(cpu.begin(), cpu.end());
    std::printf(
        "kiln %s: %zu tokens; best %.2f MB/s (%.3f M tokens/s), median %.2f MB/s; thread CPU time: best %.2f "
        "MB/s\n",
        what, tokens, text.size() / wall[0] / 1e6, tokens / wall[0] / 1e6,
        text.size() / wall[wall.size() / 2] / 1e6, text.size() / cpu[0] / 1e6);
  };
  measure("per line", [&] {
    size_t n = 0;
    for (auto line : lines) n += tokenizer.encode(line).size();
    return n;
  });
  measure("whole text", [&] { return tokenizer.encode(text).size(); });
  return 0;
}

int run_tokenize(const TokenizeOptions& opts) {
  auto load_start = std::chrono::steady_clock::now();
  // A folder needs only tokenizer.json (no config.json); without one, the embedded model's tokenizer.
  std::unique_ptr<kiln::tok::Tokenizer> tokenizer;
  if (!opts.model_path.empty()) {
    tokenizer = kiln::tok::Tokenizer::load_dir(opts.model_path);
  } else {
    const kiln::format::ModelDir dir = kiln::format::ModelDir::embedded();
    tokenizer = kiln::tok::Tokenizer::from_json(
        dir.read_text("tokenizer.json"), dir.has("tokenizer_config.json") ? dir.read_text("tokenizer_config.json") : "");
  }
  if (!opts.bench_file.empty()) {
    double load_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
    return run_bench(*tokenizer, opts, load_seconds);
  }
  bool parse_special = !opts.no_parse_special;
  if (!opts.jsonl) {
    std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    if (opts.decode) {
      std::string text = tokenizer->decode(parse_ids(input, 1, tokenizer->vocab_size()), opts.skip_special);
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fputc('\n', stdout);
    } else {
      std::printf("%s\n", ids_json(tokenizer->encode(input, parse_special)).c_str());
    }
    return 0;
  }
  // JSON lines: each input line is a JSON string (encode) or a JSON array of ids (decode).
  std::string line;
  size_t line_number = 0;
  while (std::getline(std::cin, line)) {
    ++line_number;
    if (opts.decode) {
      std::string text = tokenizer->decode(parse_ids(line, line_number, tokenizer->vocab_size()), opts.skip_special);
      std::printf("%s\n", nlohmann::json(text).dump().c_str());
      continue;
    }
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      j = nullptr;
    }
    if (!j.is_string()) kiln::fail("--jsonl expects one JSON string per line (input line {})", line_number);
    std::printf("%s\n", ids_json(tokenizer->encode(j.get_ref<const std::string&>(), parse_special)).c_str());
  }
  return 0;
}

kiln::cli::Registrar reg{
    "tokenize", "Encode text from stdin to token ids (or decode ids with --decode)", [](CLI::App& app) {
      auto opts = std::make_shared<TokenizeOptions>();
      app.add_option("--model-path", opts->model_path,
                     "Folder with tokenizer.json (and tokenizer_config.json); default: the embedded model");
      app.add_flag("--decode", opts->decode, "Read a JSON array of ids and print the text (and a newline)");
      app.add_flag("--jsonl", opts->jsonl,
                   "One item per line: JSON strings in, id arrays out (or, with --decode, id arrays in, JSON "
                   "strings out)");
      app.add_flag("--no-parse-special", opts->no_parse_special,
                   "Encode special-token strings in the text as plain text");
      app.add_flag("--skip-special", opts->skip_special, "With --decode: drop special tokens");
      app.add_option("--bench", opts->bench_file,
                     "Measure single-thread encode throughput on this text file");
      app.add_option("--bench-reps", opts->bench_reps, "Timed runs for --bench (default 5)")
          ->check(CLI::Range(1, 1000));
      return [opts]() -> int { return run_tokenize(*opts); };
    }};

}  // namespace
