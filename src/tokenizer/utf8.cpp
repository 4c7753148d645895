#include "tokenizer/utf8.h"

namespace kiln::tok::utf8 {
namespace {

// For a lead byte: the number of bytes of its sequence and the allowed range of the second byte
// (Unicode Table 3-7, "well-formed UTF-8 byte sequences"). n == 0: not a lead byte.
struct LeadInfo {
  uint8_t n;
  uint8_t second_lo;
  uint8_t second_hi;
};

inline LeadInfo lead_info(unsigned char b) {
  if (b < 0x80) return {1, 0, 0};
  if (b < 0xC2) return {0, 0, 0};
  if (b < 0xE0) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b < 0xF0) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b < 0xF4) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

// How many bytes from pos form the longest well-formed prefix of a sequence (at least 1 when the
// lead byte is valid), and whether that prefix is a whole sequence.
inline size_t well_formed_prefix(std::string_view s, size_t pos, bool& complete) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  LeadInfo info = lead_info(p[pos]);
  complete = false;
  if (info.n == 0) return 0;
  if (info.n == 1) {
    complete = true;
    return 1;
  }
  size_t i = 1;
  for (; i < info.n && pos + i < s.size(); ++i) {
    unsigned char b = p[pos + i];
    bool ok = i == 1 ? (b >= info.second_lo && b <= info.second_hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return i;
  }
  complete = i == info.n;
  return i;
}

}  // namespace

size_t valid_sequence_length(std::string_view s, size_t pos) {
  bool complete;
  size_t n = well_formed_prefix(s, pos, complete);
  return complete ? n : 0;
}

size_t first_invalid(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    // ASCII runs, 8 bytes at a time.
    while (i + 8 <= s.size()) {
      uint64_t w;
      __builtin_memcpy(&w, p + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= s.size()) break;
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    size_t n = valid_sequence_length(s, i);
    if (n == 0) return i;
    i += n;
  }
  return s.size();
}

size_t append_lossy(std::string_view s, std::string& out, bool hold_incomplete_tail) {
  size_t i = 0;
  size_t run_start = 0;  // start of the current run of valid bytes, copied in one go
  while (i < s.size()) {
    bool complete;
    size_t n = well_formed_prefix(s, i, complete);
    if (complete) {
      i += n;
      continue;
    }
    out.append(s.data() + run_start, i - run_start);
    if (n > 0 && i + n == s.size() && hold_incomplete_tail) return n;  // may still be completed
    out.append("\xEF\xBF\xBD");  // U+FFFD for the maximal subpart (or one invalid byte)
    i += n > 0 ? n : 1;
    run_start = i;
  }
  out.append(s.data() + run_start, i - run_start);
  return 0;
}

}  // namespace kiln::tok::utf8
