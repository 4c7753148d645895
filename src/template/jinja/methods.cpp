// The methods of str, list, tuple and dict a template may call (s.strip(), d.items(), "{}".format(x)), as bound
// callables (bound_method); the sandbox refuses the ones that modify lists and dicts, as jinja2's
// ImmutableSandboxedEnvironment does.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <map>
#include <set>

#include "template/jinja/builtins.h"
#include "template/jinja/unicode.h"

namespace kiln::tmpl::jinja {

namespace {

Value str_format(Interpreter& in, const std::string& fmt_str, const CallArgs& args);

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

}  // namespace

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

}  // namespace kiln::tmpl::jinja
