#include "template/jinja/interpreter.h"

#include "template/jinja/unicode.h"

namespace kiln::tmpl::jinja {

namespace {

// Restores the interpreter's scope / output buffer when a block ends (also on errors).
template <typename T>
struct Restore {
  T& ref;
  T saved;
  explicit Restore(T& r) : ref(r), saved(r) {}
  ~Restore() { ref = std::move(saved); }
};

}  // namespace

// `loop` inside a for body (jinja2.runtime.LoopContext).
class LoopObject : public Object {
 public:
  LoopObject(std::shared_ptr<const std::vector<Value>> items, int depth0)
      : items_(std::move(items)), depth0_(depth0) {}
  std::string_view type_name() const override { return "LoopContext"; }
  bool is_callable() const override { return true; }

  Value get_attr(std::string_view name) override {
    const int64_t n = static_cast<int64_t>(items_->size());
    const int64_t i = static_cast<int64_t>(index0);
    if (name == "index0") return Value(i);
    if (name == "index") return Value(i + 1);
    if (name == "revindex") return Value(n - i);
    if (name == "revindex0") return Value(n - i - 1);
    if (name == "first") return Value(i == 0);
    if (name == "last") return Value(i == n - 1);
    if (name == "length") return Value(n);
    if (name == "depth") return Value(depth0_ + 1);
    if (name == "depth0") return Value(depth0_);
    if (name == "previtem") return i > 0 ? (*items_)[i - 1] : Value::undefined("there is no previous item");
    if (name == "nextitem") return i + 1 < n ? (*items_)[i + 1] : Value::undefined("there is no next item");
    if (name == "cycle" || name == "changed") {
      auto self = std::static_pointer_cast<LoopObject>(shared_from_this_hack());
      std::string method(name);
      auto c = std::make_shared<Callable>();
      c->name = "loop." + method;
      c->fn = [self, method](Interpreter&, CallArgs& args) -> Value {
        if (method == "cycle") {
          if (args.positional.empty()) runtime_fail("no items for cycling given");
          return args.positional[self->index0 % args.positional.size()];
        }
        Value current = Value::make_list(args.positional);
        if (self->has_changed_value_ && py_equal(self->last_changed_, current)) return Value(false);
        self->last_changed_ = current;
        self->has_changed_value_ = true;
        return Value(true);
      };
      return Value(std::move(c));
    }
    return Value::undefined(fmt::format("'LoopContext object' has no attribute '{}'", name));
  }

  Value call(Interpreter& in, CallArgs& args) override {
    if (!recurse_) runtime_fail("the loop must have the 'recursive' marker to be called recursively");
    if (args.positional.size() != 1 || !args.keyword.empty())
      runtime_fail("loop() takes exactly one argument");
    return recurse_(in, args.positional[0], depth0_ + 1);
  }

  size_t index0 = 0;
  std::weak_ptr<LoopObject> self_;
  std::function<Value(Interpreter&, const Value&, int)> recurse_;

