#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/pre_tokenizer.h"

#include <pcre2.h>

#include "core/error.h"

namespace kiln::tok {
namespace {

// Unicode White_Space, which Oniguruma's \s matches (PCRE2's \s adds U+180E).
constexpr std::string_view kWhiteSpaceClassBody =
    "\\t-\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

// The GPT-2 pre-tokenisation regex of HF's ByteLevel pre-tokenizer (use_regex: true).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Per-thread PCRE2 matching state: match data (only the whole-match offsets are read) and a JIT
// stack larger than the default so long inputs never hit the JIT stack limit.
struct MatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  MatchState() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    KILN_CHECK(data && context && jit_stack, "PCRE2 allocation failed");
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~MatchState() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

MatchState& match_state() {
  thread_local MatchState state;
  return state;
}

}  // namespace

std::string translate_regex_for_pcre2(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 64);
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      char e = pattern[++i];
      if (e == 's') {
        if (in_class) {
          out.append(kWhiteSpaceClassBody);
        } else {
          out.append("[").append(kWhiteSpaceClassBody).append("]");
        }
      } else if (e == 'S' && !in_class) {
        out.append("[^").append(kWhiteSpaceClassBody).append("]");
      } else {
        // \S inside a class keeps PCRE2's meaning (it differs only on U+180E).
        out.push_back('\\');
        out.push_back(e);
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out.push_back(pattern[++i]);
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out.push_back(pattern[++i]);  // literal ]
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      size_t close = pattern.find(":]", i + 2);
      if (close != std::string_view::npos) {
        out.append(pattern.substr(i, close + 2 - i));
        i = close + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out.push_back(c);
  }
  return out;
}

Regex::Regex(std::string_view pattern) : pattern_(pattern) {
  std::string translated = translate_regex_for_pcre2(pattern);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  auto* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                             PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    fail("tokenizer.json: cannot compile the pre-tokenizer regex {:?} (PCRE2: {} at offset {})", pattern_,
         reinterpret_cast<const char*>(message), error_offset);
  }
  // Without JIT (unsupported platform) pcre2_match still works, only slower.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

bool Regex::find(std::string_view text, size_t start, size_t& match_start, size_t& match_end) const {
  MatchState& state = match_state();
  // The caller validated the UTF-8 once for the whole input.
  int rc = pcre2_match(static_cast<const pcre2_code*>(code_), reinterpret_cast<PCRE2_SPTR>(text.data()),
                       text.size(), start, PCRE2_NO_UTF_CHECK, state.data, state.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(rc, message, sizeof(message));
    fail("tokenizer: regex {:?} failed on a {}-byte input (PCRE2: {})", pattern_, text.size(),
         reinterpret_cast<const char*>(message));
  }
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
  match_start = ovector[0];
  match_end = ovector[1];
  return true;
}

SplitPreTokenizer::SplitPreTokenizer(std::string_view pattern, bool is_regex, SplitBehavior behavior,
                                     bool invert)
    : behavior_(behavior), invert_(invert) {
  if (is_regex) {
    regex_ = std::make_unique<Regex>(pattern);
  } else {
    if (pattern.empty()) fail("tokenizer.json: a Split pre-tokenizer has an empty string pattern");
    literal_ = std::string(pattern);
  }
}

void SplitPreTokenizer::split(std::string_view piece, PieceSink sink) const {
  // Walks the pieces (gap or match) in order; `pending` accumulates what the behaviour merges.
  size_t pending_start = 0, pending_end = 0;
  bool have_pending = false;
  bool previous_was_match = false;
  auto emit = [&](size_t b, size_t e) {
    if (e > b) sink(piece.substr(b, e - b));
  };
  // The merging behaviours: this part joins the pending one, or the pending one is emitted and this one waits.
  auto merge_or_hold = [&](size_t b, size_t e, bool joins) {
    if (have_pending && joins) {
      pending_end = e;
    } else {
      if (have_pending) emit(pending_start, pending_end);
      pending_start = b, pending_end = e, have_pending = true;
    }
  };
  auto on_part = [&](size_t b, size_t e, bool matched) {
    if (invert_) matched = !matched;
    switch (behavior_) {
      case SplitBehavior::kRemoved:
        if (!matched) emit(b, e);
        break;
      case SplitBehavior::kIsolated:
        emit(b, e);
        break;
      case SplitBehavior::kMergedWithPrevious:  // a match joins the gap before it
        merge_or_hold(b, e, matched && !previous_was_match);
        break;
      case SplitBehavior::kMergedWithNext:  // a match is held and joins the gap after it
        merge_or_hold(b, e, previous_was_match && !matched);
        break;
      case SplitBehavior::kContiguous:  // consecutive matches join
        merge_or_hold(b, e, matched && previous_was_match);
        break;
    }
    previous_was_match = matched;
  };
  size_t previous_end = 0;
  auto on_match = [&](size_t b, size_t e) {
    if (b > previous_end) on_part(previous_end, b, false);
    on_part(b, e, true);
    previous_end = e;
  };
  if (regex_) {
    regex_->for_each_match(piece, on_match);
  } else {
    for (size_t pos = piece.find(literal_); pos != std::string_view::npos;
         pos = piece.find(literal_, pos + literal_.size()))
      on_match(pos, pos + literal_.size());
  }
  if (previous_end < piece.size()) on_part(previous_end, piece.size(), false);
  if (have_pending) emit(pending_start, pending_end);
}

ByteLevelPreTokenizer::ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex)
    : add_prefix_space_(add_prefix_space) {
  if (use_regex) regex_ = std::make_unique<Regex>(kGpt2Pattern);
}

void ByteLevelPreTokenizer::split(std::string_view piece, PieceSink sink) const {
  std::string with_space;
  if (add_prefix_space_ && (piece.empty() || piece.front() != ' ')) {
    with_space.reserve(piece.size() + 1);
    with_space.push_back(' ');
    with_space.append(piece);
    piece = with_space;
  }
  if (!regex_) {
    if (!piece.empty()) sink(piece);
    return;
  }
  size_t previous_end = 0;
  regex_->for_each_match(piece, [&](size_t b, size_t e) {
    if (b > previous_end) sink(piece.substr(previous_end, b - previous_end));
    sink(piece.substr(b, e - b));
    previous_end = e;
  });
  if (previous_end < piece.size()) sink(piece.substr(previous_end));
}

void SequencePreTokenizer::run(size_t step, std::string_view piece, PieceSink sink) const {
  if (step == steps_.size()) {
    sink(piece);
    return;
  }
  auto next = [&](std::string_view sub) { run(step + 1, sub, sink); };
  steps_[step]->split(piece, PieceSink(next));
}

}  // namespace kiln::tok
