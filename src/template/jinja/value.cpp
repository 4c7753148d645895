#include "template/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>

#include "template/jinja/unicode.h"

namespace kiln::tmpl::jinja {

namespace {

int nesting_of(const Value& v) {
  if (v.is_list()) return v.list().nesting;
  if (v.is_dict()) return v.dict().nesting;
  return 0;
}

void check_nesting(int nesting) {
  if (nesting > kMaxValueNesting) runtime_fail("value nested deeper than {} levels", kMaxValueNesting);
}

// Counts recursion depth in repr/str, which can loop through namespaces that contain themselves.
struct ReprDepth {
  static inline thread_local int depth = 0;
  ReprDepth() {
    if (++depth > kMaxValueNesting) {
      depth = 0;
      runtime_fail("value refers to itself or nests deeper than {} levels", kMaxValueNesting);
    }
  }
  ~ReprDepth() {
    if (depth > 0) --depth;
  }
};

}  // namespace

Value Value::make_list(std::vector<Value> items) {
  auto l = std::make_shared<List>();
  for (const auto& item : items) l->nesting = std::max(l->nesting, 1 + nesting_of(item));
  check_nesting(l->nesting);
  l->items = std::move(items);
  return Value(std::move(l));
}

Value Value::make_tuple(std::vector<Value> items) {
  Value v = make_list(std::move(items));
  v.list().is_tuple = true;
  return v;
}

Value Value::make_dict() {
  return Value(std::make_shared<Dict>());
}

Value Value::from_json(const nlohmann::ordered_json& j, int depth) {
  if (depth > kMaxValueNesting) runtime_fail("input JSON nests deeper than {} levels", kMaxValueNesting);
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      auto u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<double>(u));
      return Value(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e, depth + 1));
      return Value::make_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      auto d = std::make_shared<Dict>();
      for (const auto& [k, v] : j.items()) d->set(Value(k), from_json(v, depth + 1));
      return Value(std::move(d));
    }
    default:
      runtime_fail("unsupported JSON value (binary) in template input");
  }
}

bool Value::is_tuple() const {
  return is_list() && list().is_tuple;
}

int64_t Value::as_int() const {
  if (is_bool()) return as_bool() ? 1 : 0;
  return std::get<int64_t>(v_);
}

double Value::as_double() const {
  if (is_float()) return std::get<double>(v_);
  return static_cast<double>(as_int());
}

const void* Value::identity() const {
  switch (kind()) {
    case Kind::List:
      return std::get<std::shared_ptr<List>>(v_).get();
    case Kind::Dict:
      return std::get<std::shared_ptr<Dict>>(v_).get();
    case Kind::Callable:
      return std::get<std::shared_ptr<Callable>>(v_).get();
    case Kind::Object:
      return std::get<std::shared_ptr<Object>>(v_).get();
    case Kind::String:
      return std::get<Str>(v_).s.get();
    default:
      return nullptr;
  }
}

const std::string& Value::undefined_hint() const {
  static const std::string empty;
  const auto& u = std::get<Undef>(v_);
  return u.hint ? *u.hint : empty;
}

Value Value::with_safe(bool safe) const {
  Value v = *this;
  std::get<Str>(v.v_).safe = safe;
  return v;
}

// ---- Dict

const Value* Dict::find(std::string_view key) const {
  auto it = string_index_.find(std::string(key));
  return it == string_index_.end() ? nullptr : &entries[it->second].second;
}

const Value* Dict::find(const Value& key) const {
  if (key.is_string()) return find(std::string_view(key.str()));
  for (const auto& [k, v] : entries)
    if (!k.is_string() && py_equal(k, key)) return &v;
  return nullptr;
}

