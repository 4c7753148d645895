#include "engine/grammar/number_range.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"

namespace kiln::grammar {

namespace {

constexpr int64_t kMaxMagnitude = 1'000'000'000'000'000'000;  // 10^18: bounds must stay below

uint64_t pow10(int n) {
  uint64_t v = 1;
  for (int i = 0; i < n; ++i) v *= 10;
  return v;
}

Frag digits(Grammar& g, int64_t min, int64_t max) { return g.repeat([&] { return g.bytes('0', '9'); }, min, max); }

bool all_of(std::string_view s, char c) { return std::all_of(s.begin(), s.end(), [c](char x) { return x == c; }); }

// Equal-length digit strings a <= b: every string of that length between them.
Frag same_length(Grammar& g, std::string_view a, std::string_view b) {
  const size_t n = a.size();
  if (n == 0) return g.empty();
  if (a == b) return g.literal(a);
  const auto a0 = static_cast<uint8_t>(a[0]), b0 = static_cast<uint8_t>(b[0]);
  const int64_t rest = static_cast<int64_t>(n - 1);
  if (all_of(a.substr(1), '0') && all_of(b.substr(1), '9')) return g.seq({g.bytes(a0, b0), digits(g, rest, rest)});
  if (a0 == b0) return g.seq({g.literal(a.substr(0, 1)), same_length(g, a.substr(1), b.substr(1))});
  const std::string nines(n - 1, '9'), zeros(n - 1, '0');
  std::vector<Frag> opts{g.seq({g.literal(a.substr(0, 1)), same_length(g, a.substr(1), nines)})};
  if (a0 + 1 <= b0 - 1)
    opts.push_back(g.seq({g.bytes(static_cast<uint8_t>(a0 + 1), static_cast<uint8_t>(b0 - 1)), digits(g, rest, rest)}));
  opts.push_back(g.seq({g.literal(b.substr(0, 1)), same_length(g, zeros, b.substr(1))}));
  return g.alt(std::move(opts));
}

Frag alt_or_one(Grammar& g, std::vector<Frag> opts) { return opts.size() == 1 ? opts[0] : g.alt(std::move(opts)); }

}  // namespace

Frag unsigned_range(Grammar& g, uint64_t lo, uint64_t hi) {
  KILN_CHECK(lo <= hi && hi < pow10(19), "unsigned_range {}..{}", lo, hi);
  const int len_lo = static_cast<int>(std::to_string(lo).size()), len_hi = static_cast<int>(std::to_string(hi).size());
  std::vector<Frag> opts;
  for (int len = len_lo; len <= len_hi; ++len) {
    const uint64_t a = std::max(lo, len == 1 ? uint64_t(0) : pow10(len - 1));
    const uint64_t b = std::min(hi, pow10(len) - 1);
    if (a <= b) opts.push_back(same_length(g, std::to_string(a), std::to_string(b)));
  }
  return alt_or_one(g, std::move(opts));
}

std::optional<Frag> integer_range(Grammar& g, std::optional<int64_t> lo, std::optional<int64_t> hi,
                                  int max_integer_digits) {
  KILN_CHECK((!lo || (*lo > -kMaxMagnitude && *lo < kMaxMagnitude)) && (!hi || (*hi > -kMaxMagnitude && *hi < kMaxMagnitude)),
             "integer_range bounds past 10^18");
  if (lo && hi && *lo > *hi) return std::nullopt;
  const int64_t cap = static_cast<int64_t>(pow10(max_integer_digits)) - 1;
  std::vector<Frag> opts;
  if (!lo || *lo < 0) {
    const int64_t m_lo = hi && *hi < 0 ? -*hi : 1;
    const int64_t m_hi = lo ? -*lo : std::max(cap, m_lo);
    if (m_lo <= m_hi)
      opts.push_back(g.seq({g.literal("-"), unsigned_range(g, static_cast<uint64_t>(m_lo), static_cast<uint64_t>(m_hi))}));
  }
  if (!hi || *hi >= 0) {
    const int64_t a = lo ? std::max<int64_t>(*lo, 0) : 0;
    const int64_t b = hi ? *hi : std::max(cap, a);
    opts.push_back(unsigned_range(g, static_cast<uint64_t>(a), static_cast<uint64_t>(b)));
  }
  if (opts.empty()) return std::nullopt;
  return alt_or_one(g, std::move(opts));
}

namespace {

struct Fractions {
  Grammar& g;
  int max_digits;
  Frag any() { return g.opt(g.seq({g.literal("."), digits(g, 1, max_digits)})); }
  Frag zero() { return g.opt(g.seq({g.literal("."), g.repeat([&] { return g.literal("0"); }, 1, max_digits)})); }
  Frag nonzero() {  // at least one digit that is not 0
    std::vector<Frag> opts;
    for (int p = 0; p < max_digits; ++p)
      opts.push_back(g.seq({g.repeat([&] { return g.literal("0"); }, p, p), g.bytes('1', '9'),
                            digits(g, 0, max_digits - 1 - p)}));
    return g.seq({g.literal("."), alt_or_one(g, std::move(opts))});
  }
};

// Non-negative decimals in the range: lo.value >= 0.
void nonnegative(Grammar& g, Fractions& f, DecimalBound lo, std::optional<DecimalBound> hi, int64_t cap,
                 std::vector<Frag>& out) {
  const int64_t l = lo.value;
  auto exactly = [&](int64_t v) { return g.literal(std::to_string(v)); };
  auto at_low = [&] { return g.seq({exactly(l), lo.exclusive ? f.nonzero() : f.any()}); };
  if (!hi) {
    const int64_t top = std::max(cap, l + 1);
    out.push_back(g.seq({unsigned_range(g, static_cast<uint64_t>(l + 1), static_cast<uint64_t>(top)), f.any()}));
    out.push_back(at_low());
    return;
  }
  const int64_t h = hi->value;
  if (l < h) {
    if (l + 1 <= h - 1)
      out.push_back(g.seq({unsigned_range(g, static_cast<uint64_t>(l + 1), static_cast<uint64_t>(h - 1)), f.any()}));
    out.push_back(at_low());
    if (!hi->exclusive) out.push_back(g.seq({exactly(h), f.zero()}));
  } else if (l == h && !lo.exclusive && !hi->exclusive) {
    out.push_back(g.seq({exactly(l), f.zero()}));
  }
}

}  // namespace

std::optional<Frag> decimal_range(Grammar& g, std::optional<DecimalBound> lo, std::optional<DecimalBound> hi,
                                  int max_fraction_digits, int max_integer_digits) {
  KILN_CHECK((!lo || (lo->value > -kMaxMagnitude && lo->value < kMaxMagnitude)) &&
                 (!hi || (hi->value > -kMaxMagnitude && hi->value < kMaxMagnitude)),
             "decimal_range bounds past 10^18");
  if (max_fraction_digits <= 0) {
    std::optional<int64_t> ilo, ihi;
    if (lo) ilo = lo->value + (lo->exclusive ? 1 : 0);
    if (hi) ihi = hi->value - (hi->exclusive ? 1 : 0);
    return integer_range(g, ilo, ihi, max_integer_digits);
  }
  if (lo && hi && lo->value > hi->value) return std::nullopt;
  const int64_t cap = static_cast<int64_t>(pow10(max_integer_digits)) - 1;
  Fractions f{g, max_fraction_digits};
  std::vector<Frag> opts;
  if (!lo || lo->value < 0) {  // x = -m, m > 0
    const DecimalBound m_lo = hi && hi->value < 0 ? DecimalBound{-hi->value, hi->exclusive} : DecimalBound{0, true};
    std::optional<DecimalBound> m_hi;
    if (lo) m_hi = DecimalBound{-lo->value, lo->exclusive};
    std::vector<Frag> neg;
    nonnegative(g, f, m_lo, m_hi, cap, neg);
    if (!neg.empty()) opts.push_back(g.seq({g.literal("-"), alt_or_one(g, std::move(neg))}));
  }
  if (!hi || hi->value > 0 || (hi->value == 0 && !hi->exclusive)) {
    const DecimalBound low = lo && lo->value >= 0 ? *lo : DecimalBound{0, false};
    nonnegative(g, f, low, hi, cap, opts);
  }
  if (opts.empty()) return std::nullopt;
  return alt_or_one(g, std::move(opts));
}

Frag multiple_of(Grammar& g, int64_t k) {
  KILN_CHECK(k >= 1 && k <= 1000, "multiple_of {}", k);
  std::vector<int32_t> rem(static_cast<size_t>(k));
  for (auto& r : rem) r = g.empty().start;
  const int32_t start = g.empty().start, end = g.empty().start;
  auto edge = [&](int32_t from, int digit, int64_t to) {
    const Frag b = g.bytes(static_cast<uint8_t>('0' + digit), static_cast<uint8_t>('0' + digit));
    g.link(from, b.start);
    g.link(b.end, rem[static_cast<size_t>(to)]);
  };
  for (int d = 1; d <= 9; ++d) edge(start, d, d % k);
  for (int64_t r = 0; r < k; ++r)
    for (int d = 0; d <= 9; ++d) edge(rem[static_cast<size_t>(r)], d, (10 * r + d) % k);
  g.link(rem[0], end);
  return g.alt({g.literal("0"), g.seq({g.opt(g.literal("-")), Frag{start, end}})});
}

}  // namespace kiln::grammar
