// Internal: the tree-walking evaluator behind jinja::Template, and the builtins it uses.
#pragma once
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "template/jinja/ast.h"
#include "template/jinja/template.h"
#include "template/jinja/value.h"

namespace kiln::tmpl::jinja {

struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;

  explicit Scope(std::shared_ptr<Scope> p = nullptr) : parent(std::move(p)) {}
  const Value* lookup(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent.get()) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};

// A runtime error that already carries its template position.
class PositionedError : public kiln::Error {
 public:
  explicit PositionedError(const std::string& msg) : kiln::Error(msg) {}
};

enum class Flow { Normal, Break, Continue };

class Interpreter {
 public:
  Interpreter(const RenderLimits& limits, std::shared_ptr<Scope> root);
  // Breaks the reference cycles a render can build (a macro stored in the scope it closes over, a
  // namespace holding itself) so that everything the render allocated is freed.
  ~Interpreter();
  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;

  void track_namespace(const std::shared_ptr<Namespace>& ns) { namespaces_.push_back(ns); }

  void render(const Body& body, std::string& out);

  Value eval(const Expr& e);
  Value call(const Value& callee, CallArgs& args);
  Value getattr(const Value& obj, const std::string& name);
  Value getitem(const Value& obj, const Value& key);
  std::vector<Value> iterate(const Value& v);
  Value apply_filter(const std::string& name, const Value& input, CallArgs& args);
  bool apply_test(const std::string& name, const Value& input, CallArgs& args);
  // Attribute path lookup as jinja's make_attrgetter ("a.b.0").
  Value get_attribute_path(const Value& item, const Value& attribute);

  const RenderLimits& limits() const { return limits_; }
  void count_step();

  // Runs a macro-like body (macro, caller, {% generation %}) in a new scope and returns its output.
  std::string capture(const Body& body, std::shared_ptr<Scope> scope);

 private:
  friend struct MacroCall;
  const RenderLimits& limits_;
  std::shared_ptr<Scope> scope_;
  std::string* out_ = nullptr;
  int depth_ = 0;
  uint64_t steps_ = 0;
  std::vector<std::weak_ptr<Scope>> closure_scopes_;
  std::vector<std::weak_ptr<Namespace>> namespaces_;

  Value eval_inner(const Expr& e);
  Value eval_filter(const Expr& f, const Value* block_input);
  Value eval_call(const Expr& e, const Value* caller);
  void collect_args(const Expr& e, CallArgs& args);
  Flow exec_body(const Body& body);
  Flow exec(const Stmt& s);
  Flow exec_for(const Stmt& s);
  void assign(const Expr& target, const Value& value);
  Value make_macro(const Stmt& s, bool is_caller);
  void write(std::string_view s);
  [[noreturn]] void fail_at(SourcePos pos, const std::string& msg);
  friend class LoopObject;
};

// Builtins (builtins.cpp).
bool has_filter(const std::string& name);
bool has_test(const std::string& name);
Value call_filter(Interpreter& in, const std::string& name, const Value& input, CallArgs& args);
bool call_test(Interpreter& in, const std::string& name, const Value& input, CallArgs& args);
// Method of a str/list/dict value as Python exposes it, or nullopt when the type has no such attribute.
std::optional<Value> bound_method(const Value& self, const std::string& name);
void add_globals(Scope& scope);

// Python operators.
Value py_add(const Value& a, const Value& b);
Value py_arith(BinOp op, const Value& a, const Value& b, const RenderLimits& limits);
bool py_contains(const Value& container, const Value& item);
Value py_slice(const Value& obj, const Value& start, const Value& stop, const Value& step);
[[noreturn]] void fail_undefined(const Value& undefined);
std::string html_escape(std::string_view s);
std::string py_percent_format(const std::string& fmt, const Value& args);

}  // namespace kiln::tmpl::jinja
