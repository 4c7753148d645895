#include "tokenizer/tokenizer.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/added_vocabulary.h"
#include "tokenizer/bpe.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/utf8.h"

namespace kiln::tok {

using json = nlohmann::json;

class TokenizerImpl {
 public:
  std::vector<AddedToken> added_tokens;
  AddedTokenMatcher raw_matcher;           // added tokens with normalized = false
  AddedTokenMatcher normalized_matcher;    // added tokens with normalized = true
  std::unique_ptr<Normalizer> normalizer;  // null: none
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<BpeModel> model;

  // Per id (index): token string as in tokenizer.json, its decoded bytes, flags.
  std::vector<std::string> id_to_token;
  std::vector<std::string> id_to_bytes;
  std::vector<uint8_t> id_flags;
  static constexpr uint8_t kExists = 1, kSpecial = 2;
  std::unordered_map<std::string, int32_t> token_to_id;
  std::optional<std::string> bos_token, eos_token;

  bool exists(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < id_flags.size() && (id_flags[id] & kExists);
  }
  bool special(int32_t id) const { return exists(id) && (id_flags[id] & kSpecial); }

  void encode_plain(std::string_view text, bool parse_special, std::vector<int32_t>& out) const;
  void encode_normalized(std::string_view text, std::vector<int32_t>& out) const;
};

namespace {

// --- tokenizer.json parsing ---------------------------------------------------------------------

std::string type_of(const json& j, std::string_view where) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    fail("tokenizer.json: {} has no \"type\"", where);
  return j["type"].get<std::string>();
}

bool flag(const json& j, const char* key, bool default_value) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return default_value;
  if (!it->is_boolean()) fail("tokenizer.json: \"{}\" must be true or false", key);
  return it->get<bool>();
}

std::unique_ptr<Normalizer> parse_normalizer(const json& j) {
  if (j.is_null()) return nullptr;
  std::string type = type_of(j, "the normalizer");
  if (type == "NFC") return std::make_unique<NfcNormalizer>();
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (const auto& step : j.at("normalizers")) {
      if (auto n = parse_normalizer(step)) steps.push_back(std::move(n));
    }
    if (steps.empty()) return nullptr;
    if (steps.size() == 1) return std::move(steps[0]);
    return std::make_unique<SequenceNormalizer>(std::move(steps));
  }
  fail("tokenizer.json: normalizer type {:?} is not supported (kiln supports NFC and Sequence)", type);
}

SplitBehavior parse_behavior(const std::string& name) {
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  fail("tokenizer.json: Split behavior {:?} is not supported", name);
}

// Flattens nested Sequences into steps.
void parse_pre_tokenizer(const json& j, std::vector<std::unique_ptr<PreTokenizer>>& steps,
                         bool& saw_byte_level) {
  std::string type = type_of(j, "the pre_tokenizer");
  if (saw_byte_level)
    fail("tokenizer.json: pre-tokenizer {:?} after ByteLevel is not supported (ByteLevel must come last)",
         type);
  if (type == "Sequence") {
    for (const auto& step : j.at("pretokenizers")) parse_pre_tokenizer(step, steps, saw_byte_level);
    return;
  }
  if (type == "Split") {
    const json& pattern = j.at("pattern");
    bool is_regex;
    std::string text;
    if (pattern.contains("Regex")) {
      is_regex = true;
      text = pattern["Regex"].get<std::string>();
    } else if (pattern.contains("String")) {
      is_regex = false;
      text = pattern["String"].get<std::string>();
    } else {
      fail("tokenizer.json: Split pattern must be {{\"Regex\": ...}} or {{\"String\": ...}}");
    }
    steps.push_back(std::make_unique<SplitPreTokenizer>(
        text, is_regex, parse_behavior(j.at("behavior").get<std::string>()), flag(j, "invert", false)));
    return;
  }
  if (type == "ByteLevel") {
    steps.push_back(std::make_unique<ByteLevelPreTokenizer>(flag(j, "add_prefix_space", true),
                                                            flag(j, "use_regex", true)));
    saw_byte_level = true;
    return;
  }
  fail("tokenizer.json: pre-tokenizer type {:?} is not supported (kiln supports Split, ByteLevel, Sequence)",
       type);
}

