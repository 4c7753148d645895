// Filters, tests, globals and Python methods/operators of the interpreter. Each follows the
// behaviour of the Python function it stands for (jinja2/filters.py, jinja2/tests.py, builtins).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <map>
#include <set>

#include "template/jinja/interpreter.h"
#include "template/jinja/unicode.h"

namespace kiln::tmpl::jinja {

namespace {

// ---- argument binding: positional then keyword, with defaults; nullopt default = required.

struct Param {
  std::string_view name;
  std::optional<Value> def;
};

std::vector<Value> bind_args(std::string_view fname, const CallArgs& args,
                             std::initializer_list<Param> params, size_t skip_positional = 0) {
  std::vector<std::optional<Value>> out(params.size());
  const auto* p = params.begin();
  size_t n_pos = args.positional.size() - std::min(skip_positional, args.positional.size());
  if (n_pos > params.size())
    runtime_fail("{}() takes at most {} argument(s) ({} given)", fname, params.size(), n_pos);
  for (size_t i = 0; i < n_pos; ++i) out[i] = args.positional[skip_positional + i];
  for (const auto& [k, v] : args.keyword) {
    size_t idx = params.size();
    for (size_t i = 0; i < params.size(); ++i)
      if (p[i].name == k) idx = i;
    if (idx == params.size()) runtime_fail("{}() got an unexpected keyword argument '{}'", fname, k);
    if (out[idx]) runtime_fail("{}() got multiple values for argument '{}'", fname, k);
    out[idx] = v;
  }
  std::vector<Value> result;
  result.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (out[i])
      result.push_back(std::move(*out[i]));
    else if (p[i].def)
      result.push_back(*p[i].def);
    else
      runtime_fail("{}() missing required argument '{}'", fname, p[i].name);
  }
  return result;
}

int64_t to_index(const Value& v, std::string_view what) {
  if (v.is_integral()) return v.as_int();
  runtime_fail("{} must be an integer, not {}", what, type_name(v));
}

std::string require_str(const Value& v, std::string_view what) {
  if (v.is_string()) return v.str();
  runtime_fail("{} must be str, not {}", what, type_name(v));
}

std::u32string cps(std::string_view s) {
  return unicode::decode(s);
}

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

Value make_callable(std::string name, std::function<Value(Interpreter&, CallArgs&)> fn) {
  auto c = std::make_shared<Callable>();
  c->name = std::move(name);
  c->fn = std::move(fn);
  return Value(std::move(c));
}

std::vector<Value> strings_to_values(const std::vector<std::string>& v) {
  std::vector<Value> out;
  out.reserve(v.size());
  for (const auto& s : v) out.emplace_back(s);
  return out;
}

Value str_format(Interpreter& in, const std::string& fmt_str, const CallArgs& args);

// ---- methods of str / list / dict

const std::set<std::string, std::less<>> kStrMethods = {
    "capitalize", "casefold",     "center",       "count",   "encode",     "endswith",    "expandtabs",
    "find",       "format",       "format_map",   "index",   "isalnum",    "isalpha",     "isascii",
    "isdecimal",  "isdigit",      "isidentifier", "islower", "isnumeric",  "isprintable", "isspace",
    "istitle",    "isupper",      "join",         "ljust",   "lower",      "lstrip",      "maketrans",
    "partition",  "removeprefix", "removesuffix", "replace", "rfind",      "rindex",      "rjust",
    "rpartition", "rsplit",       "rstrip",       "split",   "splitlines", "startswith",  "strip",
    "swapcase",   "title",        "translate",    "upper",   "zfill"};
const std::set<std::string, std::less<>> kListMethods = {
    "append", "clear", "copy", "count", "extend", "index", "insert", "pop", "remove", "reverse", "sort"};
const std::set<std::string, std::less<>> kTupleMethods = {"count", "index"};
const std::set<std::string, std::less<>> kDictMethods = {
    "clear", "copy", "fromkeys", "get", "items", "keys", "pop", "popitem", "setdefault", "update", "values"};
// ImmutableSandboxedEnvironment refuses methods that modify lists and dicts.
const std::set<std::string, std::less<>> kMutating = {"append",  "clear",      "extend",  "insert",
                                                      "pop",     "remove",     "reverse", "sort",
                                                      "popitem", "setdefault", "update"};

Value call_str_method(Interpreter& in, const Value& self, const std::string& name, CallArgs& args) {
  const std::string& s = self.str();
  auto b = [&](std::initializer_list<Param> params) { return bind_args("str." + name, args, params); };
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    auto a = b({{"chars", Value::none()}});
    return Value(py_strip(s, a[0], name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    auto a = b({{"sep", Value::none()}, {"maxsplit", Value(-1)}});
    int64_t maxsplit = to_index(a[1], "maxsplit");
    return Value::make_list(
        strings_to_values(name == "split" ? py_split(s, a[0], maxsplit) : py_rsplit(s, a[0], maxsplit)));
  }
  if (name == "splitlines") {
    auto a = b({{"keepends", Value(false)}});
    return Value::make_list(strings_to_values(py_splitlines(s, truthy(a[0]))));
  }
  if (name == "startswith" || name == "endswith") {
    auto a = b({{"prefix", std::nullopt}, {"start", Value::none()}, {"end", Value::none()}});
    auto offsets = unicode::code_point_offsets(s);
    auto [lo, hi] = slice_bounds(offsets.size() - 1, a[1], a[2]);
    std::string_view window(s.data() + offsets[lo], offsets[hi] - offsets[lo]);
    std::vector<Value> candidates = a[0].is_tuple() ? a[0].list().items : std::vector<Value>{a[0]};
    for (const auto& c : candidates) {
      const std::string& p = require_str(c, name + " first arg");
      if (name == "startswith" ? window.substr(0, p.size()) == p
                               : (window.size() >= p.size() && window.substr(window.size() - p.size()) == p))
        return Value(true);
    }
    return Value(false);
  }
  if (name == "upper") return b({}), Value(unicode::upper(s));
  if (name == "lower" || name == "casefold") return b({}), Value(unicode::lower(s));
  if (name == "title") return b({}), Value(py_str_title(s));
  if (name == "capitalize") return b({}), Value(py_capitalize(s));
  if (name == "swapcase") {
    b({});
    std::string out;
    for (char32_t c : cps(s)) {
      char32_t l = unicode::to_lower(c);
      unicode::append_utf8(out, l != c ? l : unicode::to_upper(c));
    }
    return Value(out);
  }
  if (name == "replace") {
    auto a = b({{"old", std::nullopt}, {"new", std::nullopt}, {"count", Value(-1)}});
    return Value(py_replace(s, require_str(a[0], "replace arg 1"), require_str(a[1], "replace arg 2"),
                            to_index(a[2], "count")));
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex") {
    auto a = b({{"sub", std::nullopt}, {"start", Value::none()}, {"end", Value::none()}});
    int64_t r = py_find(s, require_str(a[0], "substring"), a[1], a[2], name[0] == 'r');
    if (r < 0 && (name == "index" || name == "rindex")) runtime_fail("substring not found");
    return Value(r);
  }
  if (name == "count") {
    auto a = b({{"sub", std::nullopt}, {"start", Value::none()}, {"end", Value::none()}});
    std::string sub = require_str(a[0], "count arg");
    auto offsets = unicode::code_point_offsets(s);
    auto [lo, hi] = slice_bounds(offsets.size() - 1, a[1], a[2]);
    std::string_view window(s.data() + offsets[lo], offsets[hi] - offsets[lo]);
    if (sub.empty()) return Value(static_cast<int64_t>(unicode::length(window) + 1));
    int64_t n = 0;
    for (size_t k = window.find(sub); k != std::string_view::npos; k = window.find(sub, k + sub.size())) ++n;
    return Value(n);
  }
  if (name == "join") {
    auto a = b({{"iterable", std::nullopt}});
    std::string out;
    auto items = in.iterate(a[0]);
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].is_string())
        runtime_fail("sequence item {}: expected str instance, {} found", i, type_name(items[i]));
      if (i) out += s;
      out += items[i].str();
    }
    return Value(out);
  }
  if (name == "center" || name == "ljust" || name == "rjust") {
    auto a = b({{"width", std::nullopt}, {"fillchar", Value(" ")}});
    std::string fill = require_str(a[1], "fillchar");
    if (unicode::length(fill) != 1) runtime_fail("The fill character must be exactly one character long");
    return Value(pad(s, to_index(a[0], "width"), fill, name == "ljust" ? -1 : name == "rjust" ? 1 : 0));
  }
  if (name == "zfill") {
    auto a = b({{"width", std::nullopt}});
    int64_t width = to_index(a[0], "width");
    int64_t len = static_cast<int64_t>(unicode::length(s));
    if (width <= len) return Value(s);
    std::string sign, rest = s;
    if (!s.empty() && (s[0] == '+' || s[0] == '-')) {
      sign = s.substr(0, 1);
      rest = s.substr(1);
    }
    return Value(sign + std::string(width - len, '0') + rest);
  }
  if (name == "partition" || name == "rpartition") {
    auto a = b({{"sep", std::nullopt}});
    std::string sep = require_str(a[0], "separator");
    if (sep.empty()) runtime_fail("empty separator");
    size_t k = name == "partition" ? s.find(sep) : s.rfind(sep);
    if (k == std::string::npos)
      return name == "partition" ? Value::make_tuple({Value(s), Value(""), Value("")})
                                 : Value::make_tuple({Value(""), Value(""), Value(s)});
    return Value::make_tuple({Value(s.substr(0, k)), Value(sep), Value(s.substr(k + sep.size()))});
  }
  if (name == "removeprefix" || name == "removesuffix") {
    auto a = b({{"affix", std::nullopt}});
    std::string x = require_str(a[0], name + " arg");
    if (name == "removeprefix") return Value(s.rfind(x, 0) == 0 ? s.substr(x.size()) : s);
    return Value(s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0
                     ? s.substr(0, s.size() - x.size())
                     : s);
  }
  if (name == "format") return str_format(in, s, args);
  auto all_of = [&](auto pred) {
    auto c = cps(s);
    if (c.empty()) return false;
    return std::all_of(c.begin(), c.end(), pred);
  };
  if (name == "isdigit" || name == "isdecimal" || name == "isnumeric")
    return b({}), Value(all_of(unicode::is_digit));
  if (name == "isalpha") return b({}), Value(all_of(unicode::is_alpha));
  if (name == "isalnum") return b({}), Value(all_of(unicode::is_alnum));
  if (name == "isspace") return b({}), Value(all_of(unicode::is_space));
  if (name == "isascii") return b({}), Value(unicode::is_ascii(s));
  if (name == "islower" || name == "isupper") {
    b({});
    bool any_cased = false;
    for (char32_t c : cps(s)) {
      if (!is_cased(c)) continue;
      any_cased = true;
      if (name == "islower" ? unicode::to_lower(c) != c : unicode::to_upper(c) != c) return Value(false);
    }
    return Value(any_cased);
  }
  runtime_fail("str.{}() is not supported in kiln's chat template engine", name);
}