void Dict::set(Value key, Value value) {
  nesting = std::max({nesting, 1 + nesting_of(key), 1 + nesting_of(value)});
  check_nesting(nesting);
  if (key.is_string()) {
    auto [it, inserted] = string_index_.try_emplace(key.str(), entries.size());
    if (inserted)
      entries.emplace_back(std::move(key), std::move(value));
    else
      entries[it->second].second = std::move(value);
    return;
  }
  for (auto& [k, v] : entries) {
    if (!k.is_string() && py_equal(k, key)) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(std::move(key), std::move(value));
}

// ---- Objects

void Object::set_attr(const std::string& name, Value) {
  runtime_fail("cannot assign attribute '{}' on a {} object", name, type_name());
}

Value Object::call(Interpreter&, CallArgs&) {
  runtime_fail("'{}' object is not callable", type_name());
}

std::string Object::repr() const {
  return fmt::format("<{} object>", type_name());
}

Value Namespace::get_attr(std::string_view name) {
  if (const Value* v = attrs.find(name)) return *v;
  return Value::undefined(fmt::format("'{}' object has no attribute '{}'", type_name(), name));
}

std::string Namespace::repr() const {
  ReprDepth guard;
  std::string s = "<Namespace {";
  bool first = true;
  for (const auto& [k, v] : attrs.entries) {
    if (!first) s += ", ";
    first = false;
    s += py_repr(k) + ": " + py_repr(v);
  }
  return s + "}>";
}

// ---- Python semantics

std::string_view type_name(const Value& v) {
  switch (v.kind()) {
    case Kind::Undefined:
      return "Undefined";
    case Kind::None:
      return "NoneType";
    case Kind::Bool:
      return "bool";
    case Kind::Int:
      return "int";
    case Kind::Float:
      return "float";
    case Kind::String:
      return v.is_safe() ? "Markup" : "str";
    case Kind::List:
      return v.is_tuple() ? "tuple" : "list";
    case Kind::Dict:
      return "dict";
    case Kind::Callable:
      return "function";
    case Kind::Object:
      return v.object().type_name();
  }
  return "object";
}

bool truthy(const Value& v) {
  switch (v.kind()) {
    case Kind::Undefined:
      return false;
    case Kind::None:
      return false;
    case Kind::Bool:
      return v.as_bool();
    case Kind::Int:
      return v.as_int() != 0;
    case Kind::Float:
      return v.as_double() != 0.0;
    case Kind::String:
      return !v.str().empty();
    case Kind::List:
      return !v.list().items.empty();
    case Kind::Dict:
      return v.dict().size() != 0;
    default:
      return true;
  }
}

bool py_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Kind::Undefined:
    case Kind::None:
      return true;
    case Kind::String:
      return a.str() == b.str();
    case Kind::List: {
      if (a.is_tuple() != b.is_tuple()) return false;
      const auto& x = a.list().items;
      const auto& y = b.list().items;
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!py_equal(x[i], y[i])) return false;
      return true;
    }
    case Kind::Dict: {
      const auto& x = a.dict();
      const auto& y = b.dict();
      if (x.size() != y.size()) return false;
      for (const auto& [k, v] : x.entries) {
        const Value* other = y.find(k);
        if (!other || !py_equal(v, *other)) return false;
      }
      return true;
    }
    default:
      return a.identity() == b.identity();
  }
}

int py_compare(const Value& a, const Value& b) {
  if (a.is_undefined() || b.is_undefined()) runtime_fail("cannot compare an undefined value");
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      double x = a.as_double(), y = b.as_double();
      return x < y ? -1 : x > y ? 1 : 0;
    }
    int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {
    int c = a.str().compare(b.str());  // UTF-8 byte order == code point order
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.is_list() && b.is_list() && a.is_tuple() == b.is_tuple()) {
    const auto& x = a.list().items;
    const auto& y = b.list().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (py_equal(x[i], y[i])) continue;
      return py_compare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  runtime_fail("'<' not supported between instances of '{}' and '{}'", type_name(a), type_name(b));
}

std::string py_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  // Shortest round-trip digits, then Python's repr layout: fixed for 1e-4 <= |d| < 1e16, else exponent.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  bool negative = sci[0] == '-';
  if (negative) sci.erase(0, 1);
  auto epos = sci.find('e');
  std::string mant = sci.substr(0, epos);
  int exp10 = std::stoi(sci.substr(epos + 1));
  std::string digits;
  for (char c : mant)
    if (c != '.') digits.push_back(c);
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  int decpt = exp10 + 1;  // value = 0.DIGITS * 10^decpt
  std::string out = negative ? "-" : "";
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0." + std::string(-decpt, '0') + digits;
    } else if (static_cast<size_t>(decpt) >= digits.size()) {
      out += digits + std::string(decpt - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, decpt) + "." + digits.substr(decpt);
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    int e = decpt - 1;
    out += fmt::format("e{}{:02d}", e < 0 ? '-' : '+', e < 0 ? -e : e);
  }
  return out;
}

std::string py_string_repr(std::string_view s) {
  bool has_single = s.find('\'') != std::string_view::npos;
  bool has_double = s.find('"') != std::string_view::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : unicode::decode(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (!unicode::is_printable(c)) {
      if (c < 0x100)
        out += fmt::format("\\x{:02x}", static_cast<unsigned>(c));
      else if (c < 0x10000)
        out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
      else
        out += fmt::format("\\U{:08x}", static_cast<unsigned>(c));
    } else {
      unicode::append_utf8(out, c);
    }
  }
  out.push_back(quote);
  return out;
}

std::string py_repr(const Value& v) {
  ReprDepth guard;
  switch (v.kind()) {
    case Kind::Undefined:
      return "Undefined";
    case Kind::String:
      return py_string_repr(v.str());
    case Kind::List: {
      const auto& items = v.list().items;
      std::string s = v.is_tuple() ? "(" : "[";
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) s += ", ";
        s += py_repr(items[i]);
      }
      if (v.is_tuple() && items.size() == 1) s += ",";
      return s + (v.is_tuple() ? ")" : "]");
    }
    case Kind::Dict: {
      std::string s = "{";
      bool first = true;
      for (const auto& [k, val] : v.dict().entries) {
        if (!first) s += ", ";
        first = false;
        s += py_repr(k) + ": " + py_repr(val);
      }
      return s + "}";
    }
    default:
      return py_str(v);
  }
}

