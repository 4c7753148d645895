#include "engine/grammar/regex.h"

#include <algorithm>

#include "core/error.h"

namespace kiln::grammar {

CodepointSet normalize(CodepointSet set) {
  std::sort(set.begin(), set.end(), [](const CodepointRange& a, const CodepointRange& b) { return a.lo < b.lo; });
  CodepointSet merged;
  for (CodepointRange r : set) {
    if (r.lo > r.hi) continue;
    r.hi = std::min(r.hi, kMaxCodepoint);
    if (!merged.empty() && r.lo <= merged.back().hi + 1) merged.back().hi = std::max(merged.back().hi, r.hi);
    else merged.push_back(r);
  }
  CodepointSet out;  // without surrogates
  for (CodepointRange r : merged) {
    if (r.hi < 0xD800 || r.lo > 0xDFFF) {
      out.push_back(r);
      continue;
    }
    if (r.lo < 0xD800) out.push_back({r.lo, 0xD7FF});
    if (r.hi > 0xDFFF) out.push_back({0xE000, r.hi});
  }
  return out;
}

CodepointSet complement(const CodepointSet& set) {
  CodepointSet n = normalize(set), out;
  uint32_t next = 0;
  for (CodepointRange r : n) {
    if (r.lo > next) out.push_back({next, r.lo - 1});
    next = r.hi + 1;
  }
  if (next <= kMaxCodepoint) out.push_back({next, kMaxCodepoint});
  return normalize(out);
}

CodepointSet intersect(const CodepointSet& a, const CodepointSet& b) {
  CodepointSet x = normalize(a), y = normalize(b), out;
  size_t i = 0, j = 0;
  while (i < x.size() && j < y.size()) {
    const uint32_t lo = std::max(x[i].lo, y[j].lo), hi = std::min(x[i].hi, y[j].hi);
    if (lo <= hi) out.push_back({lo, hi});
    if (x[i].hi < y[j].hi) ++i;
    else ++j;
  }
  return out;
}

namespace {

int utf8_length(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

void encode(uint32_t cp, uint8_t* out, int n) {
  if (n == 1) {
    out[0] = static_cast<uint8_t>(cp);
    return;
  }
  for (int i = n - 1; i > 0; --i) {
    out[i] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
    cp >>= 6;
  }
  out[0] = static_cast<uint8_t>((n == 2 ? 0xC0 : n == 3 ? 0xE0 : 0xF0) | cp);
}

// lo..hi (same UTF-8 length n) as byte-range sequences: split until every byte position is a plain range.
void utf8_sequences(uint32_t lo, uint32_t hi, int n, std::vector<std::vector<std::pair<uint8_t, uint8_t>>>& out) {
  for (int i = 1; i < n; ++i) {
    const uint32_t m = (uint32_t(1) << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8_sequences(lo, lo | m, n, out);
        utf8_sequences((lo | m) + 1, hi, n, out);
        return;
      }
      if ((hi & m) != m) {
        utf8_sequences(lo, (hi & ~m) - 1, n, out);
        utf8_sequences(hi & ~m, hi, n, out);
        return;
      }
    }
  }
  uint8_t a[4], b[4];
  encode(lo, a, n);
  encode(hi, b, n);
  std::vector<std::pair<uint8_t, uint8_t>> seq;
  for (int k = 0; k < n; ++k) seq.push_back({a[k], b[k]});
  out.push_back(std::move(seq));
}

}  // namespace

Frag utf8_class(Grammar& g, const CodepointSet& set) {
  std::array<bool, 256> ascii{};
  bool any_ascii = false;
  std::vector<std::vector<std::pair<uint8_t, uint8_t>>> seqs;
  for (CodepointRange r : set) {
    for (int n = 1; n <= 4; ++n) {
      const uint32_t first = n == 1 ? 0 : n == 2 ? 0x80 : n == 3 ? 0x800 : 0x10000;
      const uint32_t last = n == 1 ? 0x7F : n == 2 ? 0x7FF : n == 3 ? 0xFFFF : kMaxCodepoint;
      const uint32_t lo = std::max(r.lo, first), hi = std::min(r.hi, last);
      if (lo > hi) continue;
      if (n == 1) {
        for (uint32_t c = lo; c <= hi; ++c) ascii[c] = true;
        any_ascii = true;
      } else {
        utf8_sequences(lo, hi, n, seqs);
      }
    }
  }
  std::vector<Frag> options;
  if (any_ascii) options.push_back(g.byte_set(ascii));
  for (const auto& seq : seqs) {
    std::vector<Frag> parts;
    for (auto [lo, hi] : seq) parts.push_back(g.bytes(lo, hi));
    options.push_back(g.seq(std::move(parts)));
  }
  KILN_CHECK(!options.empty(), "utf8_class of an empty set");
  return options.size() == 1 ? options[0] : g.alt(std::move(options));
}

namespace {

struct Re {
  enum Kind { kEmpty, kSet, kConcat, kAlt, kRepeat } kind = kEmpty;
  CodepointSet set;
  std::vector<Re> kids;
  int64_t min = 0, max = -1;
};

struct TopAlternative {
  Re re;
  bool start_anchor = false, end_anchor = false;
};

constexpr int kMaxGroupDepth = 64;

CodepointSet digit_set() { return {{'0', '9'}}; }
CodepointSet word_set() { return normalize({{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}}); }
CodepointSet space_set() {  // ECMA-262 WhiteSpace and LineTerminator
  return normalize({{'\t', '\r'}, {' ', ' '}, {0xA0, 0xA0}, {0x1680, 0x1680}, {0x2000, 0x200A}, {0x2028, 0x2029},
                    {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000}, {0xFEFF, 0xFEFF}});
}

class Parser {
 public:
  explicit Parser(std::string_view pattern) : src_(pattern) { decode(); }

