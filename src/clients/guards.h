// Guards against broken model output (REFERENCE §7: kernels that return "!!!!", token 0 over and
// over, NUL bytes; degenerate loops). Each returns why the text is bad, or nothing when it is fine.
//
// Degenerate repetition is defined as either of:
//  (a) a run: a pattern of 1..max_period_chars characters (not only whitespace) repeated back to back
//      at least min_repeats times, the run covering at least min_run_chars characters
//      ("!!!!...", "the the the ...", a sentence looping);
//  (b) in a text of at least min_words words (words: runs of letters and digits, case-folded):
//      one word making up more than max_word_share of all words, or distinct word 3-grams fewer
//      than min_distinct_trigram_share of all 3-grams (the same phrases coming back again and again).
// Natural prose is far from both: its most common word ("the") is ~5-7% of words and nearly all
// of its 3-grams are distinct.
#pragma once
#include <optional>
#include <string>
#include <string_view>

namespace kiln::clients {

struct RepetitionLimits {
  struct Run {  // (a)
    size_t max_period_chars = 256;
    size_t min_repeats = 4;
    size_t min_run_chars = 40;
  } run;
  struct Words {  // (b)
    size_t min_words = 40;
    double max_word_share = 0.30;
    double min_distinct_trigram_share = 0.50;
  } words;
};

// NUL, U+FFFD (what a decoder makes of invalid bytes), other C0 control characters except tab,
// newline and carriage return, and invalid UTF-8.
std::optional<std::string> check_bad_characters(std::string_view text);
// Garbage like "!!!!!!" or "???": text with no letter or digit at all (any non-ASCII character
// counts as a letter, so non-Latin scripts pass). Empty text passes (see check_output).
std::optional<std::string> check_no_letters_or_digits(std::string_view text);
std::optional<std::string> check_repetition(std::string_view text, const RepetitionLimits& limits = {});
// "<think>" or "</think>" in text that should hold no reasoning markup.
std::optional<std::string> check_think_tags(std::string_view text);

// Every guard above on one field of an answer; `what` names it in the message ("content").
// allow_empty: an empty (or whitespace-only) text passes; otherwise it fails as "empty".
std::optional<std::string> check_output(std::string_view text, std::string_view what, bool allow_empty = false);

}  // namespace kiln::clients
