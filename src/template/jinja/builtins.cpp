// The helpers every builtin shares (builtins.h): Python's argument binding, type checks, callables from lambdas.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <map>
#include <set>

#include "template/jinja/builtins.h"
#include "template/jinja/unicode.h"

namespace kiln::tmpl::jinja {

// ---- argument binding: positional then keyword, with defaults; nullopt default = required.

std::vector<Value> bind_args(std::string_view fname, const CallArgs& args, std::initializer_list<Param> params,
                             size_t skip_positional) {
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

}  // namespace kiln::tmpl::jinja