  std::vector<TopAlternative> parse() {
    std::vector<TopAlternative> out;
    while (true) {
      TopAlternative a;
      if (peek('^')) {
        ++pos_;
        a.start_anchor = true;
      }
      a.re = concat(0, &a.end_anchor);
      out.push_back(std::move(a));
      if (at_end()) break;
      if (peek('|')) {
        ++pos_;
        continue;
      }
      if (peek(')')) error("unbalanced ')'");
      error("unexpected character");
    }
    return out;
  }

 private:
  [[noreturn]] void error(const std::string& what) const {
    fail("regular expression /{}/: {} at offset {}", src_, what, offset());
  }
  [[noreturn]] void unsupported(const std::string& feature) const {
    fail("regular expression /{}/: {} (at offset {}) is not supported; supported: literals, '.', classes [...], "
         "\\d \\w \\s and their negations, groups, '|', quantifiers * + ? {{m,n}}, ^ and $ at the ends",
         src_, feature, offset());
  }
  size_t offset() const { return pos_ < offsets_.size() ? offsets_[pos_] : src_.size(); }

  void decode() {
    for (size_t i = 0; i < src_.size();) {
      const auto c = static_cast<uint8_t>(src_[i]);
      int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
      if (n == 0 || i + static_cast<size_t>(n) > src_.size()) fail("regular expression: invalid UTF-8 at byte {}", i);
      uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1Fu) : n == 3 ? (c & 0x0Fu) : (c & 0x07u);
      for (int k = 1; k < n; ++k) {
        const auto cc = static_cast<uint8_t>(src_[i + static_cast<size_t>(k)]);
        if ((cc >> 6) != 2) fail("regular expression: invalid UTF-8 at byte {}", i);
        cp = (cp << 6) | (cc & 0x3Fu);
      }
      if (utf8_length(cp) != n || cp > kMaxCodepoint || (cp >= 0xD800 && cp <= 0xDFFF))
        fail("regular expression: invalid UTF-8 at byte {}", i);
      cps_.push_back(cp);
      offsets_.push_back(i);
      i += static_cast<size_t>(n);
    }
  }

  bool at_end() const { return pos_ >= cps_.size(); }
  bool peek(uint32_t c) const { return !at_end() && cps_[pos_] == c; }
  uint32_t next() {
    if (at_end()) error("unexpected end of pattern");
    return cps_[pos_++];
  }

  Re alternation(int depth, bool* end_anchor) {
    Re alt{Re::kAlt};
    alt.kids.push_back(concat(depth, end_anchor));
    while (peek('|')) {
      ++pos_;
      alt.kids.push_back(concat(depth, end_anchor));
    }
    return alt.kids.size() == 1 ? std::move(alt.kids[0]) : alt;
  }

  // Terms up to '|', ')' or the end. depth 0: the top level, where '$' may end an alternative.
  Re concat(int depth, bool* end_anchor) {
    Re seq{Re::kConcat};
    while (!at_end() && !peek('|') && !peek(')')) {
      if (peek('$')) {
        ++pos_;
        if (depth == 0 && (at_end() || peek('|'))) {
          *end_anchor = true;
          break;
        }
        --pos_;
        unsupported("'$' before the end of the pattern");
      }
      if (peek('^')) unsupported("'^' after the start of the pattern");
      Re atom_re = atom(depth);
      while (!at_end()) {
        int64_t lo, hi;
        const size_t save = pos_;
        if (!quantifier(lo, hi)) {
          pos_ = save;
          break;
        }
        if (peek('?')) ++pos_;  // lazy: the same language
        Re rep{Re::kRepeat};
        rep.min = lo;
        rep.max = hi;
        rep.kids.push_back(std::move(atom_re));
        atom_re = std::move(rep);
        if (!at_end() && (peek('*') || peek('+') || peek('?'))) error("nothing to repeat");
      }
      seq.kids.push_back(std::move(atom_re));
    }
    return seq;
  }