 private:
  std::shared_ptr<Object> shared_from_this_hack() { return self_.lock(); }
  std::shared_ptr<const std::vector<Value>> items_;
  int depth0_;
  Value last_changed_;
  bool has_changed_value_ = false;
};

Interpreter::Interpreter(const RenderLimits& limits, std::shared_ptr<Scope> root)
    : limits_(limits), scope_(std::move(root)) {}

Interpreter::~Interpreter() {
  for (auto& weak : closure_scopes_)
    if (auto scope = weak.lock()) scope->vars.clear();
  for (auto& weak : namespaces_)
    if (auto ns = weak.lock()) ns->attrs = Dict();
  if (scope_) scope_->vars.clear();
}

void Interpreter::render(const Body& body, std::string& out) {
  out_ = &out;
  Flow f = exec_body(body);
  if (f != Flow::Normal)
    throw PositionedError("chat template error: 'break' or 'continue' outside of a loop");
}

void Interpreter::fail_at(SourcePos pos, const std::string& msg) {
  throw PositionedError(
      fmt::format("chat template error at line {}, column {}: {}", pos.line, pos.column, msg));
}

void Interpreter::count_step() {
  if (++steps_ > limits_.max_steps)
    runtime_fail("template ran for more than {} steps (endless loop?)", limits_.max_steps);
}

void Interpreter::write(std::string_view s) {
  if (out_->size() + s.size() > limits_.max_output_bytes)
    runtime_fail("template output exceeds {} bytes", limits_.max_output_bytes);
  out_->append(s);
}

std::string Interpreter::capture(const Body& body, std::shared_ptr<Scope> scope) {
  std::string buffer;
  Restore<std::string*> keep_out(out_);
  Restore<std::shared_ptr<Scope>> keep_scope(scope_);
  out_ = &buffer;
  scope_ = std::move(scope);
  Flow f = exec_body(body);
  if (f != Flow::Normal) runtime_fail("'break' or 'continue' outside of a loop");
  return buffer;
}

// ---- statements

Flow Interpreter::exec_body(const Body& body) {
  for (const auto& s : body) {
    Flow f = exec(*s);
    if (f != Flow::Normal) return f;
  }
  return Flow::Normal;
}

Flow Interpreter::exec(const Stmt& s) {
  try {
    count_step();
    switch (s.kind) {
      case StmtKind::Text:
        write(s.text);
        return Flow::Normal;
      case StmtKind::Output: {
        Value v = eval(*s.expr);
        write(py_str(v));
        return Flow::Normal;
      }
      case StmtKind::If:
        if (truthy(eval(*s.expr))) return exec_body(s.body);
        return exec_body(s.else_body);
      case StmtKind::For:
        return exec_for(s);
      case StmtKind::Assign:
        assign(*s.target, eval(*s.expr));
        return Flow::Normal;
      case StmtKind::AssignBlock: {
        Value v(capture(s.body, std::make_shared<Scope>(scope_)));
        if (s.expr) v = eval_filter(*s.expr, &v);
        assign(*s.target, v);
        return Flow::Normal;
      }
      case StmtKind::Macro:
        scope_->vars[s.name] = make_macro(s, false);
        return Flow::Normal;
      case StmtKind::CallBlock: {
        Value caller = make_macro(s, true);
        write(py_str(eval_call(*s.expr, &caller)));
        return Flow::Normal;
      }
      case StmtKind::FilterBlock: {
        Value body(capture(s.body, std::make_shared<Scope>(scope_)));
        write(py_str(eval_filter(*s.expr, &body)));
        return Flow::Normal;
      }
      case StmtKind::With: {
        std::vector<Value> values;
        for (const auto& v : s.values) values.push_back(eval(*v));
        Restore<std::shared_ptr<Scope>> keep_scope(scope_);
        scope_ = std::make_shared<Scope>(scope_);
        for (size_t i = 0; i < s.targets.size(); ++i) assign(*s.targets[i], values[i]);
        return exec_body(s.body);
      }
      case StmtKind::Scope:
        write(capture(s.body, std::make_shared<Scope>(scope_)));
        return Flow::Normal;
      case StmtKind::Block: {
        Restore<std::shared_ptr<Scope>> keep_scope(scope_);
        scope_ = std::make_shared<Scope>(scope_);
        return exec_body(s.body);
      }
      case StmtKind::Break:
        return Flow::Break;
      case StmtKind::Continue:
        return Flow::Continue;
    }
  } catch (const RuntimeError& e) {
    fail_at(s.pos, e.what());
  }
  return Flow::Normal;
}

Flow Interpreter::exec_for(const Stmt& s) {
  Value iterable = eval(*s.expr);
  std::vector<Value> items;
  try {
    items = iterate(iterable);
  } catch (const RuntimeError& e) {
    fail_at(s.expr->pos, e.what());
  }
  const std::shared_ptr<Scope> outer = scope_;

  // Runs the loop over `items` writing to out_; returns Break/Continue flows of an else body.
  std::function<Flow(std::vector<Value>, int)> run = [&, outer](std::vector<Value> all, int depth0) -> Flow {
    Restore<std::shared_ptr<Scope>> keep_scope(scope_);
    std::vector<Value> kept;
    if (s.test) {
      for (auto& item : all) {
        scope_ = std::make_shared<Scope>(outer);
        assign(*s.target, item);
        if (truthy(eval(*s.test))) kept.push_back(std::move(item));
      }
    } else {
      kept = std::move(all);
    }
    if (kept.empty()) {
      scope_ = std::make_shared<Scope>(outer);
      return exec_body(s.else_body);
    }
    auto shared_items = std::make_shared<const std::vector<Value>>(std::move(kept));
    auto loop = std::make_shared<LoopObject>(shared_items, depth0);
    loop->self_ = loop;
    // The recursion hook points into this frame: cleared when the loop ends, even if `loop` escaped.
    struct ClearHook {
      LoopObject& l;
      ~ClearHook() { l.recurse_ = nullptr; }
    } clear_hook{*loop};
    if (s.recursive) {
      loop->recurse_ = [&run](Interpreter& in, const Value& children, int depth) -> Value {
        if (++in.depth_ > in.limits_.max_call_depth)
          runtime_fail("template recursion deeper than {}", in.limits_.max_call_depth);
        std::string buffer;
        {
          Restore<std::string*> keep_out(in.out_);
          in.out_ = &buffer;
          run(in.iterate(children), depth);
        }
        --in.depth_;
        return Value(std::move(buffer));
      };
    }
    Value loop_value(std::static_pointer_cast<Object>(loop));
    for (size_t i = 0; i < shared_items->size(); ++i) {
      count_step();
      loop->index0 = i;
      scope_ = std::make_shared<Scope>(outer);
      assign(*s.target, (*shared_items)[i]);
      scope_->vars["loop"] = loop_value;
      Flow f = exec_body(s.body);
      if (f == Flow::Break) break;
    }
    return Flow::Normal;
  };
  if (++depth_ > limits_.max_call_depth)
    runtime_fail("template recursion deeper than {}", limits_.max_call_depth);
  Flow f = run(std::move(items), 0);
  --depth_;
  return f;
}

void Interpreter::assign(const Expr& target, const Value& value) {
  switch (target.kind) {
    case ExprKind::Name:
      scope_->vars[target.name] = value;
      return;
    case ExprKind::NSRef: {
      const Value* ns = scope_->lookup(target.name);
      if (!ns || !ns->is_object() || !ns->object().is_namespace())
        fail_at(target.pos, "cannot assign attribute on non-namespace object");
      ns->object().set_attr(target.attr, value);
      return;
    }
    case ExprKind::Tuple: {
      std::vector<Value> items;
      try {
        items = iterate(value);
      } catch (const RuntimeError& e) {
        fail_at(target.pos, std::string("cannot unpack: ") + e.what());
      }
      if (items.size() != target.items.size())
        fail_at(target.pos, items.size() > target.items.size()
                                ? fmt::format("too many values to unpack (expected {})", target.items.size())
                                : fmt::format("not enough values to unpack (expected {}, got {})",
                                              target.items.size(), items.size()));
      for (size_t i = 0; i < items.size(); ++i) assign(*target.items[i], items[i]);
      return;
    }
    default:
      fail_at(target.pos, "cannot assign to this expression");
  }
}

// Macros are closures over the scope they are defined in (Python closures: late binding).
Value Interpreter::make_macro(const Stmt& s, bool is_caller) {
  auto closure = scope_;
  closure_scopes_.push_back(closure);
  const Stmt* m = &s;
  auto c = std::make_shared<Callable>();
  c->name = is_caller ? "caller" : s.name;
  c->fn = [m, closure, is_caller](Interpreter& in, CallArgs& args) -> Value {
    const std::string& name = is_caller ? std::string("caller") : m->name;
    if (++in.depth_ > in.limits_.max_call_depth)
      runtime_fail("template recursion deeper than {}", in.limits_.max_call_depth);
    struct DepthGuard {
      int& d;
      ~DepthGuard() { --d; }
    } guard{in.depth_};
    in.count_step();
    auto scope = std::make_shared<Scope>(closure);
    const size_t n_params = m->params.size();
    std::vector<bool> bound(n_params, false);
    std::vector<Value> extra_positional;
    for (size_t i = 0; i < args.positional.size(); ++i) {
      if (i < n_params) {
        scope->vars[m->params[i]] = args.positional[i];
        bound[i] = true;
      } else {
        extra_positional.push_back(args.positional[i]);
      }
    }
    auto kwargs = Value::make_dict();
    Value caller = Value::undefined("No caller defined");
    for (auto& [k, v] : args.keyword) {
      bool matched = false;
      for (size_t i = 0; i < n_params; ++i) {
        if (m->params[i] == k) {
          if (bound[i]) runtime_fail("macro '{}' got multiple values for argument '{}'", name, k);
          scope->vars[k] = v;
          bound[i] = true;
          matched = true;
        }
      }
      if (matched) continue;
      if (k == "caller" && m->uses_caller) {
        caller = v;
        continue;
      }
      if (m->uses_kwargs) {
        kwargs.dict().set(Value(k), v);
        continue;
      }
      if (k == "caller") runtime_fail("macro '{}' was invoked with a caller it does not use", name);
      runtime_fail("macro '{}' takes no keyword argument '{}'", name, k);
    }
    if (!extra_positional.empty() && !m->uses_varargs)
      runtime_fail("macro '{}' takes not more than {} argument(s)", name, n_params);
    Restore<std::shared_ptr<Scope>> keep_scope(in.scope_);
    in.scope_ = scope;
    const size_t first_default = n_params - m->defaults.size();
    for (size_t i = 0; i < n_params; ++i) {
      if (bound[i]) continue;
      if (i >= first_default)
        scope->vars[m->params[i]] = in.eval(*m->defaults[i - first_default]);
      else
        scope->vars[m->params[i]] =
            Value::undefined(fmt::format("parameter '{}' was not provided", m->params[i]));
    }
    if (m->uses_caller) scope->vars["caller"] = caller;
    if (m->uses_varargs) scope->vars["varargs"] = Value::make_tuple(std::move(extra_positional));
    if (m->uses_kwargs) scope->vars["kwargs"] = kwargs;
    return Value(in.capture(m->body, scope));
  };
  return Value(std::move(c));
}

// ---- expressions

Value Interpreter::eval(const Expr& e) {
  try {
    return eval_inner(e);
  } catch (const RuntimeError& err) {
    fail_at(e.pos, err.what());
  }
}

void Interpreter::collect_args(const Expr& e, CallArgs& args) {
  for (const auto& a : e.items) args.positional.push_back(eval(*a));
  if (e.dyn_args) {
    for (auto& v : iterate(eval(*e.dyn_args))) args.positional.push_back(std::move(v));
  }
  for (const auto& [k, v] : e.kwargs) args.keyword.emplace_back(k, eval(*v));
  if (e.dyn_kwargs) {
    Value d = eval(*e.dyn_kwargs);
    if (!d.is_dict()) runtime_fail("argument after ** must be a mapping, not {}", type_name(d));
    for (const auto& [k, v] : d.dict().entries) {
      if (!k.is_string()) runtime_fail("keywords must be strings");
      args.keyword.emplace_back(k.str(), v);
    }
  }
}

Value Interpreter::eval_call(const Expr& e, const Value* caller) {
  Value callee = eval(*e.a);
  CallArgs args;
  collect_args(e, args);
  if (caller) args.keyword.emplace_back("caller", *caller);
  return call(callee, args);
}

Value Interpreter::call(const Value& callee, CallArgs& args) {
  switch (callee.kind()) {
    case Kind::Callable:
      return callee.callable().fn(*this, args);
    case Kind::Object:
      if (callee.object().is_callable()) return callee.object().call(*this, args);
      break;
    case Kind::Undefined:
      fail_undefined(callee);
    default:
      break;
  }
  runtime_fail("'{}' object is not callable", type_name(callee));
}

Value Interpreter::eval_filter(const Expr& f, const Value* block_input) {
  Value input;
  if (!f.a)
    input = *block_input;
  else if (f.a->kind == ExprKind::Filter && block_input)
    input = eval_filter(*f.a, block_input);
  else
    input = eval(*f.a);
  CallArgs args;
  try {
    collect_args(f, args);
    return apply_filter(f.name, input, args);
  } catch (const RuntimeError& err) {
    fail_at(f.pos, err.what());
  }
}

Value Interpreter::apply_filter(const std::string& name, const Value& input, CallArgs& args) {
  return call_filter(*this, name, input, args);
}

bool Interpreter::apply_test(const std::string& name, const Value& input, CallArgs& args) {
  return call_test(*this, name, input, args);
}

Value Interpreter::eval_inner(const Expr& e) {
  switch (e.kind) {
    case ExprKind::Const:
      return e.constant;
    case ExprKind::Name: {
      if (const Value* v = scope_->lookup(e.name)) return *v;
      return Value::undefined(fmt::format("'{}' is undefined", e.name));
    }
    case ExprKind::NSRef:
      runtime_fail("namespace references can only be assigned to");
    case ExprKind::Getattr:
      return getattr(eval(*e.a), e.attr);
    case ExprKind::Getitem: {
      Value obj = eval(*e.a);
      if (e.b->kind == ExprKind::Slice) {
        const Expr& sl = *e.b;
        Value start = sl.a ? eval(*sl.a) : Value::none();
        Value stop = sl.b ? eval(*sl.b) : Value::none();
        Value step = sl.c ? eval(*sl.c) : Value::none();
        return py_slice(obj, start, stop, step);
      }
      return getitem(obj, eval(*e.b));
    }
    case ExprKind::Slice:
      runtime_fail("slice outside of a subscript");
    case ExprKind::Call:
      return eval_call(e, nullptr);
    case ExprKind::Filter:
      return eval_filter(e, nullptr);
    case ExprKind::Test: {
      Value input = eval(*e.a);
      CallArgs args;
      collect_args(e, args);
      return Value(apply_test(e.name, input, args));
    }
    case ExprKind::Neg:
    case ExprKind::Pos: {
      Value v = eval(*e.a);
      if (v.is_undefined()) fail_undefined(v);
      if (v.is_float()) return Value(e.kind == ExprKind::Neg ? -v.as_double() : v.as_double());
      if (v.is_integral()) {
        int64_t i = v.as_int();
        if (e.kind == ExprKind::Neg && i == INT64_MIN) runtime_fail("integer overflow");
        return Value(e.kind == ExprKind::Neg ? -i : i);
      }
      runtime_fail("bad operand type for unary {}: '{}'", e.kind == ExprKind::Neg ? "-" : "+", type_name(v));
    }
    case ExprKind::Not:
      return Value(!truthy(eval(*e.a)));
    case ExprKind::BinOp: {
      Value a = eval(*e.a);
      Value b = eval(*e.b);
      return py_arith(e.op, a, b, limits_);
    }
    case ExprKind::And: {
      Value a = eval(*e.a);
      return truthy(a) ? eval(*e.b) : a;
    }
    case ExprKind::Or: {
      Value a = eval(*e.a);
      return truthy(a) ? a : eval(*e.b);
    }
    case ExprKind::Concat: {
      std::string s;
      for (const auto& item : e.items) s += py_str(eval(*item));
      if (s.size() > limits_.max_output_bytes)
        runtime_fail("string exceeds {} bytes", limits_.max_output_bytes);
      return Value(std::move(s));
    }
    case ExprKind::Compare: {
      Value left = eval(*e.a);
      for (const auto& [op, rhs] : e.comparisons) {
        Value right = eval(*rhs);
        bool ok = false;
        switch (op) {
          case CmpOp::Eq:
            ok = py_equal(left, right);
            break;
          case CmpOp::Ne:
            ok = !py_equal(left, right);
            break;
          case CmpOp::Lt:
            ok = py_compare(left, right) < 0;
            break;
          case CmpOp::LtEq:
            ok = py_compare(left, right) <= 0;
            break;
          case CmpOp::Gt:
            ok = py_compare(left, right) > 0;
            break;
          case CmpOp::GtEq:
            ok = py_compare(left, right) >= 0;
            break;
          case CmpOp::In:
            ok = py_contains(right, left);
            break;
          case CmpOp::NotIn:
            ok = !py_contains(right, left);
            break;
        }
        if (!ok) return Value(false);
        left = std::move(right);
      }
      return Value(true);
    }
    case ExprKind::CondExpr: {
      if (truthy(eval(*e.b))) return eval(*e.a);
      if (e.c) return eval(*e.c);
      return Value::undefined(fmt::format(
          "the inline if-expression on line {} evaluated to false and no else section was defined.",
          e.pos.line));
    }
    case ExprKind::List:
    case ExprKind::Tuple: {
      std::vector<Value> items;
      items.reserve(e.items.size());
      for (const auto& item : e.items) items.push_back(eval(*item));
      return e.kind == ExprKind::List ? Value::make_list(std::move(items))
                                      : Value::make_tuple(std::move(items));
    }
    case ExprKind::Dict: {
      Value d = Value::make_dict();
      for (size_t i = 0; i < e.items.size(); ++i) {
        Value k = eval(*e.items[i]);
        if (k.is_list() && !k.is_tuple()) runtime_fail("unhashable type: 'list'");
        if (k.is_dict()) runtime_fail("unhashable type: 'dict'");
        d.dict().set(std::move(k), eval(*e.values[i]));
      }
      return d;
    }
  }
  runtime_fail("unknown expression");
}

// ---- attribute and item access (jinja2.sandbox.SandboxedEnvironment.getattr / getitem)

static std::string object_description(const Value& v) {
  switch (v.kind()) {
    case Kind::None:
      return "None";
    case Kind::Object:
      return std::string(v.object().type_name()) + " object";
    default:
      return std::string(type_name(v)) + " object";
  }
}

Value Interpreter::getattr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) fail_undefined(obj);
  if (obj.is_object()) return obj.object().get_attr(name);
  if (auto m = bound_method(obj, name)) return *m;
  if (obj.is_dict()) {
    if (const Value* v = obj.dict().find(std::string_view(name))) return *v;
  }
  return Value::undefined(fmt::format("'{}' has no attribute '{}'", object_description(obj), name));
}