Value call_list_method(Interpreter&, const Value& self, const std::string& name, CallArgs& args) {
  if (kMutating.count(name))
    runtime_fail("access to attribute '{}' of '{}' object is unsafe (templates may not modify data)", name,
                 type_name(self));
  const auto& items = self.list().items;
  if (name == "count") {
    auto a = bind_args("count", args, {{"value", std::nullopt}});
    return Value(static_cast<int64_t>(
        std::count_if(items.begin(), items.end(), [&](const Value& v) { return py_equal(v, a[0]); })));
  }
  if (name == "index") {
    auto a = bind_args("index", args, {{"value", std::nullopt}});
    for (size_t i = 0; i < items.size(); ++i)
      if (py_equal(items[i], a[0])) return Value(static_cast<int64_t>(i));
    runtime_fail("{} is not in list", py_repr(a[0]));
  }
  if (name == "copy") {
    bind_args("copy", args, {});
    return Value::make_list(items);
  }
  runtime_fail("list.{}() is not supported", name);
}

Value call_dict_method(Interpreter&, const Value& self, const std::string& name, CallArgs& args) {
  if (kMutating.count(name))
    runtime_fail("access to attribute '{}' of 'dict' object is unsafe (templates may not modify data)", name);
  const Dict& d = self.dict();
  if (name == "items" || name == "keys" || name == "values") {
    bind_args(name, args, {});
    std::vector<Value> out;
    out.reserve(d.size());
    for (const auto& [k, v] : d.entries) {
      if (name == "items")
        out.push_back(Value::make_tuple({k, v}));
      else
        out.push_back(name == "keys" ? k : v);
    }
    return Value::make_list(std::move(out));
  }
  if (name == "get") {
    auto a = bind_args("get", args, {{"key", std::nullopt}, {"default", Value::none()}});
    if (const Value* v = d.find(a[0])) return *v;
    return a[1];
  }
  if (name == "copy") {
    bind_args("copy", args, {});
    auto c = Value::make_dict();
    for (const auto& [k, v] : d.entries) c.dict().set(k, v);
    return c;
  }
  runtime_fail("dict.{}() is not supported", name);
}

// ---- str.format (the subset chat templates use: {}, {0}, {name}, !r/!s, [fill][align][width][.prec][type])

std::string apply_format_spec(const Value& v, const std::string& spec) {
  if (spec.empty()) return py_str(v);
  size_t i = 0;
  std::string fill = " ";
  char align = 0;
  auto is_align = [](char c) { return c == '<' || c == '>' || c == '^' || c == '='; };
  if (spec.size() >= 2 && is_align(spec[1])) {
    fill = spec.substr(0, 1);
    align = spec[1];
    i = 2;
  } else if (!spec.empty() && is_align(spec[0])) {
    align = spec[0];
    i = 1;
  }
  char sign = 0;
  if (i < spec.size() && (spec[i] == '+' || spec[i] == '-' || spec[i] == ' ')) sign = spec[i++];
  bool zero = false;
  if (i < spec.size() && spec[i] == '0') {
    zero = true;
    ++i;
  }
  int64_t width = 0;
  while (i < spec.size() && std::isdigit(static_cast<unsigned char>(spec[i])))
    width = width * 10 + (spec[i++] - '0');
  int precision = -1;
  if (i < spec.size() && spec[i] == '.') {
    ++i;
    precision = 0;
    while (i < spec.size() && std::isdigit(static_cast<unsigned char>(spec[i])))
      precision = precision * 10 + (spec[i++] - '0');
  }
  char type = i < spec.size() ? spec[i++] : 0;
  if (i != spec.size()) runtime_fail("unsupported format specifier '{}'", spec);
  std::string body;
  bool numeric = v.is_number();
  if (type == 'd') {
    if (!v.is_integral()) runtime_fail("Unknown format code 'd' for object of type '{}'", type_name(v));
    body = std::to_string(v.as_int());
  } else if (type == 'f' || type == 'F' || type == 'e' || type == 'g' || type == '%') {
    if (!v.is_number()) runtime_fail("Unknown format code '{}' for object of type '{}'", type, type_name(v));
    double x = v.as_double() * (type == '%' ? 100 : 1);
    int p = precision < 0 ? 6 : precision;
    body = type == 'e'   ? fmt::format("{:.{}e}", x, p)
           : type == 'g' ? fmt::format("{:.{}g}", x, p)
                         : fmt::format("{:.{}f}", x, p);
    if (type == '%') body += "%";
  } else if (type == 0 || type == 's') {
    if (type == 's' && !v.is_string())
      runtime_fail("Unknown format code 's' for object of type '{}'", type_name(v));
    if (v.is_float() && precision >= 0)
      body = fmt::format("{:.{}g}", v.as_double(), precision);
    else
      body = py_str(v);
    if (v.is_string() && precision >= 0) {
      auto c = cps(body);
      body = unicode::encode(std::u32string_view(c).substr(0, std::min<size_t>(c.size(), precision)));
    }
  } else {
    runtime_fail("unsupported format type '{}'", type);
  }
  if (numeric && sign && (body.empty() || body[0] != '-') && sign != '-') body = std::string(1, sign) + body;
  if (zero && !align) {
    align = '=';
    fill = "0";
  }
  if (!align) align = numeric ? '>' : '<';
  int64_t len = static_cast<int64_t>(unicode::length(body));
  if (width <= len) return body;
  if (align == '=') {
    std::string sgn;
    if (!body.empty() && (body[0] == '-' || body[0] == '+' || body[0] == ' ')) {
      sgn = body.substr(0, 1);
      body = body.substr(1);
    }
    std::string out = sgn;
    for (int64_t k = 0; k < width - len; ++k) out += fill;
    return out + body;
  }
  return pad(body, width, fill, align == '<' ? -1 : align == '>' ? 1 : 0);
}

