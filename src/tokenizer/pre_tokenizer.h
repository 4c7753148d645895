// Pre-tokenizers of the tokenizer.json pipeline: Split (regex or literal), ByteLevel, Sequence.
// A pre-tokenizer cuts a piece of normalised text into smaller pieces ("words") that the model
// encodes independently. Pieces are passed on through a callback to avoid building lists.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::tok {

// A non-owning callable reference: void(std::string_view). Cheap to pass; must not outlive the callable.
class PieceSink {
 public:
  template <typename F>
  PieceSink(F& f) : obj_(&f), call_([](void* o, std::string_view s) { (*static_cast<F*>(o))(s); }) {}
  void operator()(std::string_view piece) const { call_(obj_, piece); }

 private:
  void* obj_;
  void (*call_)(void*, std::string_view);
};

// A compiled regex (PCRE2, UTF + Unicode properties, JIT) with the matching semantics of the
// Oniguruma engine used by HF tokenizers where they differ (\s is Unicode White_Space).
class Regex {
 public:
  explicit Regex(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Calls on_match(start, end) for every non-overlapping match in valid UTF-8 text, left to right.
  template <typename F>
  void for_each_match(std::string_view text, F&& on_match) const;

 private:
  // Finds the next match at or after start; returns false if none. Throws kiln::Error on engine errors.
  bool find(std::string_view text, size_t start, size_t& match_start, size_t& match_end) const;
  void* code_ = nullptr;  // pcre2_code_8*
  std::string pattern_;
};

template <typename F>
void Regex::for_each_match(std::string_view text, F&& on_match) const {
  size_t pos = 0;
  size_t match_start, match_end;
  while (pos <= text.size() && find(text, pos, match_start, match_end)) {
    if (match_end == match_start) {
      // An empty match: step over one character so the search makes progress.
      if (match_start >= text.size()) break;
      size_t step = 1;
      while (match_start + step < text.size() &&
             (static_cast<unsigned char>(text[match_start + step]) & 0xC0) == 0x80)
        ++step;
      pos = match_start + step;
      continue;
    }
    on_match(match_start, match_end);
    pos = match_end;
  }
}

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void split(std::string_view piece, PieceSink sink) const = 0;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Split: cuts at the matches of a pattern (a regex or a literal string) and keeps, drops or merges
// the matched parts according to the behaviour; invert swaps the roles of matches and gaps.
class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(std::string_view pattern, bool is_regex, SplitBehavior behavior, bool invert);
  void split(std::string_view piece, PieceSink sink) const override;

 private:
  std::unique_ptr<Regex> regex_;
  std::string literal_;
  SplitBehavior behavior_;
  bool invert_;
};

// ByteLevel: optionally prepends a space, optionally splits with the GPT-2 regex. The mapping of bytes
// to the byte-level alphabet is implicit: the BPE model works on raw bytes.
class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex);
  void split(std::string_view piece, PieceSink sink) const override;

 private:
  bool add_prefix_space_;
  std::unique_ptr<Regex> regex_;  // null when use_regex is false
};

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps)
      : steps_(std::move(steps)) {}
  void split(std::string_view piece, PieceSink sink) const override { run(0, piece, sink); }

 private:
  void run(size_t step, std::string_view piece, PieceSink sink) const;
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

// Rewrites a pattern written for Oniguruma so PCRE2 matches the same: \s and \S become explicit
// Unicode White_Space classes (PCRE2's \s also matches U+180E). Exposed for tests.
std::string translate_regex_for_pcre2(std::string_view pattern);

}  // namespace kiln::tok