  // Reads a quantifier at pos_ (true), or leaves a '{' that does not start one for the caller (false).
  bool quantifier(int64_t& lo, int64_t& hi) {
    if (peek('*')) return ++pos_, lo = 0, hi = -1, true;
    if (peek('+')) return ++pos_, lo = 1, hi = -1, true;
    if (peek('?')) return ++pos_, lo = 0, hi = 1, true;
    if (!peek('{')) return false;
    ++pos_;
    auto number = [&](int64_t& v) {
      if (at_end() || cps_[pos_] < '0' || cps_[pos_] > '9') return false;
      v = 0;
      while (!at_end() && cps_[pos_] >= '0' && cps_[pos_] <= '9') {
        v = v * 10 + (cps_[pos_++] - '0');
        if (v > 1'000'000) v = 1'000'000;
      }
      return true;
    };
    if (!number(lo)) return false;
    hi = lo;
    if (peek(',')) {
      ++pos_;
      if (!number(hi)) hi = -1;
    }
    if (!peek('}')) return false;
    ++pos_;
    if (hi >= 0 && hi < lo) error("quantifier {m,n} with n < m");
    if (lo > kMaxRepeat || hi > kMaxRepeat)
      unsupported("a repetition bound above " + std::to_string(kMaxRepeat));
    return true;
  }

  Re set_re(CodepointSet s) {
    Re r{Re::kSet};
    r.set = normalize(std::move(s));
    return r;
  }

  Re atom(int depth) {
    const uint32_t c = next();
    switch (c) {
      case '(': {
        if (depth + 1 > kMaxGroupDepth) unsupported("groups nested deeper than " + std::to_string(kMaxGroupDepth));
        if (peek('?')) {
          ++pos_;
          const uint32_t k = next();
          if (k == ':') {
          } else if (k == '<' && !peek('=') && !peek('!')) {
            while (!peek('>')) next();  // a named group: the name does not change the language
            ++pos_;
          } else if (k == '=' || k == '!' || k == '<') {
            unsupported("lookaround (?=, (?!, (?<=, (?<!");
          } else {
            unsupported("the group modifier '(?" + std::string(1, static_cast<char>(k & 0x7F)) + "'");
          }
        }
        bool inner_anchor = false;
        Re r = alternation(depth + 1, &inner_anchor);
        if (!peek(')')) error("missing ')'");
        ++pos_;
        return r;
      }
      case '[': return set_re(char_class());
      case '.': return set_re(complement({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}));
      case '\\': return set_re(escape(false));
      case '*':
      case '+':
      case '?': error("nothing to repeat");
      case '{': {
        --pos_;
        int64_t lo, hi;
        const size_t save = pos_;
        if (quantifier(lo, hi)) error("nothing to repeat");
        pos_ = save + 1;
        return set_re({{c, c}});
      }
      default: return set_re({{c, c}});
    }
  }

  uint32_t hex_digits(int count) {
    uint32_t v = 0;
    for (int i = 0; i < count; ++i) {
      const uint32_t h = next();
      int d = h >= '0' && h <= '9' ? int(h - '0') : h >= 'a' && h <= 'f' ? int(h - 'a' + 10) : h >= 'A' && h <= 'F' ? int(h - 'A' + 10) : -1;
      if (d < 0) error("bad hexadecimal escape");
      v = v * 16 + static_cast<uint32_t>(d);
    }
    return v;
  }