Value str_format(Interpreter& in, const std::string& f, const CallArgs& args) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    char c = f[i];
    if (c == '}') {
      if (i + 1 < f.size() && f[i + 1] == '}') {
        out.push_back('}');
        ++i;
        continue;
      }
      runtime_fail("Single '}}' encountered in format string");
    }
    if (c != '{') {
      out.push_back(c);
      continue;
    }
    if (i + 1 < f.size() && f[i + 1] == '{') {
      out.push_back('{');
      ++i;
      continue;
    }
    size_t close = f.find('}', i);
    if (close == std::string::npos) runtime_fail("Single '{{' encountered in format string");
    std::string field = f.substr(i + 1, close - i - 1);
    i = close;
    std::string spec, conversion;
    if (auto colon = field.find(':'); colon != std::string::npos) {
      spec = field.substr(colon + 1);
      field = field.substr(0, colon);
    }
    if (auto bang = field.find('!'); bang != std::string::npos) {
      conversion = field.substr(bang + 1);
      field = field.substr(0, bang);
    }
    // field name: [arg_name]("." attr | "[" key "]")*
    size_t end = field.find_first_of(".[");
    std::string head = field.substr(0, end);
    Value v;
    if (head.empty()) {
      if (auto_index >= args.positional.size())
        runtime_fail("Replacement index {} out of range for positional args tuple", auto_index);
      v = args.positional[auto_index++];
    } else if (std::all_of(head.begin(), head.end(),
                           [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); })) {
      size_t idx = head.size() > 9 ? SIZE_MAX : std::stoul(head);
      if (idx >= args.positional.size())
        runtime_fail("Replacement index {} out of range for positional args tuple", idx);
      v = args.positional[idx];
    } else {
      bool found = false;
      for (const auto& [k, val] : args.keyword)
        if (k == head) {
          v = val;
          found = true;
        }
      if (!found) runtime_fail("KeyError: '{}'", head);
    }
    while (end != std::string::npos && end < field.size()) {
      if (field[end] == '.') {
        size_t next = field.find_first_of(".[", end + 1);
        v = in.getattr(v,
                       field.substr(end + 1, next == std::string::npos ? std::string::npos : next - end - 1));
        end = next;
      } else {
        size_t rb = field.find(']', end);
        if (rb == std::string::npos) runtime_fail("Missing ']' in format string");
        std::string key = field.substr(end + 1, rb - end - 1);
        bool numeric = !key.empty() && std::all_of(key.begin(), key.end(), [](char ch) {
          return std::isdigit(static_cast<unsigned char>(ch));
        });
        v = in.getitem(
            v, numeric && key.size() <= 18 ? Value(static_cast<int64_t>(std::stoll(key))) : Value(key));
        end = rb + 1 < field.size() ? rb + 1 : std::string::npos;
      }
    }
    if (conversion == "r")
      v = Value(py_repr(v));
    else if (conversion == "s")
      v = Value(py_str(v));
    else if (!conversion.empty())
      runtime_fail("Unknown conversion specifier {}", conversion);
    out += apply_format_spec(v, spec);
  }
  return Value(out);
}

// ---- filters

using FilterFn = std::function<Value(Interpreter&, const Value&, CallArgs&)>;
using TestFn = std::function<bool(Interpreter&, const Value&, CallArgs&)>;

Value length_of(const Value& v) {
  switch (v.kind()) {
    case Kind::Undefined:
      return Value(0);
    case Kind::String:
      return Value(static_cast<int64_t>(unicode::length(v.str())));
    case Kind::List:
      return Value(static_cast<int64_t>(v.list().items.size()));
    case Kind::Dict:
      return Value(static_cast<int64_t>(v.dict().size()));
    default:
      runtime_fail("object of type '{}' has no len()", type_name(v));
  }
}

// Sort/unique key: attribute lookup, then lower-casing strings unless case sensitive.
Value sort_key(Interpreter& in, const Value& item, const Value& attribute, bool case_sensitive) {
  Value k = (attribute.is_none() || attribute.is_undefined()) ? item : in.get_attribute_path(item, attribute);
  if (!case_sensitive && k.is_string()) return Value(unicode::lower(k.str()));
  return k;
}

std::vector<Value> sorted_values(std::vector<Value> items, const std::function<Value(const Value&)>& key,
                                 bool reverse) {
  std::vector<std::pair<Value, Value>> keyed;
  keyed.reserve(items.size());
  for (auto& it : items) keyed.emplace_back(key(it), std::move(it));
  std::stable_sort(keyed.begin(), keyed.end(), [reverse](const auto& a, const auto& b) {
    return reverse ? py_compare(b.first, a.first) < 0 : py_compare(a.first, b.first) < 0;
  });
  std::vector<Value> out;
  out.reserve(keyed.size());
  for (auto& [k, v] : keyed) out.push_back(std::move(v));
  return out;
}

std::string py_round_str(double x, int precision) {
  return fmt::format("{:.{}f}", x, precision);
}

Value do_round(const Value& value, int64_t precision, const std::string& method) {
  if (!value.is_number()) runtime_fail("type {} doesn't define __round__ method", type_name(value));
  if (method != "common" && method != "ceil" && method != "floor")
    runtime_fail("method must be common, ceil or floor");
  if (method == "common") {
    if (value.is_integral()) {
      if (precision >= 0) return Value(value.as_int());
      // round(int, negative) rounds to tens etc. (half to even)
      double scale = std::pow(10.0, static_cast<double>(-precision));
      double q = value.as_double() / scale;
      double r = std::nearbyint(q);
      return Value(static_cast<int64_t>(r * scale));
    }
    double x = value.as_double();
    if (!std::isfinite(x)) return Value(x);
    if (precision >= 0 && precision <= 300)
      return Value(std::strtod(py_round_str(x, static_cast<int>(precision)).c_str(), nullptr));
    double scale = std::pow(10.0, static_cast<double>(-precision));
    return Value(std::nearbyint(x / scale) * scale);
  }
  double scale = std::pow(10.0, static_cast<double>(precision));
  double x = value.as_double() * scale;
  return Value((method == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
}

Value do_int(const Value& value, const Value& def, int64_t base) {
  if (value.is_string()) {
    int64_t out;
    if (py_parse_int(value.str(), static_cast<int>(base), out)) return Value(out);
    double d;
    if (py_parse_float(value.str(), d)) {
      if (!std::isfinite(d)) runtime_fail("cannot convert float infinity or NaN to integer");
      return Value(static_cast<int64_t>(std::trunc(d)));
    }
    return def;
  }
  if (value.is_integral()) return Value(value.as_int());
  if (value.is_float()) {
    double d = value.as_double();
    if (!std::isfinite(d)) runtime_fail("cannot convert float infinity or NaN to integer");
    return Value(static_cast<int64_t>(std::trunc(d)));
  }
  if (value.is_undefined()) fail_undefined(value);
  return def;
}

Value do_float(const Value& value, const Value& def) {
  if (value.is_number()) return Value(value.as_double());
  if (value.is_string()) {
    double d;
    if (py_parse_float(value.str(), d)) return Value(d);
    return def;
  }
  if (value.is_undefined()) fail_undefined(value);
  return def;
}

std::string do_indent(std::string s, const Value& width, bool first, bool blank) {
  std::string indention =
      width.is_string() ? width.str() : std::string(std::max<int64_t>(0, to_index(width, "width")), ' ');
  s += "\n";
  auto lines = py_splitlines(s, false);
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + indention : "") + lines[i];
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : indention + lines[i]);
  }
  if (first) rv = indention + rv;
  return rv;
}

std::string do_truncate(const std::string& s, int64_t length, bool killwords, const std::string& end,
                        int64_t leeway) {
  int64_t end_len = static_cast<int64_t>(unicode::length(end));
  if (length < end_len) runtime_fail("expected length >= {}, got {}", end_len, length);
  if (leeway < 0) runtime_fail("expected leeway >= 0, got {}", leeway);
  auto c = cps(s);
  if (static_cast<int64_t>(c.size()) <= length + leeway) return s;
  std::string head = unicode::encode(std::u32string_view(c).substr(0, static_cast<size_t>(length - end_len)));
  if (killwords) return head + end;
  auto parts = py_rsplit(head, Value(" "), 1);
  return parts[0] + end;
}

