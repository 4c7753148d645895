#include "engine/grammar/ebnf.h"

#include <map>
#include <string>

#include "core/error.h"
#include "engine/grammar/regex.h"

namespace kiln::grammar {

namespace {

class EbnfParser {
 public:
  EbnfParser(std::string_view text, Grammar& g) : src_(text), g_(g) {}

  void parse() {
    skip_space();
    while (!at_end()) {
      const std::string name = ident();
      if (name.empty()) error("expected a rule name");
      skip_space();
      if (src_.substr(pos_, 3) != "::=") error("expected '::=' after rule name '" + name + "'");
      pos_ += 3;
      const int32_t r = rule(name);
      if (defined_.count(name)) error("rule '" + name + "' is defined twice");
      defined_[name] = true;
      g_.define_rule(r, alternatives(0));
      skip_space();
    }
    for (const auto& [name, id] : rules_)
      if (!defined_.count(name)) fail("ebnf: rule '{}' is used but not defined", name);
    auto root = rules_.find("root");
    if (root == rules_.end()) fail("ebnf: no 'root' rule (the start rule must be called root)");
    g_.set_root(root->second);
  }

 private:
  [[noreturn]] void error(const std::string& what) const {
    size_t line = 1;
    for (size_t i = 0; i < pos_ && i < src_.size(); ++i) line += src_[i] == '\n';
    fail("ebnf: {} at line {}", what, line);
  }
  bool at_end() const { return pos_ >= src_.size(); }
  char peek() const { return at_end() ? '\0' : src_[pos_]; }

  void skip_space() {
    while (!at_end()) {
      const char c = src_[pos_];
      if (c == '#') {
        while (!at_end() && src_[pos_] != '\n') ++pos_;
      } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++pos_;
      } else {
        break;
      }
    }
  }

  static bool ident_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  }
  std::string ident() {
    const size_t b = pos_;
    while (!at_end() && ident_char(src_[pos_])) ++pos_;
    return std::string(src_.substr(b, pos_ - b));
  }
  // A rule name followed by "::=" starts the next rule.
  bool at_rule_start() {
    const size_t save = pos_;
    const std::string name = ident();
    skip_space();
    const bool yes = !name.empty() && src_.substr(pos_, 3) == "::=";
    pos_ = save;
    return yes;
  }

  int32_t rule(const std::string& name) {
    auto it = rules_.find(name);
    if (it != rules_.end()) return it->second;
    const int32_t r = g_.new_rule(name);
    rules_[name] = r;
    return r;
  }

  Frag alternatives(int depth) {
    if (depth > 64) error("groups nested deeper than 64");
    std::vector<Frag> opts{sequence(depth)};
    while (peek() == '|') {
      ++pos_;
      opts.push_back(sequence(depth));
    }
    return opts.size() == 1 ? opts[0] : g_.alt(std::move(opts));
  }

  Frag sequence(int depth) {
    std::vector<Frag> parts;
    while (true) {
      skip_space();
      const char c = peek();
      if (at_end() || c == '|' || c == ')' || (depth == 0 && at_rule_start())) break;
      const size_t atom_start = pos_;
      Frag f = atom(depth);
      // Postfix operators; a repeat re-parses the atom's text for each copy.
      auto again = [&, atom_start] {
        const size_t save = pos_;
        pos_ = atom_start;
        Frag copy = atom(depth);
        pos_ = save;
        return copy;
      };
      while (true) {
        const char q = peek();
        if (q == '*') {
          ++pos_;
          f = g_.star(f);
        } else if (q == '+') {
          ++pos_;
          const size_t after = pos_;
          Frag rest = g_.star(again());
          pos_ = after;
          f = g_.seq({f, rest});
        } else if (q == '?') {
          ++pos_;
          f = g_.opt(f);
        } else if (q == '{') {
          ++pos_;
          int64_t lo = number(), hi = lo;
          if (peek() == ',') {
            ++pos_;
            hi = peek() == '}' ? -1 : number();
          }
          if (peek() != '}') error("expected '}'");
          ++pos_;
          if (hi >= 0 && hi < lo) error("repetition {m,n} with n < m");
          if (lo > kMaxRepeat || hi > kMaxRepeat) error("a repetition bound above " + std::to_string(kMaxRepeat));
          const size_t after = pos_;
          // f is the first copy; the rest are fresh copies.
          if (hi == 0) {
            f = g_.empty();
          } else {
            Frag rest = g_.repeat(again, lo > 0 ? lo - 1 : 0, hi < 0 ? -1 : hi - 1);
            f = lo > 0 ? g_.seq({f, rest}) : g_.opt(g_.seq({f, rest}));
          }
          pos_ = after;
        } else {
          break;
        }
        // (A postfix after a postfix applies to the whole; a re-parse of the atom is only for the first.)
        if (peek() == '*' || peek() == '+' || peek() == '?' || peek() == '{') error("two repetition operators in a row");
      }
      parts.push_back(f);
    }
    return g_.seq(std::move(parts));
  }