void check_decoder(const json& j) {
  if (j.is_null())
    fail("tokenizer.json: no decoder; kiln supports byte-level BPE tokenizers with a ByteLevel decoder");
  std::string type = type_of(j, "the decoder");
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    for (const auto& step : j.at("decoders")) check_decoder(step);
    return;
  }
  fail("tokenizer.json: decoder type {:?} is not supported (kiln supports ByteLevel)", type);
}

void check_post_processor(const json& j) {
  if (j.is_null()) return;
  std::string type = type_of(j, "the post_processor");
  if (type == "ByteLevel") return;  // only adjusts offsets
  if (type == "Sequence") {
    for (const auto& step : j.at("processors")) check_post_processor(step);
    return;
  }
  if (type == "TemplateProcessing") {
    for (const auto& piece : j.at("single")) {
      if (piece.contains("SpecialToken"))
        fail(
            "tokenizer.json: a TemplateProcessing post-processor that adds special tokens ({}) is not "
            "supported",
            piece["SpecialToken"].value("id", std::string("?")));
    }
    return;
  }
  fail("tokenizer.json: post-processor type {:?} is not supported", type);
}

std::optional<std::string> config_token(const json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content")) return (*it)["content"].get<std::string>();
  fail("tokenizer_config.json: \"{}\" must be a string, null or an object with \"content\"", key);
}

