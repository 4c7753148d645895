// Regular expressions -> grammar fragments (a Thompson NFA inside a Grammar; the Automaton runs it like any rule).
//
// The syntax is the ECMA-262 subset that JSON Schema's "pattern" and "format" use:
//   literals (any UTF-8 text), '.', classes [a-z0-9_] and [^...], escapes \d \D \w \W \s \S \t \n \r \f \v \0
//   \xHH \uHHHH \u{H...} and an escaped punctuation character, groups (...) (?:...) (?<name>...), alternation |,
//   quantifiers * + ? {n} {n,} {n,m} (a lazy '?' after one is accepted: it changes no match), anchors ^ and $ at the
//   start / end of the pattern (or of a top-level alternative).
// Anything else (back-references, lookaround, \b \B, Unicode property escapes, flags, anchors mid-pattern) is a
// kiln::Error that names the feature, never a silent approximation. Repetition bounds above kMaxRepeat are refused.
//
// Matching works on Unicode code points (never a surrogate). How each code point becomes bytes is the caller's: raw
// UTF-8 (utf8_class) or, for JSON strings, escaped JSON text; the caller's CharEmitter decides.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/grammar/grammar.h"

namespace kiln::grammar {

// Code points lo..hi inclusive. A set is a sorted list of disjoint, non-adjacent ranges.
struct CodepointRange {
  uint32_t lo, hi;
};
using CodepointSet = std::vector<CodepointRange>;

inline constexpr uint32_t kMaxCodepoint = 0x10FFFF;
inline constexpr int64_t kMaxRepeat = 1000;

// Sorted, merged, surrogates (D800-DFFF) removed.
CodepointSet normalize(CodepointSet set);
CodepointSet complement(const CodepointSet& set);  // of the valid code points
CodepointSet intersect(const CodepointSet& a, const CodepointSet& b);

// One code point of the set as raw UTF-8 (fresh nodes). The set must not be empty.
Frag utf8_class(Grammar& g, const CodepointSet& set);

// Makes the fragment for one character from a (non-empty, normalized) set; called once per character position.
using CharEmitter = std::function<Frag(Grammar& g, const CodepointSet& set)>;

struct RegexOptions {
  // true: JSON Schema "pattern" semantics (a match anywhere: text before and after is free unless ^ / $ anchor it).
  // false: the whole text must match (SGLang's "regex", JSON Schema "format" patterns).
  bool search = false;
  CharEmitter emit;  // null: utf8_class
};

// The fragment matching the pattern's language. Throws kiln::Error on a syntax error or an unsupported feature
// (the message names it and its offset).
Frag compile_regex(Grammar& g, std::string_view pattern, const RegexOptions& options = {});

}  // namespace kiln::grammar