// select/reject/selectattr/rejectattr (jinja2.filters.select_or_reject).
Value select_or_reject(Interpreter& in, const Value& seq, CallArgs& args, bool lookup_attr, bool select) {
  std::vector<Value> rest = args.positional;
  Value attribute;
  if (lookup_attr) {
    if (rest.empty()) runtime_fail("Missing parameter for attribute name");
    attribute = rest.front();
    rest.erase(rest.begin());
  }
  std::optional<std::string> test_name;
  if (!rest.empty()) {
    test_name = require_str(rest.front(), "test name");
    rest.erase(rest.begin());
  }
  if (test_name && !has_test(*test_name)) runtime_fail("No test named '{}'", *test_name);
  std::vector<Value> out;
  for (auto& item : in.iterate(seq)) {
    Value v = lookup_attr ? in.get_attribute_path(item, attribute) : item;
    bool ok;
    if (test_name) {
      CallArgs test_args{rest, args.keyword};
      ok = call_test(in, *test_name, v, test_args);
    } else {
      ok = truthy(v);
    }
    if (ok == select) out.push_back(item);
  }
  return Value::make_list(std::move(out));
}

Value do_map(Interpreter& in, const Value& seq, CallArgs& args) {
  std::vector<Value> out;
  bool by_attribute = args.positional.empty();
  for (const auto& [k, v] : args.keyword)
    if (k == "attribute") by_attribute = true;
  auto items = in.iterate(seq);
  if (by_attribute) {
    auto a = bind_args("map", args, {{"attribute", std::nullopt}, {"default", Value()}});
    for (auto& item : items) {
      Value v = in.get_attribute_path(item, a[0]);
      if (v.is_undefined() && !a[1].is_undefined()) v = a[1];
      out.push_back(std::move(v));
    }
    return Value::make_list(std::move(out));
  }
  std::string filter = require_str(args.positional[0], "filter name");
  if (!has_filter(filter)) runtime_fail("No filter named '{}'", filter);
  CallArgs rest{std::vector<Value>(args.positional.begin() + 1, args.positional.end()), args.keyword};
  for (auto& item : items) {
    CallArgs a = rest;
    out.push_back(call_filter(in, filter, item, a));
  }
  return Value::make_list(std::move(out));
}

Value min_max(Interpreter& in, const Value& seq, CallArgs& args, bool want_max) {
  auto a = bind_args(want_max ? "max" : "min", args,
                     {{"case_sensitive", Value(false)}, {"attribute", Value::none()}});
  auto items = in.iterate(seq);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  Value best_key = sort_key(in, items[0], a[1], truthy(a[0]));
  for (size_t i = 1; i < items.size(); ++i) {
    Value k = sort_key(in, items[i], a[1], truthy(a[0]));
    int c = py_compare(k, best_key);
    if (want_max ? c > 0 : c < 0) {
      best = i;
      best_key = k;
    }
  }
  return items[best];
}

JsonDumpOptions tojson_options(const std::vector<Value>& a) {
  JsonDumpOptions o;
  o.ensure_ascii = truthy(a[0]);
  if (a[1].is_string())
    o.indent = a[1].str();
  else if (a[1].is_integral())
    o.indent = std::string(static_cast<size_t>(std::max<int64_t>(0, a[1].as_int())), ' ');
  else if (!a[1].is_none())
    runtime_fail("tojson: indent must be an int or a string");
  if (a[2].is_list()) {
    const auto& s = a[2].list().items;
    if (s.size() != 2 || !s[0].is_string() || !s[1].is_string())
      runtime_fail("tojson: separators must be two strings");
    o.separators = std::make_pair(s[0].str(), s[1].str());
  } else if (!a[2].is_none()) {
    runtime_fail("tojson: separators must be a (item, key) pair");
  }
  o.sort_keys = truthy(a[3]);
  return o;
}