Value Interpreter::getitem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) fail_undefined(obj);
  switch (obj.kind()) {
    case Kind::Dict: {
      if (const Value* v = obj.dict().find(key)) return *v;
      break;
    }
    case Kind::List: {
      if (key.is_integral()) {
        const auto& items = obj.list().items;
        int64_t i = key.as_int();
        int64_t n = static_cast<int64_t>(items.size());
        if (i < 0) i += n;
        if (i >= 0 && i < n) return items[static_cast<size_t>(i)];
      }
      break;
    }
    case Kind::String: {
      if (key.is_integral()) {
        const std::string& s = obj.str();
        auto offsets = unicode::code_point_offsets(s);
        int64_t n = static_cast<int64_t>(offsets.size()) - 1;
        int64_t i = key.as_int();
        if (i < 0) i += n;
        if (i >= 0 && i < n) return Value(s.substr(offsets[i], offsets[i + 1] - offsets[i]));
      }
      break;
    }
    case Kind::Object:
      if (key.is_string()) return obj.object().get_attr(key.str());
      break;
    default:
      break;
  }
  if (key.is_string()) {
    if (auto m = bound_method(obj, key.str())) return *m;
    if (obj.is_dict())
      return Value::undefined(fmt::format("'{}' has no attribute '{}'", object_description(obj), key.str()));
  }
  return Value::undefined(fmt::format("'{}' has no item {}", object_description(obj), py_repr(key)));
}

