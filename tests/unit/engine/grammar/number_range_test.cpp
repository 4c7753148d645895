// Digit automata for bounded numbers against plain integer arithmetic: every integer (and every decimal with up to
// two fraction digits) in a window is accepted exactly when the arithmetic says it lies within the bounds.
#include <gtest/gtest.h>

#include <cstdio>

#include "engine/grammar/number_range.h"

namespace kiln::grammar {
namespace {

template <typename Build>
std::shared_ptr<const Grammar> grammar_of(Build build) {
  auto g = std::make_shared<Grammar>();
  const int32_t root = g->new_rule("root");
  g->define_rule(root, build(*g));
  g->set_root(root);
  return g;
}

bool matches(Automaton& a, std::string_view text) {
  const int32_t s = a.step_bytes(a.initial_state(), text);
  return s != Automaton::kDead && a.accepting(s);
}

TEST(NumberRange, UnsignedRangesAgainstArithmetic) {
  const std::pair<uint64_t, uint64_t> ranges[] = {{0, 0}, {0, 9}, {3, 7}, {7, 123}, {10, 99}, {99, 1000}, {105, 2094},
                                                  {1999, 2001}, {0, 5000}};
  for (auto [lo, hi] : ranges) {
    Automaton a(grammar_of([&](Grammar& g) { return unsigned_range(g, lo, hi); }));
    for (uint64_t v = 0; v <= 6000; ++v)
      ASSERT_EQ(matches(a, std::to_string(v)), v >= lo && v <= hi) << lo << ".." << hi << " at " << v;
    EXPECT_FALSE(matches(a, "0" + std::to_string(lo))) << "leading zero";
  }
  Automaton big(grammar_of([](Grammar& g) { return unsigned_range(g, 999'999'999'999'999'990ull, 999'999'999'999'999'999ull); }));
  EXPECT_TRUE(matches(big, "999999999999999995"));
  EXPECT_FALSE(matches(big, "999999999999999989"));
}

TEST(NumberRange, SignedIntegerRangesAgainstArithmetic) {
  const std::pair<std::optional<int64_t>, std::optional<int64_t>> ranges[] = {
      {-5, 5}, {-1234, -17}, {0, 0}, {-1, -1}, {7, std::nullopt}, {std::nullopt, -3}, {-250, std::nullopt},
      {std::nullopt, 42}, {std::nullopt, std::nullopt}};
  for (auto [lo, hi] : ranges) {
    Automaton a(grammar_of([&](Grammar& g) { return *integer_range(g, lo, hi, 4); }));
    for (int64_t v = -12000; v <= 12000; ++v) {
      const bool in = (!lo || v >= *lo) && (!hi || v <= *hi) && v > -10000 && v < 10000;  // 4 digits when open
      ASSERT_EQ(matches(a, std::to_string(v)), in) << (lo ? *lo : -1) << ".." << (hi ? *hi : -1) << " at " << v;
    }
    EXPECT_FALSE(matches(a, "-0"));
    EXPECT_FALSE(matches(a, "+1"));
    EXPECT_FALSE(matches(a, "1.0"));
  }
  Grammar g;
  EXPECT_FALSE(integer_range(g, 5, 4).has_value());
}

// Decimals "x", "x.d", "x.dd" (and "x.d0"-style zeros) for x in a window, against bounds in hundredths.
TEST(NumberRange, DecimalRangesAgainstArithmetic) {
  struct Bounds {
    std::optional<DecimalBound> lo, hi;
  };
  const Bounds cases[] = {
      {DecimalBound{0, false}, DecimalBound{1, false}}, {DecimalBound{0, true}, DecimalBound{1, true}},
      {DecimalBound{-3, false}, DecimalBound{2, true}}, {DecimalBound{-3, true}, DecimalBound{-1, false}},
      {DecimalBound{5, true}, std::nullopt},            {std::nullopt, DecimalBound{0, true}},
      {std::nullopt, DecimalBound{0, false}},           {DecimalBound{2, false}, DecimalBound{2, false}},
      {DecimalBound{-7, false}, std::nullopt},
  };
  for (const Bounds& b : cases) {
    Automaton a(grammar_of([&](Grammar& g) { return *decimal_range(g, b.lo, b.hi, 2, 3); }));
    auto inside = [&](int64_t hundredths) {
      if (b.lo && (b.lo->exclusive ? hundredths <= b.lo->value * 100 : hundredths < b.lo->value * 100)) return false;
      if (b.hi && (b.hi->exclusive ? hundredths >= b.hi->value * 100 : hundredths > b.hi->value * 100)) return false;
      return hundredths > -100000 && hundredths < 100000;  // 3 integer digits on an open side
    };
    for (int64_t h = -1200; h <= 1200; ++h) {
      const int64_t mag = h < 0 ? -h : h;
      const std::string sign = h < 0 ? "-" : "";
      const std::string ip = std::to_string(mag / 100);
      char frac[4];
      std::snprintf(frac, sizeof frac, "%02d", static_cast<int>(mag % 100));
      std::vector<std::string> forms{sign + ip + "." + frac};
      if (mag % 10 == 0) forms.push_back(sign + ip + "." + frac[0]);
      if (mag % 100 == 0) forms.push_back(sign + ip);
      for (const std::string& f : forms)
        ASSERT_EQ(matches(a, f), inside(h) && f != "-0" && f != "-0.0" && f != "-0.00") << f;
    }
    EXPECT_FALSE(matches(a, "1.234"));  // three fraction digits
    EXPECT_FALSE(matches(a, "1e1"));
  }
  Grammar g;
  EXPECT_FALSE(decimal_range(g, DecimalBound{1, true}, DecimalBound{1, false}).has_value());
  EXPECT_FALSE(decimal_range(g, DecimalBound{2, false}, DecimalBound{1, false}).has_value());
}

TEST(NumberRange, MultipleOfAgainstArithmetic) {
  for (int64_t k : {1, 2, 3, 7, 10, 12, 25, 999}) {
    Automaton a(grammar_of([&](Grammar& g) { return multiple_of(g, k); }));
    for (int64_t v = -5000; v <= 5000; ++v)
      ASSERT_EQ(matches(a, std::to_string(v)), v % k == 0) << k << " at " << v;
    EXPECT_FALSE(matches(a, "-0"));
    EXPECT_FALSE(matches(a, "00"));
  }
}

}  // namespace
}  // namespace kiln::grammar
