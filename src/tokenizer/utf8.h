// UTF-8 helpers for the tokenizer.
#pragma once
#include "core/utf8.h"
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln::tok::utf8 {

// The length of the valid UTF-8 sequence starting at s[pos], or 0 if the bytes there are not a
// complete, well-formed sequence (overlongs, surrogates and code points past U+10FFFF are invalid).
size_t valid_sequence_length(std::string_view s, size_t pos);

// Byte offset of the first invalid byte, or s.size() if all of s is valid UTF-8.
size_t first_invalid(std::string_view s);
inline bool is_valid(std::string_view s) { return first_invalid(s) == s.size(); }

// Decodes the code point at s[pos] of valid UTF-8; sets len to its byte length.
inline char32_t decode(std::string_view s, size_t pos, size_t& len) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + pos;
  if (p[0] < 0x80) {
    len = 1;
    return p[0];
  }
  if (p[0] < 0xE0) {
    len = 2;
    return (char32_t(p[0] & 0x1F) << 6) | (p[1] & 0x3F);
  }
  if (p[0] < 0xF0) {
    len = 3;
    return (char32_t(p[0] & 0x0F) << 12) | (char32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  }
  len = 4;
  return (char32_t(p[0] & 0x07) << 18) | (char32_t(p[1] & 0x3F) << 12) | (char32_t(p[2] & 0x3F) << 6) |
         (p[3] & 0x3F);
}

inline void append(std::string& out, char32_t cp) { append_utf8(out, cp); }

// Appends s to out with every maximal ill-formed subsequence replaced by U+FFFD (the Unicode
// "maximal subpart" practice, as Rust's String::from_utf8_lossy and so HF decode do).
// If hold_incomplete_tail, a trailing sequence that is a valid but incomplete prefix is not
// converted: its length is returned so a streaming caller can keep it for the next bytes.
size_t append_lossy(std::string_view s, std::string& out, bool hold_incomplete_tail = false);

}  // namespace kiln::tok::utf8