std::string py_str(const Value& v) {
  switch (v.kind()) {
    case Kind::Undefined:
      return "";
    case Kind::None:
      return "None";
    case Kind::Bool:
      return v.as_bool() ? "True" : "False";
    case Kind::Int:
      return std::to_string(v.as_int());
    case Kind::Float:
      return py_float_repr(v.as_double());
    case Kind::String:
      return v.str();
    case Kind::List:
    case Kind::Dict:
      return py_repr(v);
    case Kind::Callable:
      return fmt::format("<function {}>", v.callable().name);
    case Kind::Object:
      return v.object().repr();
  }
  return "";
}

// ---- json.dumps

namespace {

void json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  out.push_back('"');
  auto escape_simple = [&](char32_t c) -> bool {
    switch (c) {
      case '"':
        out += "\\\"";
        return true;
      case '\\':
        out += "\\\\";
        return true;
      case '\n':
        out += "\\n";
        return true;
      case '\r':
        out += "\\r";
        return true;
      case '\t':
        out += "\\t";
        return true;
      case '\b':
        out += "\\b";
        return true;
      case '\f':
        out += "\\f";
        return true;
      default:
        return false;
    }
  };
  if (!ensure_ascii) {
    for (char ch : s) {
      auto c = static_cast<unsigned char>(ch);
      if (escape_simple(c)) continue;
      if (c < 0x20)
        out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
      else
        out.push_back(ch);
    }
  } else {
    for (char32_t c : unicode::decode(s)) {
      if (escape_simple(c)) continue;
      if (c >= 0x20 && c < 0x7F) {
        out.push_back(static_cast<char>(c));
      } else if (c < 0x10000) {
        out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
      } else {
        char32_t v = c - 0x10000;
        out += fmt::format("\\u{:04x}\\u{:04x}", static_cast<unsigned>(0xD800 | (v >> 10)),
                           static_cast<unsigned>(0xDC00 | (v & 0x3FF)));
      }
    }
  }
  out.push_back('"');
}

std::string json_float(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  return py_float_repr(d);
}

struct JsonWriter {
  const JsonDumpOptions& opt;
  std::string item_sep;
  std::string key_sep;
  std::string out;
  int depth = 0;

  void newline_indent(int level) {
    out.push_back('\n');
    for (int i = 0; i < level; ++i) out += *opt.indent;
  }

  std::string key_string(const Value& k) {
    switch (k.kind()) {
      case Kind::String:
        return k.str();
      case Kind::Bool:
        return k.as_bool() ? "true" : "false";
      case Kind::None:
        return "null";
      case Kind::Int:
        return std::to_string(k.as_int());
      case Kind::Float:
        return json_float(k.as_double());
      default:
        runtime_fail("keys must be str, int, float, bool or None, not {}", type_name(k));
    }
  }

  void write(const Value& v) {
    if (++depth > 512) runtime_fail("tojson: value nested too deeply");
    switch (v.kind()) {
      case Kind::None:
        out += "null";
        break;
      case Kind::Bool:
        out += v.as_bool() ? "true" : "false";
        break;
      case Kind::Int:
        out += std::to_string(v.as_int());
        break;
      case Kind::Float:
        out += json_float(v.as_double());
        break;
      case Kind::String:
        json_string(out, v.str(), opt.ensure_ascii);
        break;
      case Kind::List: {
        const auto& items = v.list().items;
        if (items.empty()) {
          out += "[]";
          break;
        }
        out.push_back('[');
        for (size_t i = 0; i < items.size(); ++i) {
          if (i) out += item_sep;
          if (opt.indent) newline_indent(depth);
          write(items[i]);
        }
        if (opt.indent) newline_indent(depth - 1);
        out.push_back(']');
        break;
      }
      case Kind::Dict: {
        const auto& d = v.dict();
        if (d.size() == 0) {
          out += "{}";
          break;
        }
        std::vector<std::pair<std::string, const Value*>> entries;
        entries.reserve(d.size());
        for (const auto& [k, val] : d.entries) entries.emplace_back(key_string(k), &val);
        if (opt.sort_keys)
          std::stable_sort(entries.begin(), entries.end(),
                           [](const auto& a, const auto& b) { return a.first < b.first; });
        out.push_back('{');
        for (size_t i = 0; i < entries.size(); ++i) {
          if (i) out += item_sep;
          if (opt.indent) newline_indent(depth);
          json_string(out, entries[i].first, opt.ensure_ascii);
          out += key_sep;
          write(*entries[i].second);
        }
        if (opt.indent) newline_indent(depth - 1);
        out.push_back('}');
        break;
      }
      default:
        runtime_fail("Object of type {} is not JSON serializable", type_name(v));
    }
    --depth;
  }
};

}  // namespace

std::string json_dumps(const Value& v, const JsonDumpOptions& options) {
  JsonWriter w{options, options.indent ? "," : ", ", ": ", {}, 0};
  if (options.separators) {
    w.item_sep = options.separators->first;
    w.key_sep = options.separators->second;
  }
  w.write(v);
  return std::move(w.out);
}

}  // namespace kiln::tmpl::jinja
