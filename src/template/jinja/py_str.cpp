// Python str semantics over UTF-8 (builtins.h): code points, not bytes, as CPython's str methods count them.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <map>
#include <set>

#include "template/jinja/builtins.h"
#include "template/jinja/unicode.h"

namespace kiln::tmpl::jinja {

// ---- Python str helpers (code point semantics)

std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  std::u32string set;
  bool whitespace = chars.is_none() || chars.is_undefined();
  if (!whitespace) set = cps(require_str(chars, "strip arg"));
  auto strip_it = [&](char32_t c) {
    return whitespace ? unicode::is_space(c) : set.find(c) != std::u32string::npos;
  };
  if (unicode::is_ascii(s) && unicode::is_ascii(whitespace ? "" : chars.str())) {
    size_t b = 0, e = s.size();
    if (left)
      while (b < e && strip_it(static_cast<unsigned char>(s[b]))) ++b;
    if (right)
      while (e > b && strip_it(static_cast<unsigned char>(s[e - 1]))) --e;
    return s.substr(b, e - b);
  }
  auto c = cps(s);
  size_t b = 0, e = c.size();
  if (left)
    while (b < e && strip_it(c[b])) ++b;
  if (right)
    while (e > b && strip_it(c[e - 1])) --e;
  return unicode::encode(std::u32string_view(c).substr(b, e - b));
}

std::vector<std::string> py_split(const std::string& s, const Value& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep.is_none() || sep.is_undefined()) {
    auto c = cps(s);
    size_t i = 0, n = c.size();
    while (true) {
      while (i < n && unicode::is_space(c[i])) ++i;
      if (i >= n) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
        out.push_back(unicode::encode(std::u32string_view(c).substr(i)));
        break;
      }
      size_t j = i;
      while (j < n && !unicode::is_space(c[j])) ++j;
      out.push_back(unicode::encode(std::u32string_view(c).substr(i, j - i)));
      i = j;
    }
    return out;
  }
  std::string d = require_str(sep, "separator");
  if (d.empty()) runtime_fail("empty separator");
  size_t start = 0;
  while (true) {
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) break;
    size_t k = s.find(d, start);
    if (k == std::string::npos) break;
    out.push_back(s.substr(start, k - start));
    start = k + d.size();
  }
  out.push_back(s.substr(start));
  return out;
}

std::vector<std::string> py_rsplit(const std::string& s, const Value& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep.is_none() || sep.is_undefined()) {
    auto c = cps(s);
    size_t n = c.size();
    size_t i = n;
    while (true) {
      while (i > 0 && unicode::is_space(c[i - 1])) --i;
      if (i == 0) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
        out.push_back(unicode::encode(std::u32string_view(c).substr(0, i)));
        break;
      }
      size_t j = i;
      while (j > 0 && !unicode::is_space(c[j - 1])) --j;
      out.push_back(unicode::encode(std::u32string_view(c).substr(j, i - j)));
      i = j;
    }
    std::reverse(out.begin(), out.end());
    return out;
  }
  std::string d = require_str(sep, "separator");
  if (d.empty()) runtime_fail("empty separator");
  size_t end = s.size();
  while (true) {
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) break;
    if (end < d.size()) break;
    size_t k = s.rfind(d, end - d.size());
    if (k == std::string::npos) break;
    out.push_back(s.substr(k + d.size(), end - k - d.size()));
    end = k;
  }
  out.push_back(s.substr(0, end));
  std::reverse(out.begin(), out.end());
  return out;
}

bool is_line_break(char32_t c) {
  return c == '\n' || c == '\r' || c == '\v' || c == '\f' || c == 0x1C || c == 0x1D || c == 0x1E ||
         c == 0x85 || c == 0x2028 || c == 0x2029;
}

std::vector<std::string> py_splitlines(const std::string& s, bool keepends) {
  std::vector<std::string> out;
  auto c = cps(s);
  size_t i = 0, n = c.size(), start = 0;
  while (i < n) {
    if (!is_line_break(c[i])) {
      ++i;
      continue;
    }
    size_t eol = i;
    if (c[i] == '\r' && i + 1 < n && c[i + 1] == '\n') ++i;
    ++i;
    out.push_back(unicode::encode(std::u32string_view(c).substr(start, (keepends ? i : eol) - start)));
    start = i;
  }
  if (start < n) out.push_back(unicode::encode(std::u32string_view(c).substr(start)));
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count) {
  std::string out;
  if (old.empty()) {  // Python inserts repl before every character and at the end
    auto c = cps(s);
    int64_t done = 0;
    for (size_t i = 0; i <= c.size(); ++i) {
      if (count < 0 || done < count) {
        out += repl;
        ++done;
      }
      if (i < c.size()) unicode::append_utf8(out, c[i]);
    }
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t k = s.find(old, start);
    if (k == std::string::npos) break;
    out.append(s, start, k - start);
    out += repl;
    start = k + old.size();
    ++done;
  }
  out.append(s, start, std::string::npos);
  return out;
}