  // After a backslash. in_class: inside [...] (where \b is a backspace).
  CodepointSet escape(bool in_class) {
    const uint32_t c = next();
    switch (c) {
      case 'd': return digit_set();
      case 'D': return complement(digit_set());
      case 'w': return word_set();
      case 'W': return complement(word_set());
      case 's': return space_set();
      case 'S': return complement(space_set());
      case 't': return {{'\t', '\t'}};
      case 'n': return {{'\n', '\n'}};
      case 'r': return {{'\r', '\r'}};
      case 'f': return {{'\f', '\f'}};
      case 'v': return {{'\v', '\v'}};
      case '0':
        if (!at_end() && cps_[pos_] >= '0' && cps_[pos_] <= '9') unsupported("octal escapes");
        return {{0, 0}};
      case 'x': {
        const uint32_t v = hex_digits(2);
        return {{v, v}};
      }
      case 'u': {
        uint32_t v;
        if (peek('{')) {
          ++pos_;
          v = 0;
          int n = 0;
          while (!peek('}')) {
            v = v * 16 + hex_digits(1);
            if (++n > 6) error("bad \\u{...} escape");
          }
          ++pos_;
          if (n == 0) error("bad \\u{...} escape");
        } else {
          v = hex_digits(4);
        }
        if (v > kMaxCodepoint || (v >= 0xD800 && v <= 0xDFFF)) unsupported("an escape of a surrogate or past U+10FFFF");
        return {{v, v}};
      }
      case 'b':
        if (in_class) return {{8, 8}};
        unsupported("the word boundary \\b");
      case 'B': unsupported("the word boundary \\B");
      case 'c': unsupported("control escapes \\cX");
      case 'k': unsupported("back-references \\k<name>");
      case 'p':
      case 'P': unsupported("Unicode property escapes \\p{...}");
      default: break;
    }
    if (c >= '1' && c <= '9') unsupported("back-references \\1-\\9");
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
      error("unknown escape \\" + std::string(1, static_cast<char>(c)));
    return {{c, c}};  // an escaped punctuation or non-ASCII character stands for itself
  }

  // After '['.
  CodepointSet char_class() {
    bool negate = false;
    if (peek('^')) {
      ++pos_;
      negate = true;
    }
    CodepointSet set;
    // One class atom: a single code point (single) or a set (\d ...).
    auto class_atom = [&](bool& single, uint32_t& cp) {
      const uint32_t c = next();
      if (c == '\\') {
        CodepointSet s = escape(true);
        single = s.size() == 1 && s[0].lo == s[0].hi;
        cp = s[0].lo;
        return s;
      }
      single = true;
      cp = c;
      return CodepointSet{{c, c}};
    };
    while (true) {
      if (at_end()) error("missing ']'");
      if (peek(']')) {
        ++pos_;
        break;
      }
      bool single_a;
      uint32_t a;
      CodepointSet sa = class_atom(single_a, a);
      if (single_a && peek('-') && pos_ + 1 < cps_.size() && cps_[pos_ + 1] != ']') {
        ++pos_;
        bool single_b;
        uint32_t b;
        CodepointSet sb = class_atom(single_b, b);
        if (single_b) {
          if (b < a) error("class range out of order");
          set.push_back({a, b});
          continue;
        }
        // [a-\d]: '-' is literal (Annex B)
        set.insert(set.end(), sa.begin(), sa.end());
        set.push_back({'-', '-'});
        set.insert(set.end(), sb.begin(), sb.end());
        continue;
      }
      set.insert(set.end(), sa.begin(), sa.end());
    }
    return negate ? complement(set) : normalize(set);
  }

  std::string_view src_;
  std::vector<uint32_t> cps_;
  std::vector<size_t> offsets_;
  size_t pos_ = 0;
};

class Emitter {
 public:
  Emitter(Grammar& g, const CharEmitter& emit) : g_(g), emit_(emit) {}

  Frag operator()(const Re& re) {
    switch (re.kind) {
      case Re::kEmpty: return g_.empty();
      case Re::kSet:
        if (re.set.empty()) fail("regular expression: a class that matches no character (such as [^\\s\\S])");
        return emit_ ? emit_(g_, re.set) : utf8_class(g_, re.set);
      case Re::kConcat: {
        std::vector<Frag> parts;
        for (const Re& k : re.kids) parts.push_back((*this)(k));
        return g_.seq(std::move(parts));
      }
      case Re::kAlt: {
        std::vector<Frag> parts;
        for (const Re& k : re.kids) parts.push_back((*this)(k));
        return g_.alt(std::move(parts));
      }
      case Re::kRepeat: return g_.repeat([&] { return (*this)(re.kids[0]); }, re.min, re.max);
    }
    KILN_CHECK(false, "bad regex node");
  }

 private:
  Grammar& g_;
  const CharEmitter& emit_;
};

}  // namespace

Frag compile_regex(Grammar& g, std::string_view pattern, const RegexOptions& options) {
  std::vector<TopAlternative> alts = Parser(pattern).parse();
  Emitter emit(g, options.emit);
  const CodepointSet any = normalize({{0, kMaxCodepoint}});
  auto free_text = [&] { return g.star(emit(Re{Re::kSet, any, {}, 0, -1})); };
  std::vector<Frag> options_frags;
  for (const TopAlternative& a : alts) {
    std::vector<Frag> parts;
    if (options.search && !a.start_anchor) parts.push_back(free_text());
    parts.push_back(emit(a.re));
    if (options.search && !a.end_anchor) parts.push_back(free_text());
    options_frags.push_back(g.seq(std::move(parts)));
  }
  return options_frags.size() == 1 ? options_frags[0] : g.alt(std::move(options_frags));
}

}  // namespace kiln::grammar
