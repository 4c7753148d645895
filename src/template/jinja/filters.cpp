// The filters (x | name(args)): one table, each entry following jinja2/filters.py.
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

using FilterFn = std::function<Value(Interpreter&, const Value&, CallArgs&)>;

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

}  // namespace

bool has_filter(const std::string& name) {
  return filters().count(name) > 0;
}

Value call_filter(Interpreter& in, const std::string& name, const Value& input, CallArgs& args) {
  auto it = filters().find(name);
  if (it == filters().end()) runtime_fail("No filter named '{}'", name);
  return it->second(in, input, args);
}

}  // namespace kiln::tmpl::jinja
