// Byte-level BPE tokenizer read from a Hugging Face tokenizer.json (the Qwen2/Qwen3/Qwen3.5 family).
//
// Supported pipeline pieces (anything else is a kiln::Error naming the unsupported piece, never a
// silent wrong encoding):
//   added tokens (lstrip / rstrip / single_word / normalized / special)
//   normalizer:    null, NFC, Sequence of those
//   pre-tokenizer: Split (PCRE2 regex or literal string; Isolated / Removed / MergedWithPrevious /
//                  MergedWithNext / Contiguous; invert), ByteLevel (add_prefix_space, use_regex), Sequence
//   model:         BPE (byte-level, merges as "a b" strings or [a, b] pairs, ignore_merges)
//   post-processor: null, ByteLevel, TemplateProcessing without added tokens on a single sequence
//   decoder:       ByteLevel, Sequence of it
//
// Thread safety: a Tokenizer is immutable after loading, except for an internal word cache guarded by
// a mutex; encode/decode may be called from several threads at once.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::tok {

class TokenizerImpl;

class Tokenizer {
 public:
  // From the contents of tokenizer.json and tokenizer_config.json (the latter may be empty; it only
  // supplies bos_token / eos_token).
  static std::unique_ptr<Tokenizer> from_json(std::string_view tokenizer_json,
                                              std::string_view tokenizer_config_json);
  // From a folder holding tokenizer.json (and optionally tokenizer_config.json).
  static std::unique_ptr<Tokenizer> load_dir(const std::string& dir);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // UTF-8 text -> token ids. parse_special: match special added tokens written in the text (as HF
  // does by default); when false, special tokens are encoded as ordinary text. Non-special added
  // tokens are always matched. Invalid UTF-8 in the input is a kiln::Error.
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;
  // Token ids -> UTF-8 text. skip_special drops special added tokens. Byte sequences that are not
  // valid UTF-8 become U+FFFD (as HF decode does). Ids outside the vocabulary (a model's padded
  // embedding rows) are skipped, as HF decode does.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  int32_t token_to_id(std::string_view token) const;  // -1 if absent
  std::string id_to_token(int32_t id) const;          // raw vocab string (byte-level alphabet); "" if absent
  int64_t vocab_size() const;                         // max id + 1 over vocab and added tokens
  bool is_special(int32_t id) const;                  // a special added token
  std::optional<std::string> bos_token() const;       // from tokenizer_config.json
  std::optional<std::string> eos_token() const;       // from tokenizer_config.json

 private:
  friend class StreamDecoder;
  explicit Tokenizer(std::unique_ptr<TokenizerImpl> impl);
  std::unique_ptr<TokenizerImpl> impl_;
};

// Incremental detokenizer for streaming (SSE): push() returns only complete UTF-8 characters, holding
// back the bytes of a character that spans several tokens until it is complete.
class StreamDecoder {
 public:
  StreamDecoder(const Tokenizer& tokenizer, bool skip_special);
  // The new complete text since the last call (may be empty).
  std::string push(int32_t id);
  // The remaining held-back bytes at the end of the stream; an incomplete or invalid sequence is
  // replaced by U+FFFD as HF decode does.
  std::string flush();

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  std::string pending_;  // bytes of an incomplete UTF-8 character
};

}  // namespace kiln::tok