  int64_t number() {
    if (at_end() || peek() < '0' || peek() > '9') error("expected a number");
    int64_t v = 0;
    while (!at_end() && peek() >= '0' && peek() <= '9') v = std::min<int64_t>(v * 10 + (src_[pos_++] - '0'), 1'000'000);
    return v;
  }

  uint32_t hex(int n) {
    uint32_t v = 0;
    for (int i = 0; i < n; ++i) {
      const char h = peek();
      int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (d < 0) error("bad hexadecimal escape");
      ++pos_;
      v = v * 16 + static_cast<uint32_t>(d);
    }
    return v;
  }

  // One code point of a string or class (after an optional backslash escape).
  uint32_t char_code() {
    if (at_end()) error("unexpected end of text");
    auto c = static_cast<uint8_t>(src_[pos_]);
    if (c == '\\') {
      ++pos_;
      const char e = peek();
      ++pos_;
      switch (e) {
        case 'n': return '\n';
        case 'r': return '\r';
        case 't': return '\t';
        case '\\': return '\\';
        case '"': return '"';
        case '\'': return '\'';
        case '[': return '[';
        case ']': return ']';
        case '-': return '-';
        case '^': return '^';
        case 'x': return hex(2);
        case 'u': return hex(4);
        case 'U': return hex(8);
        default: error(std::string("unknown escape \\") + e);
      }
    }
    // A UTF-8 sequence as one code point.
    const int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || pos_ + static_cast<size_t>(n) > src_.size()) error("invalid UTF-8");
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1Fu) : n == 3 ? (c & 0x0Fu) : (c & 0x07u);
    for (int k = 1; k < n; ++k) {
      const auto cc = static_cast<uint8_t>(src_[pos_ + static_cast<size_t>(k)]);
      if ((cc >> 6) != 2) error("invalid UTF-8");
      cp = (cp << 6) | (cc & 0x3Fu);
    }
    pos_ += static_cast<size_t>(n);
    return cp;
  }

  Frag codepoint(uint32_t cp) {
    if (cp > kMaxCodepoint || (cp >= 0xD800 && cp <= 0xDFFF)) error("a character past U+10FFFF or a surrogate");
    return utf8_class(g_, {{cp, cp}});
  }

  Frag atom(int depth) {
    const char c = peek();
    if (c == '"') {
      ++pos_;
      std::vector<Frag> chars;
      while (peek() != '"') {
        if (at_end()) error("missing closing '\"'");
        chars.push_back(codepoint(char_code()));
      }
      ++pos_;
      return g_.seq(std::move(chars));
    }
    if (c == '[') {
      ++pos_;
      bool negate = false;
      if (peek() == '^') {
        ++pos_;
        negate = true;
      }
      CodepointSet set;
      while (peek() != ']') {
        if (at_end()) error("missing ']'");
        const uint32_t a = char_code();
        uint32_t b = a;
        if (peek() == '-' && pos_ + 1 < src_.size() && src_[pos_ + 1] != ']') {
          ++pos_;
          b = char_code();
          if (b < a) error("class range out of order");
        }
        set.push_back({a, b});
      }
      ++pos_;
      set = negate ? complement(set) : normalize(set);
      if (set.empty()) error("a class that matches no character");
      return utf8_class(g_, set);
    }
    if (c == '.') {
      ++pos_;
      return utf8_class(g_, normalize({{0, kMaxCodepoint}}));
    }
    if (c == '(') {
      ++pos_;
      Frag f = alternatives(depth + 1);
      skip_space();
      if (peek() != ')') error("missing ')'");
      ++pos_;
      return f;
    }
    const std::string name = ident();
    if (name.empty()) error(std::string("unexpected character '") + c + "'");
    return g_.call(rule(name));
  }

  std::string_view src_;
  Grammar& g_;
  size_t pos_ = 0;
  std::map<std::string, int32_t> rules_;
  std::map<std::string, bool> defined_;
};

}  // namespace

std::shared_ptr<Grammar> parse_ebnf(std::string_view text, const CompileLimits& limits) {
  auto g = std::make_shared<Grammar>();
  g->set_limits(limits);
  EbnfParser(text, *g).parse();
  g->prune_unproductive();
  return g;
}

}  // namespace kiln::grammar