std::vector<Value> Interpreter::iterate(const Value& v) {
  switch (v.kind()) {
    case Kind::Undefined:
      return {};
    case Kind::List:
      return v.list().items;
    case Kind::Dict: {
      std::vector<Value> keys;
      keys.reserve(v.dict().size());
      for (const auto& [k, val] : v.dict().entries) keys.push_back(k);
      return keys;
    }
    case Kind::String: {
      std::vector<Value> chars;
      const std::string& s = v.str();
      auto offsets = unicode::code_point_offsets(s);
      chars.reserve(offsets.size());
      for (size_t i = 0; i + 1 < offsets.size(); ++i)
        chars.emplace_back(s.substr(offsets[i], offsets[i + 1] - offsets[i]));
      return chars;
    }
    default:
      runtime_fail("'{}' object is not iterable", type_name(v));
  }
}

Value Interpreter::get_attribute_path(const Value& item, const Value& attribute) {
  if (!attribute.is_string()) return getitem(item, attribute);
  Value cur = item;
  const std::string& path = attribute.str();
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool numeric = !part.empty() && part.size() <= 18 && std::all_of(part.begin(), part.end(), [](char c) {
      return std::isdigit(static_cast<unsigned char>(c));
    });
    cur = numeric ? getitem(cur, Value(static_cast<int64_t>(std::stoll(part)))) : getitem(cur, Value(part));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return cur;
}