const std::map<std::string, FilterFn, std::less<>>& filters() {
  static const std::map<std::string, FilterFn, std::less<>> table = [] {
    std::map<std::string, FilterFn, std::less<>> f;
    f["abs"] = [](Interpreter&, const Value& v, CallArgs& args) -> Value {
      bind_args("abs", args, {});
      if (v.is_float()) return Value(std::fabs(v.as_double()));
      if (v.is_integral()) return Value(v.as_int() < 0 ? -v.as_int() : v.as_int());
      if (v.is_undefined()) fail_undefined(v);
      runtime_fail("bad operand type for abs(): '{}'", type_name(v));
    };
    f["attr"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      // Python attributes only (methods, namespace / loop attributes), never dict items.
      auto a = bind_args("attr", args, {{"name", std::nullopt}});
      std::string name = require_str(a[0], "attribute name");
      if (v.is_undefined() || v.is_object()) return in.getattr(v, name);
      if (auto m = bound_method(v, name)) return *m;
      return Value::undefined(fmt::format("'{}' has no attribute '{}'", type_name(v), name));
    };
    f["batch"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      auto a = bind_args("batch", args, {{"linecount", std::nullopt}, {"fill_with", Value()}});
      int64_t n = to_index(a[0], "linecount");
      if (n <= 0) runtime_fail("batch size must be positive");
      std::vector<Value> out, tmp;
      for (auto& item : in.iterate(v)) {
        if (static_cast<int64_t>(tmp.size()) == n) {
          out.push_back(Value::make_list(std::move(tmp)));
          tmp.clear();
        }
        tmp.push_back(item);
      }
      if (!tmp.empty()) {
        if (!a[1].is_undefined() && !a[1].is_none())
          while (static_cast<int64_t>(tmp.size()) < n) tmp.push_back(a[1]);
        out.push_back(Value::make_list(std::move(tmp)));
      }
      return Value::make_list(std::move(out));
    };
    f["capitalize"] = [](Interpreter&, const Value& v, CallArgs& args) {
      bind_args("capitalize", args, {});
      return Value(py_capitalize(py_str(v)));
    };
    f["center"] = [](Interpreter&, const Value& v, CallArgs& args) {
      auto a = bind_args("center", args, {{"width", Value(80)}});
      return Value(pad(py_str(v), to_index(a[0], "width"), " ", 0));
    };
    f["default"] = [](Interpreter&, const Value& v, CallArgs& args) {
      auto a = bind_args("default", args, {{"default_value", Value("")}, {"boolean", Value(false)}});
      if (v.is_undefined() || (truthy(a[1]) && !truthy(v))) return a[0];
      return v;
    };
    f["d"] = f["default"];
    f["dictsort"] = [](Interpreter&, const Value& v, CallArgs& args) {
      auto a = bind_args("dictsort", args,
                         {{"case_sensitive", Value(false)}, {"by", Value("key")}, {"reverse", Value(false)}});
      if (!v.is_dict()) runtime_fail("dictsort: value is not a mapping");
      std::string by = require_str(a[1], "by");
      if (by != "key" && by != "value") runtime_fail("You can only sort by either 'key' or 'value'");
      std::vector<Value> pairs;
      for (const auto& [k, val] : v.dict().entries) pairs.push_back(Value::make_tuple({k, val}));
      bool cs = truthy(a[0]);
      size_t pos = by == "key" ? 0 : 1;
      return Value::make_list(sorted_values(
          std::move(pairs),
          [&](const Value& p) {
            Value k = p.list().items[pos];
            return (!cs && k.is_string()) ? Value(unicode::lower(k.str())) : k;
          },
          truthy(a[2])));
    };
    f["escape"] = [](Interpreter&, const Value& v, CallArgs& args) {
      bind_args("escape", args, {});
      if (v.is_safe()) return v;
      return Value(html_escape(py_str(v)), true);
    };
    f["e"] = f["escape"];
    f["forceescape"] = [](Interpreter&, const Value& v, CallArgs& args) {
      bind_args("forceescape", args, {});
      return Value(html_escape(py_str(v)), true);
    };
    f["first"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      bind_args("first", args, {});
      auto items = in.iterate(v);
      if (items.empty()) return Value::undefined("No first item, sequence was empty.");
      return items.front();
    };
    f["last"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      bind_args("last", args, {});
      auto items = in.iterate(v);
      if (items.empty()) return Value::undefined("No last item, sequence was empty.");
      return items.back();
    };
    f["float"] = [](Interpreter&, const Value& v, CallArgs& args) {
      auto a = bind_args("float", args, {{"default", Value(0.0)}});
      return do_float(v, a[0]);
    };
    f["format"] = [](Interpreter&, const Value& v, CallArgs& args) {
      if (!args.positional.empty() && !args.keyword.empty())
        runtime_fail("can't handle positional and keyword arguments at the same time");
      if (!args.keyword.empty()) {
        auto d = Value::make_dict();
        for (auto& [k, val] : args.keyword) d.dict().set(Value(k), val);
        return Value(py_percent_format(py_str(v), d));
      }
      return Value(py_percent_format(py_str(v), Value::make_tuple(args.positional)));
    };
    f["indent"] = [](Interpreter&, const Value& v, CallArgs& args) {
      auto a =
          bind_args("indent", args, {{"width", Value(4)}, {"first", Value(false)}, {"blank", Value(false)}});
      return Value(do_indent(py_str(v), a[0], truthy(a[1]), truthy(a[2])));
    };
    f["int"] = [](Interpreter&, const Value& v, CallArgs& args) {
      auto a = bind_args("int", args, {{"default", Value(0)}, {"base", Value(10)}});
      return do_int(v, a[0], to_index(a[1], "base"));
    };
    f["items"] = [](Interpreter&, const Value& v, CallArgs& args) {
      bind_args("items", args, {});
      if (v.is_undefined()) return Value::make_list();
      if (!v.is_dict()) runtime_fail("Can only get item pairs from a mapping.");
      std::vector<Value> out;
      for (const auto& [k, val] : v.dict().entries) out.push_back(Value::make_tuple({k, val}));
      return Value::make_list(std::move(out));
    };
    f["join"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      auto a = bind_args("join", args, {{"d", Value("")}, {"attribute", Value::none()}});
      std::string sep = py_str(a[0]);
      std::string out;
      bool first = true;
      for (auto& item : in.iterate(v)) {
        if (!first) out += sep;
        first = false;
        out += py_str(a[1].is_none() ? item : in.get_attribute_path(item, a[1]));
      }
      return Value(out);
    };
    f["length"] = [](Interpreter&, const Value& v, CallArgs& args) {
      bind_args("length", args, {});
      return length_of(v);
    };
    f["count"] = f["length"];
    f["list"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      bind_args("list", args, {});
      return Value::make_list(in.iterate(v));
    };
    f["lower"] = [](Interpreter&, const Value& v, CallArgs& args) {
      bind_args("lower", args, {});
      return Value(unicode::lower(py_str(v)));
    };
    f["upper"] = [](Interpreter&, const Value& v, CallArgs& args) {
      bind_args("upper", args, {});
      return Value(unicode::upper(py_str(v)));
    };
    f["map"] = [](Interpreter& in, const Value& v, CallArgs& args) { return do_map(in, v, args); };
    f["max"] = [](Interpreter& in, const Value& v, CallArgs& args) { return min_max(in, v, args, true); };
    f["min"] = [](Interpreter& in, const Value& v, CallArgs& args) { return min_max(in, v, args, false); };
    f["pprint"] = [](Interpreter&, const Value& v, CallArgs& args) {
      bind_args("pprint", args, {});
      return Value(py_repr(v));
    };
    f["reject"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      return select_or_reject(in, v, args, false, false);
    };
    f["rejectattr"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      return select_or_reject(in, v, args, true, false);
    };
    f["select"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      return select_or_reject(in, v, args, false, true);
    };
    f["selectattr"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      return select_or_reject(in, v, args, true, true);
    };
    f["replace"] = [](Interpreter&, const Value& v, CallArgs& args) {
      auto a = bind_args("replace", args,
                         {{"old", std::nullopt}, {"new", std::nullopt}, {"count", Value::none()}});
      int64_t count = a[2].is_none() ? -1 : to_index(a[2], "count");
      return Value(py_replace(py_str(v), py_str(a[0]), py_str(a[1]), count));
    };
    f["reverse"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      bind_args("reverse", args, {});
      if (v.is_string()) {
        auto c = cps(v.str());
        std::reverse(c.begin(), c.end());
        return Value(unicode::encode(c));
      }
      auto items = in.iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::make_list(std::move(items));
    };
    f["round"] = [](Interpreter&, const Value& v, CallArgs& args) {
      auto a = bind_args("round", args, {{"precision", Value(0)}, {"method", Value("common")}});
      return do_round(v, to_index(a[0], "precision"), require_str(a[1], "method"));
    };
    f["safe"] = [](Interpreter&, const Value& v, CallArgs& args) {
      bind_args("safe", args, {});
      return Value(py_str(v), true);
    };
    f["slice"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      auto a = bind_args("slice", args, {{"slices", std::nullopt}, {"fill_with", Value::none()}});
      auto seq = in.iterate(v);
      int64_t slices = to_index(a[0], "slices");
      if (slices <= 0) runtime_fail("slices must be positive");
      int64_t length = static_cast<int64_t>(seq.size());
      int64_t per = length / slices, with_extra = length % slices;
      int64_t offset = 0;
      std::vector<Value> out;
      for (int64_t i = 0; i < slices; ++i) {
        int64_t start = offset + i * per;
        if (i < with_extra) ++offset;
        int64_t end = offset + (i + 1) * per;
        std::vector<Value> part(seq.begin() + start, seq.begin() + end);
        if (!a[1].is_none() && i >= with_extra) part.push_back(a[1]);
        out.push_back(Value::make_list(std::move(part)));
      }
      return Value::make_list(std::move(out));
    };
    f["sort"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      auto a = bind_args(
          "sort", args,
          {{"reverse", Value(false)}, {"case_sensitive", Value(false)}, {"attribute", Value::none()}});
      bool cs = truthy(a[1]);
      return Value::make_list(sorted_values(
          in.iterate(v), [&](const Value& item) { return sort_key(in, item, a[2], cs); }, truthy(a[0])));
    };
    f["string"] = [](Interpreter&, const Value& v, CallArgs& args) {
      bind_args("string", args, {});
      if (v.is_string()) return v;
      return Value(py_str(v));
    };
    f["sum"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      auto a = bind_args("sum", args, {{"attribute", Value::none()}, {"start", Value(0)}});
      Value total = a[1];
      for (auto& item : in.iterate(v))
        total = py_add(total, a[0].is_none() ? item : in.get_attribute_path(item, a[0]));
      return total;
    };
    f["title"] = [](Interpreter&, const Value& v, CallArgs& args) {
      bind_args("title", args, {});
      return Value(jinja_title(py_str(v)));
    };
    // Hugging Face's tojson: json.dumps(x, ensure_ascii=False, indent=None, separators=None,
    // sort_keys=False).
    f["tojson"] = [](Interpreter&, const Value& v, CallArgs& args) {
      auto a = bind_args("tojson", args,
                         {{"ensure_ascii", Value(false)},
                          {"indent", Value::none()},
                          {"separators", Value::none()},
                          {"sort_keys", Value(false)}});
      return Value(json_dumps(v, tojson_options(a)));
    };
    f["trim"] = [](Interpreter&, const Value& v, CallArgs& args) {
      auto a = bind_args("trim", args, {{"chars", Value::none()}});
      return Value(py_strip(py_str(v), a[0], true, true));
    };
    f["truncate"] = [](Interpreter&, const Value& v, CallArgs& args) {
      auto a = bind_args("truncate", args,
                         {{"length", Value(255)},
                          {"killwords", Value(false)},
                          {"end", Value("...")},
                          {"leeway", Value::none()}});
      int64_t leeway = a[3].is_none() ? 5 : to_index(a[3], "leeway");
      return Value(do_truncate(py_str(v), to_index(a[0], "length"), truthy(a[1]), py_str(a[2]), leeway));
    };
    f["unique"] = [](Interpreter& in, const Value& v, CallArgs& args) {
      auto a = bind_args("unique", args, {{"case_sensitive", Value(false)}, {"attribute", Value::none()}});
      std::vector<Value> out, seen;
      for (auto& item : in.iterate(v)) {
        Value k = sort_key(in, item, a[1], truthy(a[0]));
        if (k.is_list() && !k.is_tuple()) runtime_fail("unhashable type: 'list'");
        if (k.is_dict()) runtime_fail("unhashable type: 'dict'");
        if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return py_equal(s, k); })) continue;
        seen.push_back(k);
        out.push_back(item);
      }
      return Value::make_list(std::move(out));
    };
    f["wordcount"] = [](Interpreter&, const Value& v, CallArgs& args) {
      bind_args("wordcount", args, {});
      int64_t n = 0;
      bool in_word = false;
      for (char32_t c : cps(py_str(v))) {
        bool w = unicode::is_alnum(c) || c == '_' ||
                 (c >= 0x80 && !unicode::is_space(c) && unicode::is_printable(c));
        if (w && !in_word) ++n;
        in_word = w;
      }
      return Value(n);
    };
    return f;
  }();
  return table;
}

// ---- tests

bool is_sequence(const Value& v) {
  return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
}