// The bytes HF's ByteLevel decoder produces for a token string: the byte-level alphabet undone, or
// the token's own UTF-8 if any char lies outside the alphabet.
std::string decoded_bytes(const std::string& token) {
  std::string bytes;
  if (byte_level_to_bytes(token, bytes)) return bytes;
  return token;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read {}", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

// --- encoding ------------------------------------------------------------------------------------

void TokenizerImpl::encode_normalized(std::string_view text, std::vector<int32_t>& out) const {
  const size_t begin = out.size();
  auto encode_word = [&](std::string_view word) { model->encode_word(word, out); };
  pre_tokenizer->split(text, PieceSink(encode_word));
  model->fuse_unk_run(out, begin);  // fuse_unk works on a whole section's tokens, across words
}

void TokenizerImpl::encode_plain(std::string_view text, bool parse_special, std::vector<int32_t>& out) const {
  std::string normalized_storage;
  std::string_view normalized = text;
  if (normalizer && !normalizer->is_normalized(text)) {
    normalized_storage.reserve(text.size());
    normalizer->normalize(text, normalized_storage);
    normalized = normalized_storage;
  }
  if (normalized_matcher.empty()) {
    encode_normalized(normalized, out);
    return;
  }
  std::vector<AddedSplit> splits;
  normalized_matcher.split(normalized, parse_special, splits);
  for (const auto& s : splits) {
    if (s.id >= 0) {
      out.push_back(s.id);
    } else {
      encode_normalized(normalized.substr(s.begin, s.end - s.begin), out);
    }
  }
}

Tokenizer::Tokenizer(std::unique_ptr<TokenizerImpl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::from_json(std::string_view tokenizer_json,
                                                std::string_view tokenizer_config_json) {
  json root;
  try {
    root = json::parse(tokenizer_json);
  } catch (const json::exception& e) {
    fail("tokenizer.json is not valid JSON: {}", e.what());
  }
  json config = json::object();
  if (!tokenizer_config_json.empty()) {
    try {
      config = json::parse(tokenizer_config_json);
    } catch (const json::exception& e) {
      fail("tokenizer_config.json is not valid JSON: {}", e.what());
    }
  }
  auto impl = std::make_unique<TokenizerImpl>();
  try {
    if (!root.is_object() || !root.contains("model")) fail("tokenizer.json: no \"model\" section");
    if (root.contains("truncation") && !root["truncation"].is_null())
      fail("tokenizer.json: truncation is set; kiln does not truncate inside the tokenizer (set it to null)");
    if (root.contains("padding") && !root["padding"].is_null())
      fail("tokenizer.json: padding is set; kiln does not pad inside the tokenizer (set it to null)");

    // Model.
    const json& model = root["model"];
    std::string model_type = model.contains("type") ? model["type"].get<std::string>()
                                                    : (model.contains("merges") ? "BPE" : "(none)");
    if (model_type != "BPE")
      fail("tokenizer.json: model type {:?} is not supported (kiln supports byte-level BPE)", model_type);
    if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() > 0)
      fail("tokenizer.json: BPE dropout is not supported");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (model.contains(key) && !model[key].is_null() && !model[key].get<std::string>().empty())
        fail("tokenizer.json: BPE {} is not supported", key);
    }
    std::vector<std::pair<std::string, int32_t>> vocab;
    vocab.reserve(model.at("vocab").size());
    for (const auto& [token, id] : model.at("vocab").items()) vocab.emplace_back(token, id.get<int32_t>());
    std::vector<std::pair<std::string, std::string>> merges;
    merges.reserve(model.at("merges").size());
    for (const auto& m : model.at("merges")) {
      if (m.is_string()) {
        const std::string& s = m.get_ref<const std::string&>();
        size_t space = s.find(' ');
        if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
          fail("tokenizer.json: merge {:?} is not two tokens separated by one space", s);
        merges.emplace_back(s.substr(0, space), s.substr(space + 1));
      } else if (m.is_array() && m.size() == 2) {
        merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
      } else {
        fail("tokenizer.json: a merge must be \"a b\" or [\"a\", \"b\"]");
      }
    }
    BpeOptions bpe_options;
    bpe_options.ignore_merges = flag(model, "ignore_merges", false);
    bpe_options.fuse_unk = flag(model, "fuse_unk", false);
    bpe_options.byte_fallback = flag(model, "byte_fallback", false);
    if (model.contains("unk_token") && !model["unk_token"].is_null()) {
      if (!model["unk_token"].is_string()) fail("tokenizer.json: the BPE unk_token must be a string or null");
      bpe_options.unk_token = model["unk_token"].get<std::string>();
    }
    impl->model = std::make_unique<BpeModel>(vocab, merges, bpe_options);

    // Pipeline.
    impl->normalizer = parse_normalizer(root.value("normalizer", json()));
    if (!root.contains("pre_tokenizer") || root["pre_tokenizer"].is_null())
      fail("tokenizer.json: no pre_tokenizer; kiln supports byte-level BPE (a ByteLevel pre-tokenizer)");
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    bool saw_byte_level = false;
    parse_pre_tokenizer(root["pre_tokenizer"], steps, saw_byte_level);
    if (!saw_byte_level)
      fail("tokenizer.json: the pre-tokenizer has no ByteLevel step; only byte-level BPE is supported");
    impl->pre_tokenizer =
        steps.size() == 1 ? std::move(steps[0]) : std::make_unique<SequencePreTokenizer>(std::move(steps));
    check_decoder(root.value("decoder", json()));
    check_post_processor(root.value("post_processor", json()));

    // Id tables.
    int64_t max_id = -1;
    for (const auto& [token, id] : vocab) {
      if (id < 0) fail("tokenizer.json: vocabulary token {:?} has a negative id", token);
      max_id = std::max<int64_t>(max_id, id);
    }
    if (root.contains("added_tokens")) {
      for (const auto& t : root["added_tokens"]) {
        AddedToken token;
        token.id = t.at("id").get<int32_t>();
        token.content = t.at("content").get<std::string>();
        token.special = flag(t, "special", false);
        token.single_word = flag(t, "single_word", false);
        token.lstrip = flag(t, "lstrip", false);
        token.rstrip = flag(t, "rstrip", false);
        token.normalized = flag(t, "normalized", !token.special);
        if (token.id < 0) fail("tokenizer.json: added token {:?} has a negative id", token.content);
        if (!utf8::is_valid(token.content))
          fail("tokenizer.json: added token {} is not valid UTF-8", token.id);
        max_id = std::max<int64_t>(max_id, token.id);
        impl->added_tokens.push_back(std::move(token));
      }
    }
    impl->id_to_token.resize(max_id + 1);
    impl->id_to_bytes.resize(max_id + 1);
    impl->id_flags.assign(max_id + 1, 0);
    for (const auto& [token, id] : vocab) {
      impl->id_to_token[id] = token;
      impl->id_to_bytes[id] = decoded_bytes(token);
      impl->id_flags[id] = TokenizerImpl::kExists;
      impl->token_to_id[token] = id;
    }
    for (const auto& token : impl->added_tokens) {
      impl->id_to_token[token.id] = token.content;
      impl->id_to_bytes[token.id] = decoded_bytes(token.content);
      impl->id_flags[token.id] = TokenizerImpl::kExists | (token.special ? TokenizerImpl::kSpecial : 0);
      impl->token_to_id[token.content] = token.id;
    }

    // Added-token matchers: raw content for normalized = false, normalised content otherwise.
    std::vector<std::string> raw_patterns, normalized_patterns;
    std::vector<const AddedToken*> raw_tokens, normalized_tokens;
    for (const auto& token : impl->added_tokens) {
      if (token.normalized) {
        std::string content;
        if (impl->normalizer) {
          impl->normalizer->normalize(token.content, content);
        } else {
          content = token.content;
        }
        normalized_patterns.push_back(std::move(content));
        normalized_tokens.push_back(&token);
      } else {
        raw_patterns.push_back(token.content);
        raw_tokens.push_back(&token);
      }
    }
    impl->raw_matcher.build(raw_patterns, raw_tokens);
    impl->normalized_matcher.build(normalized_patterns, normalized_tokens);

    impl->bos_token = config_token(config, "bos_token");
    impl->eos_token = config_token(config, "eos_token");
  } catch (const json::exception& e) {
    fail("tokenizer.json: unexpected structure: {}", e.what());
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

std::unique_ptr<Tokenizer> Tokenizer::load_dir(const std::string& dir) {
  std::string json_path = dir + "/tokenizer.json";
  std::ifstream probe(json_path);
  if (!probe) fail("no tokenizer.json in {} (a Hugging Face tokenizer folder is needed)", dir);
  std::string tokenizer_json = read_file(json_path);
  std::string config_path = dir + "/tokenizer_config.json";
  std::string config_json;
  if (std::ifstream(config_path)) config_json = read_file(config_path);
  return from_json(tokenizer_json, config_json);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  size_t bad = utf8::first_invalid(text);
  if (bad != text.size()) fail("tokenizer: the text is not valid UTF-8 (at byte {} of {})", bad, text.size());
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  const TokenizerImpl& t = *impl_;
  if (t.raw_matcher.empty()) {
    t.encode_plain(text, parse_special, ids);
    return ids;
  }
  std::vector<AddedSplit> splits;
  t.raw_matcher.split(text, parse_special, splits);
  for (const auto& s : splits) {
    if (s.id >= 0) {
      ids.push_back(s.id);
    } else {
      t.encode_plain(text.substr(s.begin, s.end - s.begin), parse_special, ids);
    }
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  const TokenizerImpl& t = *impl_;
  std::string bytes;
  for (int32_t id : ids) {
    if (!t.exists(id) || (skip_special && t.special(id))) continue;
    bytes.append(t.id_to_bytes[id]);
  }
  std::string text;
  text.reserve(bytes.size());
  utf8::append_lossy(bytes, text);
  return text;
}

int32_t Tokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->token_to_id.find(std::string(token));
  return it == impl_->token_to_id.end() ? -1 : it->second;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  return impl_->exists(id) ? impl_->id_to_token[id] : std::string();
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_flags.size()); }
bool Tokenizer::is_special(int32_t id) const { return impl_->special(id); }
std::optional<std::string> Tokenizer::bos_token() const { return impl_->bos_token; }
std::optional<std::string> Tokenizer::eos_token() const { return impl_->eos_token; }

// --- streaming decode ----------------------------------------------------------------------------

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special)
    : tokenizer_(tokenizer), skip_special_(skip_special) {}

std::string StreamDecoder::push(int32_t id) {
  const TokenizerImpl& t = *tokenizer_.impl_;
  std::string out;
  if (!t.exists(id) || (skip_special_ && t.special(id))) return out;
  pending_.append(t.id_to_bytes[id]);
  size_t held = utf8::append_lossy(pending_, out, /*hold_incomplete_tail=*/true);
  pending_.erase(0, pending_.size() - held);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  utf8::append_lossy(pending_, out);
  pending_.clear();
  return out;
}

}  // namespace kiln::tok
