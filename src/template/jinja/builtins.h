// Internal: what the builtins of the interpreter share. The builtins themselves are split by concern:
// filters.cpp (x | f), is_tests.cpp (x is t), methods.cpp (str / list / dict methods, str.format), globals.cpp
// (range, dict, namespace, ...), operators.cpp (+, *, %, in, slices); each follows the Python function it stands
// for (jinja2/filters.py, jinja2/tests.py, CPython's builtins). Shared here: Python's argument binding and type
// checks, callables made from lambdas (builtins.cpp), and Python str semantics over UTF-8 (py_str.cpp: code
// points, not bytes).
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "template/jinja/interpreter.h"

namespace kiln::tmpl::jinja {

// ---- arguments (builtins.cpp)

// One parameter of a builtin: its name and default (nullopt: required).
struct Param {
  std::string_view name;
  std::optional<Value> def;
};
// Binds positional then keyword arguments to params (after skipping skip_positional positional ones), with
// defaults, as Python does; a template error names fname and the argument otherwise.
std::vector<Value> bind_args(std::string_view fname, const CallArgs& args, std::initializer_list<Param> params,
                             size_t skip_positional = 0);
int64_t to_index(const Value& v, std::string_view what);       // an integer, or a template error naming `what`
std::string require_str(const Value& v, std::string_view what);  // a str, or a template error naming `what`
std::u32string cps(std::string_view s);                          // the code points of UTF-8 text
Value make_callable(std::string name, std::function<Value(Interpreter&, CallArgs&)> fn);
std::vector<Value> strings_to_values(const std::vector<std::string>& v);

// ---- Python str semantics (py_str.cpp)

std::string py_strip(const std::string& s, const Value& chars, bool left, bool right);
std::vector<std::string> py_split(const std::string& s, const Value& sep, int64_t maxsplit);
std::vector<std::string> py_rsplit(const std::string& s, const Value& sep, int64_t maxsplit);
bool is_line_break(char32_t c);
std::vector<std::string> py_splitlines(const std::string& s, bool keepends);
std::string py_replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count);
std::string py_capitalize(const std::string& s);
bool is_cased(char32_t c);
std::string py_str_title(const std::string& s);  // str.title()
std::string jinja_title(const std::string& s);   // the title filter (words split on whitespace and brackets)
// [begin, end) of the slice [start:end] of n items, with Python's handling of negative and None bounds.
std::pair<size_t, size_t> slice_bounds(size_t n, const Value& start, const Value& end);
int64_t py_find(const std::string& s, const std::string& sub, const Value& start, const Value& end, bool reverse);
// s padded with fill to width code points; align -1 left, 0 centre, 1 right.
std::string pad(const std::string& s, int64_t width, const std::string& fill, int align);
bool py_parse_int(std::string text, int base, int64_t& out);  // int(text, base); false when Python raises
bool py_parse_float(std::string text, double& out);           // float(text); false when Python raises

}  // namespace kiln::tmpl::jinja