const std::map<std::string, TestFn, std::less<>>& tests() {
  static const std::map<std::string, TestFn, std::less<>> table = [] {
    std::map<std::string, TestFn, std::less<>> t;
    auto no_args = [](std::string_view name, CallArgs& args) { bind_args(name, args, {}); };
    auto one_arg = [](std::string_view name, CallArgs& args) {
      return bind_args(name, args, {{"other", std::nullopt}})[0];
    };
    t["boolean"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("boolean", a);
      return v.is_bool();
    };
    t["callable"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("callable", a);
      return v.is_callable() || v.is_undefined() || (v.is_object() && v.object().is_callable());
    };
    t["defined"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("defined", a);
      return !v.is_undefined();
    };
    t["undefined"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("undefined", a);
      return v.is_undefined();
    };
    t["none"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("none", a);
      return v.is_none();
    };
    t["true"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("true", a);
      return v.is_bool() && v.as_bool();
    };
    t["false"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("false", a);
      return v.is_bool() && !v.as_bool();
    };
    t["integer"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("integer", a);
      return v.is_int();
    };
    t["float"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("float", a);
      return v.is_float();
    };
    t["number"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("number", a);
      return v.is_number();
    };
    t["string"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("string", a);
      return v.is_string();
    };
    t["mapping"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("mapping", a);
      return v.is_dict();
    };
    t["iterable"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("iterable", a);
      return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
    };
    t["sequence"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("sequence", a);
      return is_sequence(v);
    };
    t["escaped"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("escaped", a);
      return v.is_safe();
    };
    t["lower"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("lower", a);
      std::string s = py_str(v);
      return unicode::lower(s) == s && unicode::upper(s) != s;
    };
    t["upper"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("upper", a);
      std::string s = py_str(v);
      return unicode::upper(s) == s && unicode::lower(s) != s;
    };
    auto int_mod = [](const Value& v, int64_t m) -> int64_t {
      if (!v.is_number()) runtime_fail("unsupported operand type(s) for %: '{}' and 'int'", type_name(v));
      if (v.is_float()) return std::fmod(v.as_double(), static_cast<double>(m)) == 0 ? 0 : 1;
      int64_t r = v.as_int() % m;
      return r < 0 ? r + m : r;
    };
    t["odd"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("odd", a);
      return int_mod(v, 2) == 1;
    };
    t["even"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("even", a);
      return int_mod(v, 2) == 0;
    };
    t["divisibleby"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      Value num = bind_args("divisibleby", a, {{"num", std::nullopt}})[0];
      int64_t n = to_index(num, "num");
      if (n == 0) runtime_fail("integer division or modulo by zero");
      return int_mod(v, n < 0 ? -n : n) == 0;
    };
    auto eq = [=](Interpreter&, const Value& v, CallArgs& a) { return py_equal(v, one_arg("eq", a)); };
    auto ne = [=](Interpreter&, const Value& v, CallArgs& a) { return !py_equal(v, one_arg("ne", a)); };
    auto lt = [=](Interpreter&, const Value& v, CallArgs& a) { return py_compare(v, one_arg("lt", a)) < 0; };
    auto le = [=](Interpreter&, const Value& v, CallArgs& a) { return py_compare(v, one_arg("le", a)) <= 0; };
    auto gt = [=](Interpreter&, const Value& v, CallArgs& a) { return py_compare(v, one_arg("gt", a)) > 0; };
    auto ge = [=](Interpreter&, const Value& v, CallArgs& a) { return py_compare(v, one_arg("ge", a)) >= 0; };
    for (const char* n : {"eq", "equalto", "=="}) t[n] = eq;
    for (const char* n : {"ne", "!="}) t[n] = ne;
    for (const char* n : {"lt", "lessthan", "<"}) t[n] = lt;
    for (const char* n : {"le", "<="}) t[n] = le;
    for (const char* n : {"gt", "greaterthan", ">"}) t[n] = gt;
    for (const char* n : {"ge", ">="}) t[n] = ge;
    t["in"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      return py_contains(bind_args("in", a, {{"seq", std::nullopt}})[0], v);
    };
    t["sameas"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      Value o = one_arg("sameas", a);
      if (v.kind() != o.kind()) return false;
      switch (v.kind()) {
        case Kind::None:
        case Kind::Undefined:
          return true;
        case Kind::Bool:
          return v.as_bool() == o.as_bool();
        case Kind::Int:
          return v.as_int() == o.as_int() && v.as_int() >= -5 && v.as_int() <= 256;  // CPython small ints
        default:
          return v.identity() != nullptr && v.identity() == o.identity();
      }
    };
    t["filter"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("filter", a);
      return v.is_string() && has_filter(v.str());
    };
    t["test"] = [=](Interpreter&, const Value& v, CallArgs& a) {
      no_args("test", a);
      return v.is_string() && has_test(v.str());
    };
    return t;
  }();
  return table;
}

// ---- globals

class Cycler : public Object {
 public:
  explicit Cycler(std::vector<Value> items) : items_(std::move(items)) {}
  std::string_view type_name() const override { return "Cycler"; }
  Value get_attr(std::string_view name) override {
    if (name == "current") return items_[pos_];
    if (name == "next" || name == "reset") {
      auto self = self_.lock();
      std::string method(name);
      return make_callable("cycler." + method, [self, method](Interpreter&, CallArgs& args) -> Value {
        bind_args(method, args, {});
        if (method == "reset") {
          self->pos_ = 0;
          return Value::none();
        }
        Value v = self->items_[self->pos_];
        self->pos_ = (self->pos_ + 1) % self->items_.size();
        return v;
      });
    }
    return Value::undefined(fmt::format("'Cycler object' has no attribute '{}'", name));
  }
  std::weak_ptr<Cycler> self_;

 private:
  std::vector<Value> items_;
  size_t pos_ = 0;
};

class Joiner : public Object {
 public:
  explicit Joiner(std::string sep) : sep_(std::move(sep)) {}
  std::string_view type_name() const override { return "Joiner"; }
  Value get_attr(std::string_view name) override {
    return Value::undefined(fmt::format("'Joiner object' has no attribute '{}'", name));
  }
  bool is_callable() const override { return true; }
  Value call(Interpreter&, CallArgs& args) override {
    bind_args("joiner", args, {});
    if (!used_) {
      used_ = true;
      return Value("");
    }
    return Value(sep_);
  }

 private:
  std::string sep_;
  bool used_ = false;
};

}  // namespace

// ---- public helpers

bool has_filter(const std::string& name) {
  return filters().count(name) > 0;
}
bool has_test(const std::string& name) {
  return tests().count(name) > 0;
}

Value call_filter(Interpreter& in, const std::string& name, const Value& input, CallArgs& args) {
  auto it = filters().find(name);
  if (it == filters().end()) runtime_fail("No filter named '{}'", name);
  return it->second(in, input, args);
}

bool call_test(Interpreter& in, const std::string& name, const Value& input, CallArgs& args) {
  auto it = tests().find(name);
  if (it == tests().end()) runtime_fail("No test named '{}'", name);
  return it->second(in, input, args);
}

std::optional<Value> bound_method(const Value& self, const std::string& name) {
  using Method = Value (*)(Interpreter&, const Value&, const std::string&, CallArgs&);
  Method m = nullptr;
  if (self.is_string() && kStrMethods.count(name))
    m = call_str_method;
  else if (self.is_tuple() && kTupleMethods.count(name))
    m = call_list_method;
  else if (self.is_list() && !self.is_tuple() && kListMethods.count(name))
    m = call_list_method;
  else if (self.is_dict() && kDictMethods.count(name))
    m = call_dict_method;
  if (!m) return std::nullopt;
  return make_callable(std::string(type_name(self)) + "." + name,
                       [self, name, m](Interpreter& in, CallArgs& args) { return m(in, self, name, args); });
}

