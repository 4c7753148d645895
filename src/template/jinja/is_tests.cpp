// The tests (x is name(args)): one table, each entry following jinja2/tests.py.
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

using TestFn = std::function<bool(Interpreter&, const Value&, CallArgs&)>;

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

}  // namespace

bool has_test(const std::string& name) {
  return tests().count(name) > 0;
}

bool call_test(Interpreter& in, const std::string& name, const Value& input, CallArgs& args) {
  auto it = tests().find(name);
  if (it == tests().end()) runtime_fail("No test named '{}'", name);
  return it->second(in, input, args);
}

}  // namespace kiln::tmpl::jinja
