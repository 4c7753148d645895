#include "clients/guards.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace kiln::clients {

namespace {

bool is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
bool is_word_byte(unsigned char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80; }

// A pattern as it reads in a message: escaped, and cut when long.
std::string quoted(std::string_view text, size_t max_chars = 40) {
  std::string out = "\"";
  for (size_t i = 0; i < text.size() && i < max_chars; ++i) {
    unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '"') out += "\\\"";
    else if (c < 0x20) out += fmt::format("\\x{:02x}", c);
    else out += static_cast<char>(c);
  }
  if (text.size() > max_chars) out += "...";
  return out + "\"";
}

// Decodes the UTF-8 sequence at text[i]; returns its length, or 0 if invalid (overlong, surrogate,
// out of range, truncated).
size_t decode_utf8(std::string_view text, size_t i, uint32_t* codepoint) {
  unsigned char c = static_cast<unsigned char>(text[i]);
  size_t len;
  uint32_t cp;
  if (c < 0x80) {
    *codepoint = c;
    return 1;
  } else if ((c & 0xE0) == 0xC0) {
    len = 2, cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    len = 3, cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    len = 4, cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + len > text.size()) return 0;
  for (size_t k = 1; k < len; ++k) {
    unsigned char cont = static_cast<unsigned char>(text[i + k]);
    if ((cont & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (cont & 0x3F);
  }
  static constexpr uint32_t kMinForLength[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMinForLength[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  *codepoint = cp;
  return len;
}

std::vector<std::string> words_of(std::string_view text) {
  std::vector<std::string> words;
  std::string word;
  for (char ch : text) {
    unsigned char c = static_cast<unsigned char>(ch);
    if (is_word_byte(c)) {
      word += (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : static_cast<char>(c);
    } else if (!word.empty()) {
      words.push_back(std::move(word));
      word.clear();
    }
  }
  if (!word.empty()) words.push_back(std::move(word));
  return words;
}

}  // namespace

std::optional<std::string> check_bad_characters(std::string_view text) {
  size_t nul = 0, replacement = 0, control = 0;
  size_t first_nul = 0, first_replacement = 0, first_control = 0;
  uint32_t control_cp = 0;
  for (size_t i = 0; i < text.size();) {
    uint32_t cp = 0;
    size_t len = decode_utf8(text, i, &cp);
    if (len == 0) return fmt::format("invalid UTF-8 at byte {}", i);
    if (cp == 0) {
      if (nul++ == 0) first_nul = i;
    } else if (cp == 0xFFFD) {
      if (replacement++ == 0) first_replacement = i;
    } else if ((cp < 0x20 && cp != '\t' && cp != '\n' && cp != '\r') || cp == 0x7F) {
      if (control++ == 0) first_control = i, control_cp = cp;
    }
    i += len;
  }
  if (nul) return fmt::format("{} NUL character(s) (first at byte {})", nul, first_nul);
  if (replacement)
    return fmt::format("{} U+FFFD replacement character(s), the mark of undecodable bytes (first at byte {})",
                       replacement, first_replacement);
  if (control)
    return fmt::format("{} control character(s) (first U+{:04X} at byte {})", control, control_cp, first_control);
  return std::nullopt;
}

std::optional<std::string> check_no_letters_or_digits(std::string_view text) {
  bool any_visible = false;
  for (char ch : text) {
    unsigned char c = static_cast<unsigned char>(ch);
    if (is_word_byte(c)) return std::nullopt;
    if (!is_space(c)) any_visible = true;
  }
  if (!any_visible) return std::nullopt;
  return fmt::format("garbage: no letter or digit in {}", quoted(text));
}

namespace {

// (a) back-to-back runs; the smallest period is reported.
std::optional<std::string> check_repeated_run(std::string_view text, const RepetitionLimits::Run& limits) {
  const size_t n = text.size();
  for (size_t period = 1; period <= limits.max_period_chars && period * limits.min_repeats <= n; ++period) {
    size_t run = 0;  // consecutive positions i with text[i] == text[i + period]
    for (size_t i = 0; i + period < n; ++i) {
      if (text[i] != text[i + period]) {
        run = 0;
        continue;
      }
      ++run;
      size_t span = run + period;
      if (span / period < limits.min_repeats || span < limits.min_run_chars) continue;
      // Only report when the run ends here (to count it fully) or the text ends.
      if (i + period + 1 < n && text[i + 1] == text[i + 1 + period]) continue;
      size_t start = i + 1 - run;
      std::string_view pattern = text.substr(start, period);
      if (std::all_of(pattern.begin(), pattern.end(), [](char c) { return is_space(static_cast<unsigned char>(c)); }))
        continue;
      return fmt::format("degenerate repetition: {} repeated {} times in a row ({} characters from byte {})",
                         quoted(pattern), span / period, span, start);
    }
  }
  return std::nullopt;
}

// (b) repetition spread over a long text.
std::optional<std::string> check_repeated_words(std::string_view text, const RepetitionLimits::Words& limits) {
  std::vector<std::string> words = words_of(text);
  if (words.size() < limits.min_words) return std::nullopt;
  std::unordered_map<std::string, size_t> counts;
  for (const auto& w : words) ++counts[w];
  auto top = std::max_element(counts.begin(), counts.end(), [](auto& a, auto& b) { return a.second < b.second; });
  double share = static_cast<double>(top->second) / static_cast<double>(words.size());
  if (share > limits.max_word_share)
    return fmt::format("degenerate repetition: the word {} makes up {:.0f}% of {} words", quoted(top->first),
                       100 * share, words.size());
  std::unordered_set<std::string> trigrams;
  size_t total = words.size() - 2;
  for (size_t i = 0; i < total; ++i) trigrams.insert(words[i] + '\x1f' + words[i + 1] + '\x1f' + words[i + 2]);
  double distinct = static_cast<double>(trigrams.size()) / static_cast<double>(total);
  if (distinct < limits.min_distinct_trigram_share)
    return fmt::format("degenerate repetition: only {:.0f}% of the {} word 3-grams are distinct (phrases loop)",
                       100 * distinct, total);
  return std::nullopt;
}

}  // namespace

std::optional<std::string> check_repetition(std::string_view text, const RepetitionLimits& limits) {
  if (auto why = check_repeated_run(text, limits.run)) return why;
  return check_repeated_words(text, limits.words);
}

std::optional<std::string> check_think_tags(std::string_view text) {
  for (std::string_view tag : {std::string_view("</think>"), std::string_view("<think>")}) {
    size_t at = text.find(tag);
    if (at != std::string_view::npos) return fmt::format("leaked {} tag at byte {}", tag, at);
  }
  return std::nullopt;
}

std::optional<std::string> check_output(std::string_view text, std::string_view what, bool allow_empty) {
  bool blank = std::all_of(text.begin(), text.end(), [](char c) { return is_space(static_cast<unsigned char>(c)); });
  if (blank) {
    if (allow_empty) return std::nullopt;
    return fmt::format("{} is empty", what);
  }
  for (auto check : {check_bad_characters, check_no_letters_or_digits, check_think_tags}) {
    if (auto why = check(text)) return fmt::format("{}: {}", what, *why);
  }
  if (auto why = check_repetition(text)) return fmt::format("{}: {}", what, *why);
  return std::nullopt;
}

}  // namespace kiln::clients