void add_globals(Scope& scope) {
  scope.vars["range"] = make_callable("range", [](Interpreter& in, CallArgs& args) -> Value {
    if (!args.keyword.empty()) runtime_fail("range() takes no keyword arguments");
    const auto& p = args.positional;
    if (p.empty() || p.size() > 3) runtime_fail("range expected 1 to 3 arguments, got {}", p.size());
    int64_t start = 0, stop, step = 1;
    if (p.size() == 1) {
      stop = to_index(p[0], "range() argument");
    } else {
      start = to_index(p[0], "range() argument");
      stop = to_index(p[1], "range() argument");
      if (p.size() == 3) step = to_index(p[2], "range() argument");
    }
    if (step == 0) runtime_fail("range() arg 3 must not be zero");
    int64_t count = step > 0 ? (stop > start ? (stop - start + step - 1) / step : 0)
                             : (start > stop ? (start - stop - step - 1) / -step : 0);
    if (count > in.limits().max_range)
      runtime_fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE ({}).",
                   in.limits().max_range);
    std::vector<Value> out;
    out.reserve(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) out.emplace_back(start + i * step);
    return Value::make_list(std::move(out));
  });
  scope.vars["dict"] = make_callable("dict", [](Interpreter& in, CallArgs& args) -> Value {
    auto d = Value::make_dict();
    if (args.positional.size() > 1)
      runtime_fail("dict expected at most 1 argument, got {}", args.positional.size());
    if (!args.positional.empty()) {
      const Value& src = args.positional[0];
      if (src.is_dict()) {
        for (const auto& [k, v] : src.dict().entries) d.dict().set(k, v);
      } else {
        for (auto& pair : in.iterate(src)) {
          auto kv = in.iterate(pair);
          if (kv.size() != 2)
            runtime_fail("dictionary update sequence element has length {}; 2 is required", kv.size());
          d.dict().set(kv[0], kv[1]);
        }
      }
    }
    for (auto& [k, v] : args.keyword) d.dict().set(Value(k), v);
    return d;
  });
  scope.vars["namespace"] = make_callable("namespace", [](Interpreter& in, CallArgs& args) -> Value {
    auto ns = std::make_shared<Namespace>();
    in.track_namespace(ns);
    if (args.positional.size() > 1) runtime_fail("namespace expected at most 1 positional argument");
    if (!args.positional.empty()) {
      const Value& src = args.positional[0];
      if (src.is_dict()) {
        for (const auto& [k, v] : src.dict().entries) ns->attrs.set(k, v);
      } else {
        for (auto& pair : in.iterate(src)) {
          auto kv = in.iterate(pair);
          if (kv.size() != 2) runtime_fail("namespace: expected (key, value) pairs");
          ns->attrs.set(kv[0], kv[1]);
        }
      }
    }
    for (auto& [k, v] : args.keyword) ns->attrs.set(Value(k), v);
    return Value(std::static_pointer_cast<Object>(ns));
  });
  scope.vars["cycler"] = make_callable("cycler", [](Interpreter&, CallArgs& args) -> Value {
    if (args.positional.empty()) runtime_fail("at least one item has to be provided");
    auto c = std::make_shared<Cycler>(args.positional);
    c->self_ = c;
    return Value(std::static_pointer_cast<Object>(c));
  });
  scope.vars["joiner"] = make_callable("joiner", [](Interpreter&, CallArgs& args) -> Value {
    auto a = bind_args("joiner", args, {{"sep", Value(", ")}});
    return Value(std::static_pointer_cast<Object>(std::make_shared<Joiner>(py_str(a[0]))));
  });
  // Hugging Face's additions.
  scope.vars["raise_exception"] = make_callable("raise_exception", [](Interpreter&, CallArgs& args) -> Value {
    auto a = bind_args("raise_exception", args, {{"message", std::nullopt}});
    throw TemplateRaised(py_str(a[0]));
  });
  scope.vars["strftime_now"] = make_callable("strftime_now", [](Interpreter&, CallArgs& args) -> Value {
    auto a = bind_args("strftime_now", args, {{"format", std::nullopt}});
    std::string f = require_str(a[0], "format");
    std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    std::string buf(256 + f.size() * 4, '\0');
    size_t n = std::strftime(buf.data(), buf.size(), f.c_str(), &local);
    if (n == 0 && !f.empty()) return Value("");
    buf.resize(n);
    return Value(buf);
  });
}

// ---- operators

[[noreturn]] void fail_undefined(const Value& undefined) {
  const std::string& hint = undefined.undefined_hint();
  runtime_fail("{}", hint.empty() ? std::string("value is undefined") : hint);
}

std::string html_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

Value py_add(const Value& a, const Value& b) {
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return Value(a.as_double() + b.as_double());
    int64_t r;
    if (__builtin_add_overflow(a.as_int(), b.as_int(), &r)) runtime_fail("integer overflow");
    return Value(r);
  }
  if (a.is_string() && b.is_string()) {
    // markupsafe.Markup escapes the plain operand.
    if (a.is_safe() && !b.is_safe()) return Value(a.str() + html_escape(b.str()), true);
    if (!a.is_safe() && b.is_safe()) return Value(html_escape(a.str()) + b.str(), true);
    return Value(a.str() + b.str(), a.is_safe());
  }
  if (a.is_list() && b.is_list() && a.is_tuple() == b.is_tuple()) {
    std::vector<Value> items = a.list().items;
    items.insert(items.end(), b.list().items.begin(), b.list().items.end());
    return a.is_tuple() ? Value::make_tuple(std::move(items)) : Value::make_list(std::move(items));
  }
  if (a.is_string() && !a.is_safe())
    runtime_fail("can only concatenate str (not \"{}\") to str", type_name(b));
  if (a.is_list() && !a.is_tuple())
    runtime_fail("can only concatenate list (not \"{}\") to list", type_name(b));
  runtime_fail("unsupported operand type(s) for +: '{}' and '{}'", type_name(a), type_name(b));
}

namespace {

Value repeat(const Value& seq, int64_t times, const RenderLimits& limits) {
  if (times < 0) times = 0;
  if (seq.is_string()) {
    if (seq.str().size() * static_cast<size_t>(times) > limits.max_output_bytes)
      runtime_fail("string repetition exceeds {} bytes", limits.max_output_bytes);
    std::string out;
    out.reserve(seq.str().size() * times);
    for (int64_t i = 0; i < times; ++i) out += seq.str();
    return Value(out, seq.is_safe());
  }
  const auto& items = seq.list().items;
  if (items.size() * static_cast<size_t>(times) > 10'000'000) runtime_fail("list repetition too large");
  std::vector<Value> out;
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), items.begin(), items.end());
  return seq.is_tuple() ? Value::make_tuple(std::move(out)) : Value::make_list(std::move(out));
}

}  // namespace

Value py_arith(BinOp op, const Value& a, const Value& b, const RenderLimits& limits) {
  if (op == BinOp::Add) return py_add(a, b);
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  static const char* symbols[] = {"+", "-", "*", "/", "//", "%", "**"};
  const char* sym = symbols[static_cast<int>(op)];
  if (op == BinOp::Mul) {
    if ((a.is_string() || a.is_list()) && b.is_integral()) return repeat(a, b.as_int(), limits);
    if ((b.is_string() || b.is_list()) && a.is_integral()) return repeat(b, a.as_int(), limits);
  }
  if (op == BinOp::Mod && a.is_string()) return Value(py_percent_format(a.str(), b));
  if (!a.is_number() || !b.is_number())
    runtime_fail("unsupported operand type(s) for {}: '{}' and '{}'", sym, type_name(a), type_name(b));
  bool floating = a.is_float() || b.is_float();
  switch (op) {
    case BinOp::Sub:
      if (!floating) {
        int64_t r;
        if (__builtin_sub_overflow(a.as_int(), b.as_int(), &r)) runtime_fail("integer overflow");
        return Value(r);
      }
      return Value(a.as_double() - b.as_double());
    case BinOp::Mul:
      if (!floating) {
        int64_t r;
        if (__builtin_mul_overflow(a.as_int(), b.as_int(), &r)) runtime_fail("integer overflow");
        return Value(r);
      }
      return Value(a.as_double() * b.as_double());
    case BinOp::Div:
      if (b.as_double() == 0) runtime_fail("division by zero");
      return Value(a.as_double() / b.as_double());
    case BinOp::FloorDiv:
    case BinOp::Mod: {
      if (b.as_double() == 0)
        runtime_fail("{}", op == BinOp::Mod ? "modulo by zero" : "integer division or modulo by zero");
      if (!floating) {
        int64_t x = a.as_int(), y = b.as_int();
        if (x == INT64_MIN && y == -1) runtime_fail("integer overflow");
        int64_t q = x / y, r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) {
          --q;
          r += y;
        }
        return op == BinOp::FloorDiv ? Value(q) : Value(r);
      }
      double x = a.as_double(), y = b.as_double();
      double r = std::fmod(x, y);
      if (r != 0 && ((r < 0) != (y < 0))) r += y;
      if (op == BinOp::Mod) return Value(r);
      return Value(std::floor((x - r) / y + 0.5) == (x - r) / y ? (x - r) / y : std::floor(x / y));
    }
    case BinOp::Pow: {
      if (!floating && b.as_int() >= 0) {
        int64_t base = a.as_int(), e = b.as_int(), r = 1;
        while (e > 0) {
          if (e & 1)
            if (__builtin_mul_overflow(r, base, &r)) runtime_fail("integer overflow");
          e >>= 1;
          if (e > 0 && __builtin_mul_overflow(base, base, &base)) runtime_fail("integer overflow");
        }
        return Value(r);
      }
      if (a.as_double() == 0 && b.as_double() < 0) runtime_fail("0.0 cannot be raised to a negative power");
      return Value(std::pow(a.as_double(), b.as_double()));
    }
    default:
      break;
  }
  runtime_fail("unsupported operator");
}

