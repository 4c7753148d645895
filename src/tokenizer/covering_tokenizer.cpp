#include "tokenizer/covering_tokenizer.h"

#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"

namespace kiln::tok {
namespace {

using nlohmann::json;

// GPT-2's byte -> printable code point map (the byte-level alphabet), as UTF-8 strings.
std::vector<std::string> byte_symbols() {
  std::vector<int> cp(256, -1);
  for (int b = 0; b < 256; ++b)
    if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) cp[b] = b;
  int next = 256;
  for (int b = 0; b < 256; ++b)
    if (cp[b] < 0) cp[b] = next++;
  std::vector<std::string> out(256);
  for (int b = 0; b < 256; ++b) {
    const int c = cp[b];
    std::string s;
    if (c < 0x80) {
      s += static_cast<char>(c);
    } else {
      s += static_cast<char>(0xC0 | (c >> 6));
      s += static_cast<char>(0x80 | (c & 0x3F));
    }
    out[b] = s;
  }
  return out;
}

json parse(std::string_view text, const char* what) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail("covering tokenizer: the base {} is not valid JSON: {}", what, e.what());
  }
}

}  // namespace

CoveringTokenizerFiles make_covering_tokenizer(int64_t vocab_size, int64_t first_added_id,
                                               std::string_view base_tokenizer_json,
                                               std::string_view base_tokenizer_config_json) {
  json tok = parse(base_tokenizer_json, "tokenizer.json");
  json cfg = base_tokenizer_config_json.empty() ? json::object() : parse(base_tokenizer_config_json, "tokenizer_config.json");
  if (!tok.contains("added_tokens") || !tok["added_tokens"].is_array())
    fail("covering tokenizer: the base tokenizer.json has no added_tokens list");
  json added = tok["added_tokens"];
  const int64_t n_added = static_cast<int64_t>(added.size());
  if (first_added_id < 0) first_added_id = vocab_size - n_added;
  if (first_added_id < 256 || first_added_id + n_added > vocab_size)
    fail("covering tokenizer: {} added tokens from id {} do not fit a vocabulary of {} after the 256 byte symbols",
         n_added, first_added_id, vocab_size);

  CoveringTokenizerFiles files;
  files.first_added_id = first_added_id;

  // Regular vocabulary: bytes, then token i = tokens[parent] + byte symbol, parents in creation order.
  const std::vector<std::string> bytes = byte_symbols();
  std::vector<std::string> tokens(bytes);
  tokens.reserve(static_cast<size_t>(first_added_id));
  json merges = json::array();
  for (size_t parent = 0; static_cast<int64_t>(tokens.size()) < first_added_id; ++parent) {
    for (size_t b = 0; b < bytes.size() && static_cast<int64_t>(tokens.size()) < first_added_id; ++b) {
      merges.push_back(json::array({tokens[parent], bytes[b]}));
      tokens.push_back(tokens[parent] + bytes[b]);
    }
  }
  files.num_merged = static_cast<int64_t>(tokens.size()) - 256;
  json vocab = json::object();
  for (size_t i = 0; i < tokens.size(); ++i) vocab[tokens[i]] = static_cast<int64_t>(i);

  // Added tokens at their new ids, then the fill.
  json decoder = json::object();
  for (int64_t i = 0; i < n_added; ++i) {
    added[i]["id"] = first_added_id + i;
    json entry = {{"content", added[i].value("content", "")},
                  {"lstrip", added[i].value("lstrip", false)},
                  {"normalized", added[i].value("normalized", false)},
                  {"rstrip", added[i].value("rstrip", false)},
                  {"single_word", added[i].value("single_word", false)},
                  {"special", added[i].value("special", false)}};
    decoder[std::to_string(first_added_id + i)] = entry;
  }
  for (int64_t id = first_added_id + n_added; id < vocab_size; ++id) {
    const std::string content = "<|fill_" + std::to_string(files.num_fill++) + "|>";
    added.push_back({{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", false}});
    decoder[std::to_string(id)] = {{"content", content}, {"lstrip", false}, {"normalized", false},
                                   {"rstrip", false}, {"single_word", false}, {"special", false}};
  }
  tok["added_tokens"] = added;
  if (!tok.contains("model") || !tok["model"].is_object())
    fail("covering tokenizer: the base tokenizer.json has no model section");
  tok["model"]["vocab"] = vocab;
  tok["model"]["merges"] = merges;
  cfg["added_tokens_decoder"] = decoder;
  cfg["model_max_length"] = 1 << 20;
  files.tokenizer_json = tok.dump();
  files.tokenizer_config_json = cfg.dump(2) + "\n";
  return files;
}

}  // namespace kiln::tok
