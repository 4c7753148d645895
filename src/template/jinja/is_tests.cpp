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

// v % m as Python computes it for the odd / even / divisibleby tests (a float: 0 when it divides, else 1).
int64_t int_mod(const Value& v, int64_t m) {
  if (!v.is_number()) runtime_fail("unsupported operand type(s) for %: '{}' and 'int'", type_name(v));
  if (v.is_float()) return std::fmod(v.as_double(), static_cast<double>(m)) == 0 ? 0 : 1;
  int64_t r = v.as_int() % m;
  return r < 0 ? r + m : r;
}

const std::map<std::string, TestFn, std::less<>>& tests() {
  static const std::map<std::string, TestFn, std::less<>> table = [] {
    std::map<std::string, TestFn, std::less<>> t;
    auto one_arg = [](std::string_view name, CallArgs& args) {
      return bind_args(name, args, {{"other", std::nullopt}})[0];
    };
    // The tests of the value alone: no arguments.
    using Predicate = bool (*)(const Value&);
    static const std::pair<const char*, Predicate> kPredicates[] = {
        {"boolean", [](const Value& v) { return v.is_bool(); }},
        {"callable",
         [](const Value& v) { return v.is_callable() || v.is_undefined() || (v.is_object() && v.object().is_callable()); }},
        {"defined", [](const Value& v) { return !v.is_undefined(); }},
        {"undefined", [](const Value& v) { return v.is_undefined(); }},
        {"none", [](const Value& v) { return v.is_none(); }},
        {"true", [](const Value& v) { return v.is_bool() && v.as_bool(); }},
        {"false", [](const Value& v) { return v.is_bool() && !v.as_bool(); }},
        {"integer", [](const Value& v) { return v.is_int(); }},
        {"float", [](const Value& v) { return v.is_float(); }},
        {"number", [](const Value& v) { return v.is_number(); }},
        {"string", [](const Value& v) { return v.is_string(); }},
        {"mapping", [](const Value& v) { return v.is_dict(); }},
        {"iterable", is_sequence},
        {"sequence", is_sequence},
        {"escaped", [](const Value& v) { return v.is_safe(); }},
        {"lower",
         [](const Value& v) {
           std::string s = py_str(v);
           return unicode::lower(s) == s && unicode::upper(s) != s;
         }},
        {"upper",
         [](const Value& v) {
           std::string s = py_str(v);
           return unicode::upper(s) == s && unicode::lower(s) != s;
         }},
        {"odd", [](const Value& v) { return int_mod(v, 2) == 1; }},
        {"even", [](const Value& v) { return int_mod(v, 2) == 0; }},
        {"filter", [](const Value& v) { return v.is_string() && has_filter(v.str()); }},
        {"test", [](const Value& v) { return v.is_string() && has_test(v.str()); }},
    };
    for (const auto& [name, predicate] : kPredicates)
      t[name] = [name, predicate](Interpreter&, const Value& v, CallArgs& a) {
        bind_args(name, a, {});
        return predicate(v);
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