bool py_contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Kind::Undefined:
      return false;
    case Kind::String:
      if (item.is_undefined()) fail_undefined(item);
      if (!item.is_string())
        runtime_fail("'in <string>' requires string as left operand, not {}", type_name(item));
      return container.str().find(item.str()) != std::string::npos;
    case Kind::List:
      for (const auto& v : container.list().items)
        if (py_equal(v, item)) return true;
      return false;
    case Kind::Dict:
      if (item.is_list() && !item.is_tuple()) runtime_fail("unhashable type: 'list'");
      if (item.is_dict()) runtime_fail("unhashable type: 'dict'");
      return container.dict().find(item) != nullptr;
    default:
      runtime_fail("argument of type '{}' is not iterable", type_name(container));
  }
}

Value py_slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v) {
  if (obj.is_undefined()) fail_undefined(obj);
  auto index_or_none = [](const Value& v) -> std::optional<int64_t> {
    if (v.is_none()) return std::nullopt;
    if (v.is_integral()) return v.as_int();
    throw RuntimeError("slice indices must be integers or None");
  };
  std::optional<int64_t> start, stop, step;
  try {
    start = index_or_none(start_v);
    stop = index_or_none(stop_v);
    step = index_or_none(step_v);
  } catch (const RuntimeError&) {
    return Value::undefined("slice indices must be integers or None");
  }
  if (!obj.is_string() && !obj.is_list())
    return Value::undefined(fmt::format("'{}' object is not subscriptable", type_name(obj)));
  int64_t st = step.value_or(1);
  if (st == 0) runtime_fail("slice step cannot be zero");
  std::vector<size_t> offsets;
  int64_t n;
  if (obj.is_string()) {
    offsets = unicode::code_point_offsets(obj.str());
    n = static_cast<int64_t>(offsets.size()) - 1;
  } else {
    n = static_cast<int64_t>(obj.list().items.size());
  }
  auto adjust = [n, st](std::optional<int64_t> v, bool is_start) -> int64_t {
    if (!v) return st > 0 ? (is_start ? 0 : n) : (is_start ? n - 1 : -1);
    int64_t x = *v;
    if (x < 0) {
      x += n;
      if (x < 0) x = st > 0 ? 0 : -1;
    } else if (x >= n) {
      x = st > 0 ? n : n - 1;
    }
    return x;
  };
  int64_t b = adjust(start, true), e = adjust(stop, false);
  std::vector<int64_t> idx;
  if (st > 0)
    for (int64_t i = b; i < e; i += st) idx.push_back(i);
  else
    for (int64_t i = b; i > e; i += st) idx.push_back(i);
  if (obj.is_string()) {
    const std::string& s = obj.str();
    std::string out;
    if (st == 1 && !idx.empty())
      return Value(s.substr(offsets[idx.front()], offsets[idx.back() + 1] - offsets[idx.front()]));
    for (int64_t i : idx) out.append(s, offsets[i], offsets[i + 1] - offsets[i]);
    return Value(out);
  }
  std::vector<Value> out;
  out.reserve(idx.size());
  for (int64_t i : idx) out.push_back(obj.list().items[i]);
  return obj.is_tuple() ? Value::make_tuple(std::move(out)) : Value::make_list(std::move(out));
}

// printf-style formatting: str % args.
std::string py_percent_format(const std::string& f, const Value& args) {
  std::vector<Value> positional;
  const Dict* mapping = nullptr;
  if (args.is_tuple())
    positional = args.list().items;
  else if (args.is_dict())
    mapping = &args.dict();
  else
    positional = {args};
  size_t next_arg = 0;
  std::string out;
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] != '%') {
      out.push_back(f[i]);
      continue;
    }
    if (++i >= f.size()) runtime_fail("incomplete format");
    Value v;
    bool have_value = false;
    if (f[i] == '(') {
      size_t close = f.find(')', i);
      if (close == std::string::npos || !mapping) runtime_fail("format requires a mapping");
      std::string key = f.substr(i + 1, close - i - 1);
      const Value* found = mapping->find(std::string_view(key));
      if (!found) runtime_fail("KeyError: '{}'", key);
      v = *found;
      have_value = true;
      i = close + 1;
    }
    std::string flags;
    while (i < f.size() && std::strchr("-+ 0#", f[i])) flags.push_back(f[i++]);
    int64_t width = 0;
    while (i < f.size() && std::isdigit(static_cast<unsigned char>(f[i])))
      width = width * 10 + (f[i++] - '0');
    int precision = -1;
    if (i < f.size() && f[i] == '.') {
      ++i;
      precision = 0;
      while (i < f.size() && std::isdigit(static_cast<unsigned char>(f[i])))
        precision = precision * 10 + (f[i++] - '0');
    }
    if (i >= f.size()) runtime_fail("incomplete format");
    char conv = f[i];
    if (conv == '%') {
      out.push_back('%');
      continue;
    }
    if (!have_value) {
      if (mapping && positional.empty())
        v = args;
      else if (next_arg < positional.size())
        v = positional[next_arg++];
      else
        runtime_fail("not enough arguments for format string");
    }
    std::string body;
    switch (conv) {
      case 's':
        body = py_str(v);
        break;
      case 'r':
      case 'a':
        body = py_repr(v);
        break;
      case 'd':
      case 'i':
      case 'u':
        if (!v.is_number()) runtime_fail("%{} format: a real number is required, not {}", conv, type_name(v));
        body = std::to_string(v.is_float() ? static_cast<int64_t>(std::trunc(v.as_double())) : v.as_int());
        break;
      case 'f':
      case 'F':
      case 'e':
      case 'g':
        if (!v.is_number()) runtime_fail("must be real number, not {}", type_name(v));
        body = conv == 'e'   ? fmt::format("{:.{}e}", v.as_double(), precision < 0 ? 6 : precision)
               : conv == 'g' ? fmt::format("{:.{}g}", v.as_double(), precision < 0 ? 6 : precision)
                             : fmt::format("{:.{}f}", v.as_double(), precision < 0 ? 6 : precision);
        break;
      case 'x':
      case 'X':
      case 'o':
        if (!v.is_integral()) runtime_fail("%{} format: an integer is required, not {}", conv, type_name(v));
        body = conv == 'o'   ? fmt::format("{:o}", v.as_int())
               : conv == 'x' ? fmt::format("{:x}", v.as_int())
                             : fmt::format("{:X}", v.as_int());
        break;
      case 'c':
        if (v.is_string())
          body = v.str();
        else if (v.is_integral())
          unicode::append_utf8(body, static_cast<char32_t>(v.as_int()));
        else
          runtime_fail("%c requires int or char");
        break;
      default:
        runtime_fail("unsupported format character '{}'", conv);
    }
    if ((conv == 's' || conv == 'r' || conv == 'a') && precision >= 0) {
      auto c = unicode::decode(body);
      body = unicode::encode(std::u32string_view(c).substr(0, std::min<size_t>(c.size(), precision)));
    }
    bool numeric = std::strchr("diufFegxXo", conv) != nullptr;
    if (numeric && flags.find('+') != std::string::npos && body[0] != '-')
      body = "+" + body;
    else if (numeric && flags.find(' ') != std::string::npos && body[0] != '-')
      body = " " + body;
    int64_t len = static_cast<int64_t>(unicode::length(body));
    if (width > len) {
      if (flags.find('-') != std::string::npos)
        body += std::string(width - len, ' ');
      else if (numeric && flags.find('0') != std::string::npos) {
        size_t sign = (body[0] == '-' || body[0] == '+' || body[0] == ' ') ? 1 : 0;
        body.insert(sign, std::string(width - len, '0'));
      } else
        body = std::string(width - len, ' ') + body;
    }
    out += body;
  }
  if (!mapping && next_arg < positional.size())
    runtime_fail("not all arguments converted during string formatting");
  return out;
}

}  // namespace kiln::tmpl::jinja
