// kiln tokenize: text <-> token ids with a model's tokenizer.
//
//   echo -n "Hello world" | kiln tokenize --model-path DIR            -> [9707,1879]
//   echo "[9707,1879]" | kiln tokenize --model-path DIR --decode      -> Hello world
//   kiln tokenize --model-path DIR --jsonl < strings.jsonl            -> one id array per input line
#include <cstdio>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/command.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace {

struct TokenizeOptions {
  std::string model_path;
  bool decode = false;
  bool jsonl = false;
  bool no_parse_special = false;
  bool skip_special = false;
};

std::vector<int32_t> parse_ids(const std::string& text, size_t line_number) {
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
    if (!v.is_number_integer()) kiln::fail("--decode: token ids must be integers (input line {})", line_number);
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

int run_tokenize(const TokenizeOptions& opts) {
  auto tokenizer = kiln::tok::Tokenizer::load_dir(opts.model_path);
  bool parse_special = !opts.no_parse_special;
  if (!opts.jsonl) {
    std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    if (opts.decode) {
      std::string text = tokenizer->decode(parse_ids(input, 1), opts.skip_special);
      std::fwrite(text.data(), 1, text.size(), stdout);
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
      std::string text = tokenizer->decode(parse_ids(line, line_number), opts.skip_special);
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

kiln::cli::Registrar reg{"tokenize", "Encode text from stdin to token ids (or decode ids with --decode)",
                         [](CLI::App& app) {
  auto opts = std::make_shared<TokenizeOptions>();
  app.add_option("--model-path", opts->model_path, "Folder with tokenizer.json (and tokenizer_config.json)")
      ->required();
  app.add_flag("--decode", opts->decode, "Read a JSON array of ids and print the text");
  app.add_flag("--jsonl", opts->jsonl,
               "One item per line: JSON strings in, id arrays out (or, with --decode, id arrays in, JSON strings out)");
  app.add_flag("--no-parse-special", opts->no_parse_special,
               "Encode special-token strings in the text as plain text");
  app.add_flag("--skip-special", opts->skip_special, "With --decode: drop special tokens");
  return [opts]() -> int { return run_tokenize(*opts); };
}};

}  // namespace
