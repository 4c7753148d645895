#include "template/jinja/lexer.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "template/jinja/unicode.h"

namespace kiln::tmpl::jinja {

std::string_view describe(Tok t) {
  switch (t) {
    case Tok::Data:
      return "template data";
    case Tok::VariableBegin:
      return "'{{'";
    case Tok::VariableEnd:
      return "end of print statement";
    case Tok::BlockBegin:
      return "'{%'";
    case Tok::BlockEnd:
      return "end of statement block";
    case Tok::Name:
      return "name";
    case Tok::String:
      return "string";
    case Tok::Integer:
      return "integer";
    case Tok::Float:
      return "float";
    case Tok::Add:
      return "'+'";
    case Tok::Sub:
      return "'-'";
    case Tok::Div:
      return "'/'";
    case Tok::FloorDiv:
      return "'//'";
    case Tok::Mul:
      return "'*'";
    case Tok::Mod:
      return "'%'";
    case Tok::Pow:
      return "'**'";
    case Tok::Tilde:
      return "'~'";
    case Tok::LBracket:
      return "'['";
    case Tok::RBracket:
      return "']'";
    case Tok::LParen:
      return "'('";
    case Tok::RParen:
      return "')'";
    case Tok::LBrace:
      return "'{'";
    case Tok::RBrace:
      return "'}'";
    case Tok::Eq:
      return "'=='";
    case Tok::Ne:
      return "'!='";
    case Tok::Gt:
      return "'>'";
    case Tok::GtEq:
      return "'>='";
    case Tok::Lt:
      return "'<'";
    case Tok::LtEq:
      return "'<='";
    case Tok::Assign:
      return "'='";
    case Tok::Dot:
      return "'.'";
    case Tok::Colon:
      return "':'";
    case Tok::Pipe:
      return "'|'";
    case Tok::Comma:
      return "','";
    case Tok::Semicolon:
      return "';'";
    case Tok::Eof:
      return "end of template";
  }
  return "token";
}

namespace {

// Jinja2 splits the source on \r\n, \r and \n, joins with \n and (keep_trailing_newline=False)
// drops one trailing empty line.
std::string normalize_newlines(std::string_view src, bool keep_trailing_newline) {
  std::string out;
  out.reserve(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] == '\r') {
      out.push_back('\n');
      if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
    } else {
      out.push_back(src[i]);
    }
  }
  if (!keep_trailing_newline && !out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

bool is_ident_start(unsigned char c) {
  return c == '_' || std::isalpha(c) || c >= 0x80;
}
bool is_ident_char(unsigned char c) {
  return c == '_' || std::isalnum(c) || c >= 0x80;
}

class Lexer {
 public:
  Lexer(std::string src, const LexerOptions& opt) : src_(std::move(src)), opt_(opt) {
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    const size_t n = src_.size();
    while (pos < n) {
      size_t start = find_tag_start(pos);
      if (start == std::string::npos) {
        emit_data(pos, src_.substr(pos));
        break;
      }
      char kind = src_[start + 1];
      size_t after = start + 2;
      char sign = 0;
      if (after < n && (src_[after] == '-' || src_[after] == '+')) sign = src_[after++];
      std::string text = src_.substr(pos, start - pos);
      size_t raw_body = (kind == '%') ? match_raw_begin(after) : std::string::npos;
      apply_strip(text, sign, kind != '{', line_starting);
      emit_data(pos, std::move(text));
      line_starting = false;

      if (raw_body != std::string::npos) {
        line_starting = raw_body > 0 && src_[raw_body - 1] == '\n';
        pos = lex_raw_body(raw_body, line_starting);
        line_starting = pos > 0 && src_[pos - 1] == '\n';
        continue;
      }
      if (kind == '#') {
        pos = skip_comment(start, after);
      } else {
        pos = lex_tag(start, after, kind == '%');
      }
      line_starting = pos > 0 && src_[pos - 1] == '\n';
    }
    tokens_.push_back(Token{Tok::Eof, {}, 0, 0, pos_of(n)});
    return std::move(tokens_);
  }

 private:
  std::string src_;
  LexerOptions opt_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;

  SourcePos pos_of(size_t offset) const {
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    size_t line_index = static_cast<size_t>(it - line_starts_.begin()) - 1;
    size_t line_start = line_starts_[line_index];
    std::string_view prefix(src_.data() + line_start, std::min(offset, src_.size()) - line_start);
    return SourcePos{static_cast<int>(line_index + 1), static_cast<int>(unicode::length(prefix) + 1)};
  }

  [[noreturn]] void fail_at(size_t offset, const std::string& msg) const {
    auto p = pos_of(offset);
    kiln::fail("chat template syntax error at line {}, column {}: {}", p.line, p.column, msg);
  }

  // Byte length of the whitespace code point at offset (Python's \s), 0 if none.
  size_t space_len(size_t offset) const {
    if (offset >= src_.size()) return 0;
    auto c = static_cast<unsigned char>(src_[offset]);
    if (c < 0x80) return unicode::is_space(c) ? 1 : 0;
    size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
    auto cps = unicode::decode(std::string_view(src_).substr(offset, len));
    return (!cps.empty() && unicode::is_space(cps[0])) ? len : 0;
  }

  size_t skip_spaces(size_t offset) const {
    while (size_t l = space_len(offset)) offset += l;
    return offset;
  }

  size_t find_tag_start(size_t pos) const {
    for (size_t i = src_.find('{', pos); i != std::string::npos && i + 1 < src_.size();
         i = src_.find('{', i + 1)) {
      char c = src_[i + 1];
      if (c == '{' || c == '%' || c == '#') return i;
    }
    return std::string::npos;
  }

  void emit_data(size_t offset, std::string text) {
    if (text.empty()) return;
    tokens_.push_back(Token{Tok::Data, std::move(text), 0, 0, pos_of(offset)});
  }

  static std::string rstrip_python(const std::string& s) {
    auto cps = unicode::decode(s);
    size_t end = cps.size();
    while (end > 0 && unicode::is_space(cps[end - 1])) --end;
    return unicode::encode(std::u32string_view(cps).substr(0, end));
  }

  // Whitespace control for the text before a tag: `-` strips all whitespace, lstrip_blocks strips
  // the spaces of a line that holds only the block/comment tag.
  void apply_strip(std::string& text, char sign, bool lstrip_kind, bool line_starting) const {
    if (sign == '-') {
      text = rstrip_python(text);
      return;
    }
    if (sign == '+' || !opt_.lstrip_blocks || !lstrip_kind) return;
    size_t nl = text.rfind('\n');
    size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
    if (l_pos == 0 && !line_starting) return;
    if (l_pos == text.size()) return;
    auto tail = unicode::decode(std::string_view(text).substr(l_pos));
    for (char32_t c : tail)
      if (!unicode::is_space(c)) return;
    text.resize(l_pos);
  }

  // `{% raw %}` (after "{%" and the sign): returns the offset of the raw body or npos.
  size_t match_raw_begin(size_t after) const {
    size_t p = skip_spaces(after);
    if (src_.compare(p, 3, "raw") != 0) return std::string::npos;
    p += 3;
    if (p < src_.size() && is_ident_char(static_cast<unsigned char>(src_[p]))) return std::string::npos;
    p = skip_spaces(p);
    if (src_.compare(p, 3, "-%}") == 0) return skip_spaces(p + 3);
    if (src_.compare(p, 2, "%}") == 0) return p + 2;
    return std::string::npos;
  }

  size_t lex_raw_body(size_t body, bool line_starting) {
    for (size_t i = src_.find("{%", body); i != std::string::npos; i = src_.find("{%", i + 1)) {
      size_t p = i + 2;
      char sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      p = skip_spaces(p);
      if (src_.compare(p, 6, "endraw") != 0) continue;
      p = skip_spaces(p + 6);
      size_t end;
      if (src_.compare(p, 3, "+%}") == 0)
        end = p + 3;
      else if (src_.compare(p, 3, "-%}") == 0)
        end = skip_spaces(p + 3);
      else if (src_.compare(p, 2, "%}") == 0)
        end = p + 2 + ((opt_.trim_blocks && p + 2 < src_.size() && src_[p + 2] == '\n') ? 1 : 0);
      else
        continue;
      std::string text = src_.substr(body, i - body);
      apply_strip(text, sign, true, line_starting);
      emit_data(body, std::move(text));
      return end;
    }
    fail_at(body, "missing end of raw directive");
  }

  size_t skip_comment(size_t start, size_t content) const {
    size_t k = src_.find("#}", content);
    if (k == std::string::npos) fail_at(start, "missing end of comment tag");
    if (k > content && src_[k - 1] == '-') return skip_spaces(k + 2);
    if (k > content && src_[k - 1] == '+') return k + 2;
    size_t end = k + 2;
    if (opt_.trim_blocks && end < src_.size() && src_[end] == '\n') ++end;
    return end;
  }

  void push(Tok t, size_t offset, std::string text = {}) {
    tokens_.push_back(Token{t, std::move(text), 0, 0, pos_of(offset)});
  }

  // Lexes a {% ... %} or {{ ... }} tag; returns the offset after its end marker.
  size_t lex_tag(size_t start, size_t p, bool block) {
    push(block ? Tok::BlockBegin : Tok::VariableBegin, start);
    std::vector<char> balance;
    const char end_char = block ? '%' : '}';
    const size_t n = src_.size();
    while (true) {
      if (p >= n)
        fail_at(start, block ? "unexpected end of template, expected '%}'"
                             : "unexpected end of template, expected '}}'");
      if (balance.empty()) {
        if (block && src_.compare(p, 3, "+%}") == 0) {
          push(Tok::BlockEnd, p);
          return p + 3;
        }
        if (src_[p] == '-' && p + 2 < n && src_[p + 1] == end_char && src_[p + 2] == '}') {
          push(block ? Tok::BlockEnd : Tok::VariableEnd, p);
          return skip_spaces(p + 3);
        }
        if (src_[p] == end_char && p + 1 < n && src_[p + 1] == '}') {
          push(block ? Tok::BlockEnd : Tok::VariableEnd, p);
          size_t end = p + 2;
          if (block && opt_.trim_blocks && end < n && src_[end] == '\n') ++end;
          return end;
        }
      }
      if (size_t l = space_len(p)) {
        p = skip_spaces(p + l);
        continue;
      }
      auto c = static_cast<unsigned char>(src_[p]);
      if (std::isdigit(c)) {
        p = lex_number(p);
        continue;
      }
      if (is_ident_start(c)) {
        size_t e = p;
        while (e < n && is_ident_char(static_cast<unsigned char>(src_[e]))) ++e;
        push(Tok::Name, p, src_.substr(p, e - p));
        p = e;
        continue;
      }
      if (c == '\'' || c == '"') {
        p = lex_string(p);
        continue;
      }
      p = lex_operator(p, balance);
    }
  }

  size_t lex_number(size_t p) {
    const size_t n = src_.size();
    auto digits = [&](size_t q) {  // (\d+_)*\d+
      size_t e = q;
      while (e < n && std::isdigit(static_cast<unsigned char>(src_[e]))) {
        ++e;
        if (e + 1 < n && src_[e] == '_' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) ++e;
      }
      return e;
    };
    auto strip_underscores = [](std::string s) {
      s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
      return s;
    };
    // Float: digits with a fraction and/or an exponent (not after a '.', as in `x.0.1`).
    bool after_dot = p > 0 && src_[p - 1] == '.';
    size_t int_end = digits(p);
    if (!after_dot) {
      size_t e = int_end;
      bool has_frac = false;
      if (e + 1 < n && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
        e = digits(e + 1);
        has_frac = true;
      }
      size_t exp_end = std::string::npos;
      if (e < n && (src_[e] == 'e' || src_[e] == 'E')) {
        size_t q = e + 1;
        if (q < n && (src_[q] == '+' || src_[q] == '-')) ++q;
        if (q < n && std::isdigit(static_cast<unsigned char>(src_[q]))) exp_end = digits(q);
      }
      if (exp_end != std::string::npos) e = exp_end;
      if (has_frac || exp_end != std::string::npos) {
        Token t{Tok::Float,
                {},
                0,
                std::strtod(strip_underscores(src_.substr(p, e - p)).c_str(), nullptr),
                pos_of(p)};
        tokens_.push_back(std::move(t));
        return e;
      }
    }
    // Integer: 0b / 0o / 0x prefixes, decimal.
    if (src_[p] == '0' && p + 1 < n && std::strchr("bBoOxX", src_[p + 1]) && src_[p + 1] != 0) {
      char kind = static_cast<char>(std::tolower(static_cast<unsigned char>(src_[p + 1])));
      int base = kind == 'b' ? 2 : kind == 'o' ? 8 : 16;
      size_t e = p + 2;
      std::string digits_only;
      while (e < n) {
        char ch = src_[e];
        if (ch == '_' && e + 1 < n) {
          ++e;
          ch = src_[e];
        }
        int d = std::isdigit(static_cast<unsigned char>(ch)) ? ch - '0'
                : std::isxdigit(static_cast<unsigned char>(ch))
                    ? std::tolower(static_cast<unsigned char>(ch)) - 'a' + 10
                    : 99;
        if (d >= base) break;
        digits_only.push_back(ch);
        ++e;
      }
      if (!digits_only.empty()) {
        errno = 0;
        unsigned long long v = std::strtoull(digits_only.c_str(), nullptr, base);
        if (errno == ERANGE || v > static_cast<unsigned long long>(INT64_MAX))
          fail_at(p, "integer literal too large: " + src_.substr(p, e - p));
        Token t{Tok::Integer, {}, static_cast<int64_t>(v), 0, pos_of(p)};
        tokens_.push_back(std::move(t));
        return e;
      }
    }
    size_t e = int_end;
    if (src_[p] == '0') {  // 0(_?0)*
      e = p + 1;
      while (e < n && (src_[e] == '0' || (src_[e] == '_' && e + 1 < n && src_[e + 1] == '0'))) ++e;
    }
    std::string text = strip_underscores(src_.substr(p, e - p));
    int64_t value = 0;
    try {
      value = std::stoll(text);
    } catch (const std::exception&) {
      fail_at(p, "integer literal too large: " + text);
    }
    tokens_.push_back(Token{Tok::Integer, {}, value, 0, pos_of(p)});
    return e;
  }

  // Python unicode-escape decoding of a string literal's body.
  size_t lex_string(size_t p) {
    const char quote = src_[p];
    const size_t n = src_.size();
    std::string value;
    size_t i = p + 1;
    while (true) {
      if (i >= n) fail_at(p, "unexpected end of string literal");
      char c = src_[i];
      if (c == quote) break;
      if (c != '\\') {
        value.push_back(c);
        ++i;
        continue;
      }
      if (i + 1 >= n) fail_at(p, "unexpected end of string literal");
      char e = src_[i + 1];
      i += 2;
      auto hex = [&](int count) -> char32_t {
        if (i + count > n) fail_at(p, "truncated escape in string literal");
        char32_t v = 0;
        for (int k = 0; k < count; ++k) {
          char h = src_[i + k];
          if (!std::isxdigit(static_cast<unsigned char>(h))) fail_at(p, "truncated escape in string literal");
          v = v * 16 + (std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : std::tolower(h) - 'a' + 10);
        }
        i += count;
        return v;
      };
      switch (e) {
        case '\n':
          break;
        case '\\':
          value.push_back('\\');
          break;
        case '\'':
          value.push_back('\'');
          break;
        case '"':
          value.push_back('"');
          break;
        case 'a':
          value.push_back('\a');
          break;
        case 'b':
          value.push_back('\b');
          break;
        case 'f':
          value.push_back('\f');
          break;
        case 'n':
          value.push_back('\n');
          break;
        case 'r':
          value.push_back('\r');
          break;
        case 't':
          value.push_back('\t');
          break;
        case 'v':
          value.push_back('\v');
          break;
        case 'x':
          unicode::append_utf8(value, hex(2));
          break;
        case 'u':
          unicode::append_utf8(value, hex(4));
          break;
        case 'U': {
          char32_t cp = hex(8);
          if (cp > 0x10FFFF) fail_at(p, "illegal Unicode character in string literal");
          unicode::append_utf8(value, cp);
          break;
        }
        case 'N':
          fail_at(p, "\\N{...} escapes are not supported");
        default:
          if (e >= '0' && e <= '7') {
            char32_t v = e - '0';
            for (int k = 0; k < 2 && i < n && src_[i] >= '0' && src_[i] <= '7'; ++k)
              v = v * 8 + (src_[i++] - '0');
            unicode::append_utf8(value, v);
          } else {
            value.push_back('\\');
            value.push_back(e);
          }
      }
    }
    tokens_.push_back(Token{Tok::String, std::move(value), 0, 0, pos_of(p)});
    return i + 1;
  }

  size_t lex_operator(size_t p, std::vector<char>& balance) {
    static const std::pair<const char*, Tok> two[] = {{"**", Tok::Pow},  {"//", Tok::FloorDiv},
                                                      {"==", Tok::Eq},   {"!=", Tok::Ne},
                                                      {">=", Tok::GtEq}, {"<=", Tok::LtEq}};
    for (const auto& [s, t] : two) {
      if (src_.compare(p, 2, s) == 0) {
        push(t, p);
        return p + 2;
      }
    }
    Tok t;
    char c = src_[p];
    switch (c) {
      case '+':
        t = Tok::Add;
        break;
      case '-':
        t = Tok::Sub;
        break;
      case '/':
        t = Tok::Div;
        break;
      case '*':
        t = Tok::Mul;
        break;
      case '%':
        t = Tok::Mod;
        break;
      case '~':
        t = Tok::Tilde;
        break;
      case '[':
        t = Tok::LBracket;
        break;
      case ']':
        t = Tok::RBracket;
        break;
      case '(':
        t = Tok::LParen;
        break;
      case ')':
        t = Tok::RParen;
        break;
      case '{':
        t = Tok::LBrace;
        break;
      case '}':
        t = Tok::RBrace;
        break;
      case '>':
        t = Tok::Gt;
        break;
      case '<':
        t = Tok::Lt;
        break;
      case '=':
        t = Tok::Assign;
        break;
      case '.':
        t = Tok::Dot;
        break;
      case ':':
        t = Tok::Colon;
        break;
      case '|':
        t = Tok::Pipe;
        break;
      case ',':
        t = Tok::Comma;
        break;
      case ';':
        t = Tok::Semicolon;
        break;
      default: {
        std::string shown = py_char(p);
        fail_at(p, "unexpected char " + shown);
      }
    }
    if (c == '{') balance.push_back('}');
    if (c == '(') balance.push_back(')');
    if (c == '[') balance.push_back(']');
    if (c == '}' || c == ')' || c == ']') {
      if (balance.empty()) fail_at(p, std::string("unexpected '") + c + "'");
      char expected = balance.back();
      balance.pop_back();
      if (expected != c) fail_at(p, std::string("unexpected '") + c + "', expected '" + expected + "'");
    }
    push(t, p);
    return p + 1;
  }

  std::string py_char(size_t p) const {
    auto c = static_cast<unsigned char>(src_[p]);
    if (c >= 0x20 && c < 0x7F) return std::string("'") + static_cast<char>(c) + "'";
    size_t len = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
    return "'" + src_.substr(p, len) + "'";
  }
};

}  // namespace

std::vector<Token> tokenize(std::string_view source, const LexerOptions& options) {
  return Lexer(normalize_newlines(source, options.keep_trailing_newline), options).run();
}

}  // namespace kiln::tmpl::jinja
