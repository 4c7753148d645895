// The global functions of a render: jinja2's range, dict, namespace, cycler and joiner, plus raise_exception and
// strftime_now, which chat templates expect from transformers.
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

class Cycler : public Object {
 public:
  explicit Cycler(std::vector<Value> items) : items_(std::move(items)) {}
  std::string_view type_name() const override { return "Cycler"; }
  Value get_attr(std::string_view name) override {
    if (name == "current") return items_[pos_];
    if (name == "next" || name == "reset") {
      auto self = self_.lock();
      std::string method(name);
      return make_callable("cycler." + method, [self, method](Interpreter&, CallArgs& args) -> Value {
        bind_args(method, args, {});
        if (method == "reset") {
          self->pos_ = 0;
          return Value::none();
        }
        Value v = self->items_[self->pos_];
        self->pos_ = (self->pos_ + 1) % self->items_.size();
        return v;
      });
    }
    return Value::undefined(fmt::format("'Cycler object' has no attribute '{}'", name));
  }
  std::weak_ptr<Cycler> self_;

 private:
  std::vector<Value> items_;
  size_t pos_ = 0;
};

class Joiner : public Object {
 public:
  explicit Joiner(std::string sep) : sep_(std::move(sep)) {}
  std::string_view type_name() const override { return "Joiner"; }
  Value get_attr(std::string_view name) override {
    return Value::undefined(fmt::format("'Joiner object' has no attribute '{}'", name));
  }
  bool is_callable() const override { return true; }
  Value call(Interpreter&, CallArgs& args) override {
    bind_args("joiner", args, {});
    if (!used_) {
      used_ = true;
      return Value("");
    }
    return Value(sep_);
  }

 private:
  std::string sep_;
  bool used_ = false;
};

}  // namespace

void add_globals(Scope& scope) {
  scope.vars["range"] = make_callable("range", [](Interpreter& in, CallArgs& args) -> Value {
    if (!args.keyword.empty()) runtime_fail("range() takes no keyword arguments");
    const auto& p = args.positional;
    if (p.empty() || p.size() > 3) runtime_fail("range expected 1 to 3 arguments, got {}", p.size());
    int64_t start = 0, stop, step = 1;
    if (p.size() == 1) {
      stop = to_index(p[0], "range() argument");
    } else {
      start = to_index(p[0], "range() argument");
      stop = to_index(p[1], "range() argument");
      if (p.size() == 3) step = to_index(p[2], "range() argument");
    }
    if (step == 0) runtime_fail("range() arg 3 must not be zero");
    int64_t count = step > 0 ? (stop > start ? (stop - start + step - 1) / step : 0)
                             : (start > stop ? (start - stop - step - 1) / -step : 0);
    if (count > in.limits().max_range)
      runtime_fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE ({}).",
                   in.limits().max_range);
    std::vector<Value> out;
    out.reserve(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) out.emplace_back(start + i * step);
    return Value::make_list(std::move(out));
  });
  scope.vars["dict"] = make_callable("dict", [](Interpreter& in, CallArgs& args) -> Value {
    auto d = Value::make_dict();
    if (args.positional.size() > 1)
      runtime_fail("dict expected at most 1 argument, got {}", args.positional.size());
    if (!args.positional.empty()) {
      const Value& src = args.positional[0];
      if (src.is_dict()) {
        for (const auto& [k, v] : src.dict().entries) d.dict().set(k, v);
      } else {
        for (auto& pair : in.iterate(src)) {
          auto kv = in.iterate(pair);
          if (kv.size() != 2)
            runtime_fail("dictionary update sequence element has length {}; 2 is required", kv.size());
          d.dict().set(kv[0], kv[1]);
        }
      }
    }
    for (auto& [k, v] : args.keyword) d.dict().set(Value(k), v);
    return d;
  });
  scope.vars["namespace"] = make_callable("namespace", [](Interpreter& in, CallArgs& args) -> Value {
    auto ns = std::make_shared<Namespace>();
    in.track_namespace(ns);
    if (args.positional.size() > 1) runtime_fail("namespace expected at most 1 positional argument");
    if (!args.positional.empty()) {
      const Value& src = args.positional[0];
      if (src.is_dict()) {
        for (const auto& [k, v] : src.dict().entries) ns->attrs.set(k, v);
      } else {
        for (auto& pair : in.iterate(src)) {
          auto kv = in.iterate(pair);
          if (kv.size() != 2) runtime_fail("namespace: expected (key, value) pairs");
          ns->attrs.set(kv[0], kv[1]);
        }
      }
    }
    for (auto& [k, v] : args.keyword) ns->attrs.set(Value(k), v);
    return Value(std::static_pointer_cast<Object>(ns));
  });
  scope.vars["cycler"] = make_callable("cycler", [](Interpreter&, CallArgs& args) -> Value {
    if (args.positional.empty()) runtime_fail("at least one item has to be provided");
    auto c = std::make_shared<Cycler>(args.positional);
    c->self_ = c;
    return Value(std::static_pointer_cast<Object>(c));
  });
  scope.vars["joiner"] = make_callable("joiner", [](Interpreter&, CallArgs& args) -> Value {
    auto a = bind_args("joiner", args, {{"sep", Value(", ")}});
    return Value(std::static_pointer_cast<Object>(std::make_shared<Joiner>(py_str(a[0]))));
  });
  // Hugging Face's additions.
  scope.vars["raise_exception"] = make_callable("raise_exception", [](Interpreter&, CallArgs& args) -> Value {
    auto a = bind_args("raise_exception", args, {{"message", std::nullopt}});
    throw TemplateRaised(py_str(a[0]));
  });
  scope.vars["strftime_now"] = make_callable("strftime_now", [](Interpreter&, CallArgs& args) -> Value {
    auto a = bind_args("strftime_now", args, {{"format", std::nullopt}});
    std::string f = require_str(a[0], "format");
    std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    std::string buf(256 + f.size() * 4, '\0');
    size_t n = std::strftime(buf.data(), buf.size(), f.c_str(), &local);
    if (n == 0 && !f.empty()) return Value("");
    buf.resize(n);
    return Value(buf);
  });
}

}  // namespace kiln::tmpl::jinja
