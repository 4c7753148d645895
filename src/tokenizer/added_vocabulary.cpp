#include "tokenizer/added_vocabulary.h"

#include <algorithm>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tokenizer/utf8.h"

namespace kiln::tok {
namespace {

// Unicode White_Space (what \s matches in HF's regex engine).
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// \w of Unicode regex engines: letters, marks, decimal digits, connector punctuation, joiners.
// Asked of PCRE2 (with Unicode properties) rather than tabulated again.
bool is_word_char(char32_t c) {
  static const pcre2_code* code = [] {
    int error;
    PCRE2_SIZE offset;
    const char* pattern = R"(^[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}]$)";
    return pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                         &error, &offset, nullptr);
  }();
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  std::string s;
  utf8::append(s, c);
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0, 0, data, nullptr);
  pcre2_match_data_free(data);
  return rc >= 0;
}

// The code point that ends text[0, end) (valid UTF-8).
char32_t last_char(std::string_view text, size_t end, size_t& start) {
  start = end - 1;
  while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
  size_t len;
  return utf8::decode(text, start, len);
}

}  // namespace

void AddedTokenMatcher::build(const std::vector<std::string>& patterns,
                              const std::vector<const AddedToken*>& tokens) {
  nodes_.assign(1, Node{});
  tokens_.clear();
  std::fill(std::begin(first_byte_), std::end(first_byte_), false);
  for (size_t i = 0; i < patterns.size(); ++i) {
    const std::string& pattern = patterns[i];
    if (pattern.empty()) continue;  // HF ignores empty added tokens
    int32_t node = 0;
    for (unsigned char b : pattern) {
      int32_t next = child(node, b);
      if (next < 0) {
        next = static_cast<int32_t>(nodes_.size());
        nodes_.push_back(Node{});
        auto& children = nodes_[node].children;
        children.insert(std::lower_bound(children.begin(), children.end(), std::make_pair(b, int32_t{-1})),
                        {b, next});
      }
      node = next;
    }
    if (nodes_[node].token < 0) {  // the first token with this content wins
      nodes_[node].token = static_cast<int32_t>(tokens_.size());
      tokens_.push_back(tokens[i]);
    }
    first_byte_[static_cast<unsigned char>(pattern[0])] = true;
  }
}

int32_t AddedTokenMatcher::child(int32_t node, uint8_t byte) const {
  const auto& children = nodes_[node].children;
  auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(byte, int32_t{-1}));
  return it != children.end() && it->first == byte ? it->second : -1;
}

void AddedTokenMatcher::split(std::string_view text, bool match_special, std::vector<AddedSplit>& out) const {
  size_t plain_start = 0;  // start of the plain text not yet emitted
  size_t pos = 0;
  while (pos < text.size()) {
    if (!first_byte_[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    // Longest pattern starting at pos.
    int32_t best = -1;
    size_t best_end = 0;
    int32_t node = 0;
    for (size_t i = pos; i < text.size(); ++i) {
      node = child(node, static_cast<uint8_t>(text[i]));
      if (node < 0) break;
      if (nodes_[node].token >= 0) {
        best = nodes_[node].token;
        best_end = i + 1;
      }
    }
    if (best < 0) {
      ++pos;
      continue;
    }
    const AddedToken& token = *tokens_[best];
    size_t start = pos, stop = best_end;
    pos = best_end;  // the match is consumed even when it is then discarded
    if (token.special && !match_special) continue;
    if (start < plain_start) continue;  // overlaps whitespace swallowed by the previous token's rstrip
    if (token.single_word) {
      size_t ignored;
      bool word_before = start > 0 && is_word_char(last_char(text, start, ignored));
      size_t len = 0;
      bool word_after = stop < text.size() && is_word_char(utf8::decode(text, stop, len));
      if (word_before || word_after) continue;
    }
    if (token.lstrip) {
      while (start > plain_start) {
        size_t char_start;
        if (!is_white_space(last_char(text, start, char_start))) break;
        start = char_start;
      }
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        size_t len;
        if (!is_white_space(utf8::decode(text, stop, len))) break;
        stop += len;
      }
      pos = stop;
    }
    if (start > plain_start) out.push_back({plain_start, start, -1});
    out.push_back({start, stop, token.id});
    plain_start = stop;
  }
  if (plain_start < text.size()) out.push_back({plain_start, text.size(), -1});
}

}  // namespace kiln::tok
