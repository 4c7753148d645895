// Python's operators on values (+, *, %, in, slices) and string escaping, with the errors CPython gives.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <map>
#include <set>

#include "template/jinja/builtins.h"
#include "template/jinja/unicode.h"

namespace kiln::tmpl::jinja {

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
