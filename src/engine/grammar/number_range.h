// Decimal numbers within bounds, as grammar fragments (digit automata; exact, no sampling-time check).
//
// Text forms are JSON's: an optional '-', an integer part without leading zeros, for decimals an optional fraction
// ('.' and 1..max_fraction_digits digits), never an exponent, never "-0". Integer parts have at most
// max_integer_digits digits on an unbounded side (a bound past that widens it to the bound's length).
#pragma once
#include <cstdint>
#include <optional>

#include "engine/grammar/grammar.h"

namespace kiln::grammar {

// The decimal strings of lo..hi (0 <= lo <= hi), without leading zeros.
Frag unsigned_range(Grammar& g, uint64_t lo, uint64_t hi);

// Integers in [lo, hi] (either side open when absent). Bounds' magnitudes must be below 10^18. Null when no
// integer fits (lo > hi).
std::optional<Frag> integer_range(Grammar& g, std::optional<int64_t> lo, std::optional<int64_t> hi,
                                  int max_integer_digits = 15);

// A bound of a decimal range: an integer value, inclusive or exclusive.
struct DecimalBound {
  int64_t value;
  bool exclusive = false;
};

// Decimals x with lo <= x <= hi (< / > where exclusive), fraction digits at most max_fraction_digits (0: integers
// only). Null when no such number exists.
std::optional<Frag> decimal_range(Grammar& g, std::optional<DecimalBound> lo, std::optional<DecimalBound> hi,
                                  int max_fraction_digits = 15, int max_integer_digits = 15);

// Integers that are multiples of k (1 <= k <= 1000), any length: a remainder automaton over the digits.
Frag multiple_of(Grammar& g, int64_t k);

}  // namespace kiln::grammar
