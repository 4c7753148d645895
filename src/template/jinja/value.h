// Values of the Jinja interpreter, modelled on the Python objects Jinja2 works with (the reference
// is Python's jinja2 as Hugging Face configures it): undefined and none are distinct, ints and floats
// are distinct (bool counts as a number, as in Python), dicts keep insertion order, lists and dicts
// are shared by reference, strings are UTF-8 and measured in code points.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "core/error.h"

namespace kiln::tmpl::jinja {

class Value;
class Interpreter;
struct List;
struct Dict;
struct Callable;
class Object;

// A failure while rendering (Python's TypeError, UndefinedError, ...): the interpreter adds the
// template position.
class RuntimeError : public kiln::Error {
 public:
  explicit RuntimeError(const std::string& msg) : kiln::Error(msg) {}
};

// raise_exception(msg) from the template: what() is exactly the template's message.
class TemplateRaised : public kiln::Error {
 public:
  explicit TemplateRaised(const std::string& msg) : kiln::Error(msg) {}
};

template <typename... Args>
[[noreturn]] void runtime_fail(fmt::format_string<Args...> f, Args&&... args) {
  throw RuntimeError(fmt::format(f, std::forward<Args>(args)...));
}

enum class Kind : uint8_t { Undefined, None, Bool, Int, Float, String, List, Dict, Callable, Object };

class Value {
 public:
  Value() : v_(Undef{}) {}  // undefined
  Value(std::nullptr_t) : v_(NoneT{}) {}
  Value(bool b) : v_(b) {}
  Value(int i) : v_(int64_t{i}) {}
  Value(int64_t i) : v_(i) {}
  Value(double d) : v_(d) {}
  Value(std::string s, bool safe = false)
      : v_(Str{std::make_shared<const std::string>(std::move(s)), safe}) {}
  Value(const char* s) : Value(std::string(s)) {}
  Value(std::string_view s) : Value(std::string(s)) {}
  Value(std::shared_ptr<List> l) : v_(std::move(l)) {}
  Value(std::shared_ptr<Dict> d) : v_(std::move(d)) {}
  Value(std::shared_ptr<Callable> c) : v_(std::move(c)) {}
  Value(std::shared_ptr<Object> o) : v_(std::move(o)) {}

  static Value undefined(std::string hint) {
    return Value(Undef{std::make_shared<const std::string>(std::move(hint))});
  }
  static Value none() { return Value(nullptr); }
  static Value make_list(std::vector<Value> items = {});
  static Value make_tuple(std::vector<Value> items);
  static Value make_dict();
  // RuntimeError when the JSON nests deeper than kMaxValueNesting.
  static Value from_json(const nlohmann::ordered_json& j, int depth = 0);

  Kind kind() const { return static_cast<Kind>(v_.index()); }
  bool is_undefined() const { return kind() == Kind::Undefined; }
  bool is_none() const { return kind() == Kind::None; }
  bool is_bool() const { return kind() == Kind::Bool; }
  bool is_int() const { return kind() == Kind::Int; }
  bool is_float() const { return kind() == Kind::Float; }
  bool is_number() const { return is_bool() || is_int() || is_float(); }  // Python's numbers.Number
  bool is_integral() const { return is_bool() || is_int(); }              // Python's int (bool included)
  bool is_string() const { return kind() == Kind::String; }
  bool is_list() const { return kind() == Kind::List; }  // list or tuple
  bool is_tuple() const;
  bool is_dict() const { return kind() == Kind::Dict; }
  bool is_callable() const { return kind() == Kind::Callable; }
  bool is_object() const { return kind() == Kind::Object; }
  bool is_safe() const { return is_string() && std::get<Str>(v_).safe; }  // markupsafe.Markup

  bool as_bool() const { return std::get<bool>(v_); }
  int64_t as_int() const;    // Int or Bool
  double as_double() const;  // any number
  const std::string& str() const { return *std::get<Str>(v_).s; }
  List& list() const { return *std::get<std::shared_ptr<List>>(v_); }
  Dict& dict() const { return *std::get<std::shared_ptr<Dict>>(v_); }
  const Callable& callable() const { return *std::get<std::shared_ptr<Callable>>(v_); }
  Object& object() const { return *std::get<std::shared_ptr<Object>>(v_); }
  const std::shared_ptr<Object>& object_ptr() const { return std::get<std::shared_ptr<Object>>(v_); }
  const void* identity() const;  // for `is sameas` on shared values
  const std::string& undefined_hint() const;

  Value with_safe(bool safe) const;  // a string marked (or unmarked) as Markup

 private:
  struct Undef {
    std::shared_ptr<const std::string> hint;
  };
  struct NoneT {};
  struct Str {
    std::shared_ptr<const std::string> s;
    bool safe = false;
  };
  explicit Value(Undef u) : v_(std::move(u)) {}
  std::variant<Undef, NoneT, bool, int64_t, double, Str, std::shared_ptr<List>, std::shared_ptr<Dict>,
               std::shared_ptr<Callable>, std::shared_ptr<Object>>
      v_;
};

// Lists and dicts record how deeply they nest, so that no value gets deep enough to overflow the
// stack when it is printed, compared or destroyed.
constexpr int kMaxValueNesting = 512;

struct List {
  std::vector<Value> items;
  bool is_tuple = false;
  int nesting = 1;
};

// Insertion-ordered mapping with Python key equality (1 == 1.0 == True).
struct Dict {
  std::vector<std::pair<Value, Value>> entries;
  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
  void set(Value key, Value value);
  size_t size() const { return entries.size(); }
  int nesting = 1;

 private:
  std::unordered_map<std::string, size_t> string_index_;
};

// Arguments of a call: positional then keyword, in source order.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

struct Callable {
  std::string name;
  std::function<Value(Interpreter&, CallArgs&)> fn;
};

// Objects with attributes (namespace, loop, cycler, joiner).
class Object {
 public:
  virtual ~Object() = default;
  virtual std::string_view type_name() const = 0;
  // Undefined when there is no such attribute.
  virtual Value get_attr(std::string_view name) = 0;
  virtual bool is_namespace() const { return false; }
  virtual void set_attr(const std::string& name, Value value);
  virtual std::string repr() const;
  virtual bool is_callable() const { return false; }
  virtual Value call(Interpreter& in, CallArgs& args);
};

class Namespace : public Object {
 public:
  std::string_view type_name() const override { return "Namespace"; }
  Value get_attr(std::string_view name) override;
  bool is_namespace() const override { return true; }
  void set_attr(const std::string& name, Value value) override { attrs.set(Value(name), std::move(value)); }
  std::string repr() const override;
  Dict attrs;
};

// Python semantics.
std::string_view type_name(const Value& v);  // Python's type name: 'str', 'NoneType', 'dict', ...
bool truthy(const Value& v);
bool py_equal(const Value& a, const Value& b);
int py_compare(const Value& a, const Value& b);  // <0, 0, >0; RuntimeError when not orderable
std::string py_str(const Value& v);              // str(v)
std::string py_repr(const Value& v);             // repr(v)
std::string py_float_repr(double d);
std::string py_string_repr(std::string_view s);

// json.dumps(v, ensure_ascii, indent, separators, sort_keys) exactly as Python writes it.
struct JsonDumpOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // nullopt: single line
  std::optional<std::pair<std::string, std::string>> separators;
  bool sort_keys = false;
};
std::string json_dumps(const Value& v, const JsonDumpOptions& options);

}  // namespace kiln::tmpl::jinja