// ---- Template

Template::Template(std::string_view source, const LexerOptions& options) {
  body_ = parse(tokenize(source, options));
  // Jinja resolves filters and tests when it compiles: an unknown one fails the whole template, except
  // inside an if statement or an inline if (a "soft" frame), where it fails only when evaluated.
  std::function<void(const Expr&, bool)> check_expr = [&](const Expr& e, bool soft) {
    if (e.kind == ExprKind::CondExpr) soft = true;
    if (!soft && e.kind == ExprKind::Filter && !has_filter(e.name))
      kiln::fail("chat template error at line {}, column {}: no filter named '{}'", e.pos.line, e.pos.column,
                 e.name);
    if (!soft && e.kind == ExprKind::Test && !has_test(e.name))
      kiln::fail("chat template error at line {}, column {}: no test named '{}'", e.pos.line, e.pos.column,
                 e.name);
    for (const Expr* child : {e.a.get(), e.b.get(), e.c.get(), e.dyn_args.get(), e.dyn_kwargs.get()})
      if (child) check_expr(*child, soft);
    for (const auto& x : e.items) check_expr(*x, soft);
    for (const auto& x : e.values) check_expr(*x, soft);
    for (const auto& [k, x] : e.kwargs) check_expr(*x, soft);
    for (const auto& [op, x] : e.comparisons) check_expr(*x, soft);
  };
  std::function<void(const Body&, bool)> check_body = [&](const Body& body, bool soft) {
    for (const auto& s : body) {
      // An if makes its test and branches soft; other blocks open a new frame, which is not soft.
      bool inner_soft = s->kind == StmtKind::If
                            ? true
                            : (s->kind == StmtKind::Output || s->kind == StmtKind::Assign) && soft;
      for (const Expr* x : {s->expr.get(), s->target.get()})
        if (x) check_expr(*x, s->kind == StmtKind::If ? true : soft);
      if (s->test) check_expr(*s->test, false);
      for (const auto& x : s->defaults) check_expr(*x, false);
      for (const auto& x : s->values) check_expr(*x, soft);
      check_body(s->body, inner_soft);
      check_body(s->else_body, s->kind == StmtKind::If ? true : inner_soft);
    }
  };
  check_body(body_, false);
}

std::string Template::render(const std::unordered_map<std::string, Value>& vars,
                             const RenderLimits& limits) const {
  auto globals = std::make_shared<Scope>();
  add_globals(*globals);
  for (const auto& [k, v] : vars) globals->vars[k] = v;
  auto root = std::make_shared<Scope>(globals);
  Interpreter interp(limits, root);
  std::string out;
  try {
    interp.render(body_, out);
  } catch (const RuntimeError& e) {
    throw PositionedError(std::string("chat template error: ") + e.what());
  }
  return out;
}

}  // namespace kiln::tmpl::jinja