std::string py_capitalize(const std::string& s) {
  auto c = cps(s);
  std::string out;
  for (size_t i = 0; i < c.size(); ++i)
    unicode::append_utf8(out, i == 0 ? unicode::to_upper(c[i]) : unicode::to_lower(c[i]));
  return out;
}

bool is_cased(char32_t c) {
  return unicode::to_lower(c) != c || unicode::to_upper(c) != c;
}

std::string py_str_title(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (char32_t c : cps(s)) {
    unicode::append_utf8(out, prev_cased ? unicode::to_lower(c) : unicode::to_upper(c));
    prev_cased = is_cased(c);
  }
  return out;
}

// jinja's title filter: capitalise each part after [-\s({\[<]+ separators.
std::string jinja_title(const std::string& s) {
  auto c = cps(s);
  std::string out;
  bool at_word_start = true;
  for (char32_t ch : c) {
    bool sep = ch == '-' || unicode::is_space(ch) || ch == '(' || ch == '{' || ch == '[' || ch == '<';
    if (sep) {
      unicode::append_utf8(out, ch);
      at_word_start = true;
    } else {
      unicode::append_utf8(out, at_word_start ? unicode::to_upper(ch) : unicode::to_lower(ch));
      at_word_start = false;
    }
  }
  return out;
}

// Python slice index normalisation (for str.find & co).
std::pair<size_t, size_t> slice_bounds(size_t n, const Value& start, const Value& end) {
  auto norm = [n](const Value& v, int64_t def) -> int64_t {
    if (v.is_none() || v.is_undefined()) return def;
    int64_t i = to_index(v, "slice index");
    if (i < 0) i += static_cast<int64_t>(n);
    return std::clamp<int64_t>(i, 0, static_cast<int64_t>(n));
  };
  int64_t b = norm(start, 0), e = norm(end, static_cast<int64_t>(n));
  return {static_cast<size_t>(b), static_cast<size_t>(std::max(b, e))};
}

// find/rfind/count over code points; returns code point index or -1.
int64_t py_find(const std::string& s, const std::string& sub, const Value& start, const Value& end,
                bool reverse) {
  auto offsets = unicode::code_point_offsets(s);
  size_t n = offsets.size() - 1;
  auto [b, e] = slice_bounds(n, start, end);
  std::string_view window(s.data() + offsets[b], offsets[e] - offsets[b]);
  size_t k = reverse ? window.rfind(sub) : window.find(sub);
  if (k == std::string_view::npos) return -1;
  size_t byte = offsets[b] + k;
  return static_cast<int64_t>(std::lower_bound(offsets.begin(), offsets.end(), byte) - offsets.begin());
}

std::string pad(const std::string& s, int64_t width, const std::string& fill,
                int align /*-1 left,0 center,1 right*/) {
  int64_t len = static_cast<int64_t>(unicode::length(s));
  if (width <= len) return s;
  int64_t total = width - len;
  int64_t left = align < 0 ? 0 : align > 0 ? total : total / 2 + (total & width & 1);
  int64_t right = total - left;
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fill;
  out += s;
  for (int64_t i = 0; i < right; ++i) out += fill;
  return out;
}

bool py_parse_int(std::string text, int base, int64_t& out) {
  text = py_strip(text, Value::none(), true, true);
  if (text.empty()) return false;
  bool neg = false;
  size_t i = 0;
  if (text[0] == '+' || text[0] == '-') {
    neg = text[0] == '-';
    i = 1;
  }
  if (i >= text.size()) return false;
  int64_t v = 0;
  bool prev_digit = false;
  for (; i < text.size(); ++i) {
    char ch = text[i];
    if (ch == '_') {
      if (!prev_digit || i + 1 >= text.size()) return false;
      prev_digit = false;
      continue;
    }
    int d = std::isdigit(static_cast<unsigned char>(ch)) ? ch - '0'
            : std::isalpha(static_cast<unsigned char>(ch))
                ? std::tolower(static_cast<unsigned char>(ch)) - 'a' + 10
                : 99;
    if (d >= base) return false;
    if (__builtin_mul_overflow(v, base, &v) || __builtin_add_overflow(v, d, &v)) return false;
    prev_digit = true;
  }
  out = neg ? -v : v;
  return true;
}

bool py_parse_float(std::string text, double& out) {
  text = py_strip(text, Value::none(), true, true);
  if (text.empty()) return false;
  std::string lower = unicode::lower(text);
  std::string body = lower;
  double sign = 1;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) {
    sign = body[0] == '-' ? -1 : 1;
    body = body.substr(1);
  }
  if (body == "inf" || body == "infinity") {
    out = sign * INFINITY;
    return true;
  }
  if (body == "nan") {
    out = NAN;
    return true;
  }
  for (char ch : body)
    if (!(std::isdigit(static_cast<unsigned char>(ch)) || ch == '.' || ch == 'e' || ch == '+' || ch == '-' ||
          ch == '_'))
      return false;
  text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
  char* end = nullptr;
  out = std::strtod(text.c_str(), &end);
  return end && *end == '\0';
}

}  // namespace kiln::tmpl::jinja
