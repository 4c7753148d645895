// Recursive-descent parser following jinja2/parser.py (same precedence and statement forms).
#include <set>

#include "template/jinja/ast.h"

namespace kiln::tmpl::jinja {

namespace {

class Parser {
 public:
  explicit Parser(const std::vector<Token>& tokens) : toks_(tokens) {}

  Body parse_template() {
    Body body = subparse({});
    if (cur().type != Tok::Eof) fail(cur(), fmt::format("unexpected {}", describe_token(cur())));
    return body;
  }

 private:
  const std::vector<Token>& toks_;
  size_t i_ = 0;
  std::vector<Stmt*> macro_stack_;  // macros / call blocks being parsed (for caller/varargs/kwargs use)
  std::vector<std::vector<std::string>> end_token_stack_;
  int depth_ = 0;  // nesting of expressions / statements being parsed

  // Bounds recursion so that a pathological template fails cleanly instead of exhausting the stack.
  struct DepthGuard {
    Parser& p;
    explicit DepthGuard(Parser& parser) : p(parser) {
      if (++p.depth_ > kMaxNesting)
        p.fail(p.cur(), fmt::format("template nests deeper than {} levels", kMaxNesting));
    }
    ~DepthGuard() { --p.depth_; }
  };
  static constexpr int kMaxNesting = 256;

  // Left-associative chains (a + b + c, a.b.c, x|f|g, elif ...) nest the tree one level per link:
  // they count against the same limit while the chain is being parsed.
  struct ChainGuard {
    Parser& p;
    int links = 0;
    explicit ChainGuard(Parser& parser) : p(parser) {}
    void link() {
      ++links;
      if (++p.depth_ > kMaxNesting)
        p.fail(p.cur(), fmt::format("template nests deeper than {} levels", kMaxNesting));
    }
    ~ChainGuard() { p.depth_ -= links; }
  };

  const Token& cur() const { return toks_[i_]; }
  const Token& look() const { return toks_[std::min(i_ + 1, toks_.size() - 1)]; }
  const Token& next() {
    const Token& t = toks_[i_];
    if (i_ + 1 < toks_.size()) ++i_;
    return t;
  }
  bool is_name(const Token& t, std::string_view v) const { return t.type == Tok::Name && t.text == v; }
  bool skip_if(Tok t) {
    if (cur().type != t) return false;
    next();
    return true;
  }
  bool skip_if_name(std::string_view v) {
    if (!is_name(cur(), v)) return false;
    next();
    return true;
  }

  static std::string describe_token(const Token& t) {
    if (t.type == Tok::Name) return "'" + t.text + "'";
    return std::string(describe(t.type));
  }

  [[noreturn]] void fail(const Token& at, const std::string& msg) const {
    kiln::fail("chat template syntax error at line {}, column {}: {}", at.pos.line, at.pos.column, msg);
  }

  const Token& expect(Tok t) {
    if (cur().type != t) {
      if (cur().type == Tok::Eof)
        fail(cur(), fmt::format("unexpected end of template, expected {}", describe(t)));
      fail(cur(), fmt::format("expected token {}, got {}", describe(t), describe_token(cur())));
    }
    return next();
  }
  const Token& expect_name(std::string_view v) {
    if (!is_name(cur(), v)) fail(cur(), fmt::format("expected '{}', got {}", v, describe_token(cur())));
    return next();
  }

  // ---- statements

  Body subparse(const std::vector<std::string>& end_tokens) {
    Body body;
    if (!end_tokens.empty()) end_token_stack_.push_back(end_tokens);
    while (cur().type != Tok::Eof) {
      const Token& t = cur();
      if (t.type == Tok::Data) {
        auto s = std::make_unique<Stmt>(StmtKind::Text, t.pos);
        s->text = t.text;
        body.push_back(std::move(s));
        next();
      } else if (t.type == Tok::VariableBegin) {
        next();
        auto s = std::make_unique<Stmt>(StmtKind::Output, t.pos);
        s->expr = parse_tuple(false, true, {}, false);
        expect(Tok::VariableEnd);
        body.push_back(std::move(s));
      } else if (t.type == Tok::BlockBegin) {
        next();
        if (!end_tokens.empty() && cur().type == Tok::Name) {
          for (const auto& e : end_tokens) {
            if (cur().text == e) {
              end_token_stack_.pop_back();
              return body;
            }
          }
        }
        body.push_back(parse_statement());
        expect(Tok::BlockEnd);
      } else {
        fail(t, fmt::format("unexpected {}", describe_token(t)));
      }
    }
    if (!end_tokens.empty()) end_token_stack_.pop_back();
    return body;
  }

  Body parse_statements(const std::vector<std::string>& end_tokens, bool drop_needle) {
    skip_if(Tok::Colon);
    expect(Tok::BlockEnd);
    Body body = subparse(end_tokens);
    if (cur().type == Tok::Eof) {
      std::string expected;
      for (const auto& e : end_tokens) expected += (expected.empty() ? "'" : " or '") + e + "'";
      fail(cur(), "unexpected end of template, expected " + expected);
    }
    if (drop_needle) next();
    return body;
  }

  StmtPtr parse_statement() {
    DepthGuard guard(*this);
    const Token& t = cur();
    if (t.type != Tok::Name) fail(t, "tag name expected");
    const std::string& w = t.text;
    if (w == "for") return parse_for();
    if (w == "if") return parse_if();
    if (w == "set") return parse_set();
    if (w == "macro") return parse_macro();
    if (w == "call") return parse_call_block();
    if (w == "filter") return parse_filter_block();
    if (w == "with") return parse_with();
    if (w == "print") return parse_print();
    if (w == "break" || w == "continue") {
      auto s = std::make_unique<Stmt>(w == "break" ? StmtKind::Break : StmtKind::Continue, t.pos);
      next();
      return s;
    }
    if (w == "generation" || w == "autoescape" || w == "block") {
      auto s = std::make_unique<Stmt>(w == "generation" ? StmtKind::Scope : StmtKind::Block, t.pos);
      std::string end = "end" + w;
      next();
      if (w == "autoescape") parse_expression(true);
      if (w == "block") {
        expect(Tok::Name);
        while (is_name(cur(), "scoped") || is_name(cur(), "required")) next();
      }
      s->body = parse_statements({end}, true);
      if (w == "block" && cur().type == Tok::Name) next();  // {% endblock name %}
      return s;
    }
    if (w == "extends" || w == "include" || w == "import" || w == "from")
      fail(t, fmt::format("'{}' is not supported in chat templates (they are single files)", w));
    for (const auto& ends : end_token_stack_) {
      for (const auto& e : ends) {
        if (e == w) fail(t, fmt::format("unexpected '{}'", w));
      }
    }
    if (w.rfind("end", 0) == 0) fail(t, fmt::format("unexpected '{}': no block to close", w));
    fail(t, fmt::format("encountered unknown tag '{}'", w));
  }

  StmtPtr parse_for() {
    auto s = std::make_unique<Stmt>(StmtKind::For, expect_name("for").pos);
    s->target = parse_assign_target(true, false, {"in"}, false);
    expect_name("in");
    s->expr = parse_tuple(false, false, {"recursive"}, false);
    if (skip_if_name("if")) s->test = parse_expression(true);
    s->recursive = skip_if_name("recursive");
    s->body = parse_statements({"endfor", "else"}, false);
    if (next().text != "endfor") s->else_body = parse_statements({"endfor"}, true);
    return s;
  }

  StmtPtr parse_if() {
    auto s = std::make_unique<Stmt>(StmtKind::If, expect_name("if").pos);
    Stmt* node = s.get();
    ChainGuard chain(*this);
    while (true) {
      chain.link();
      node->expr = parse_tuple(false, false, {}, false);
      node->body = parse_statements({"elif", "else", "endif"}, false);
      const Token& t = next();
      if (t.text == "elif") {
        auto elif = std::make_unique<Stmt>(StmtKind::If, cur().pos);
        Stmt* raw = elif.get();
        node->else_body.push_back(std::move(elif));
        node = raw;
        continue;
      }
      if (t.text == "else") node->else_body = parse_statements({"endif"}, true);
      break;
    }
    return s;
  }

  StmtPtr parse_set() {
    SourcePos pos = next().pos;
    ExprPtr target = parse_assign_target(true, false, {}, true);
    if (skip_if(Tok::Assign)) {
      auto s = std::make_unique<Stmt>(StmtKind::Assign, pos);
      s->target = std::move(target);
      s->expr = parse_tuple(false, true, {}, false);
      return s;
    }
    auto s = std::make_unique<Stmt>(StmtKind::AssignBlock, pos);
    s->target = std::move(target);
    if (cur().type == Tok::Pipe) s->expr = parse_filter(nullptr, false);
    s->body = parse_statements({"endset"}, true);
    return s;
  }

  void parse_signature(Stmt& s) {
    expect(Tok::LParen);
    while (cur().type != Tok::RParen) {
      if (!s.params.empty()) expect(Tok::Comma);
      const Token& name = expect(Tok::Name);
      if (skip_if(Tok::Assign)) {
        s.defaults.push_back(parse_expression(true));
      } else if (!s.defaults.empty()) {
        fail(name, "non-default argument follows default argument");
      }
      s.params.push_back(name.text);
    }
    expect(Tok::RParen);
  }

  StmtPtr parse_macro() {
    auto s = std::make_unique<Stmt>(StmtKind::Macro, next().pos);
    s->name = expect(Tok::Name).text;
    parse_signature(*s);
    macro_stack_.push_back(s.get());
    s->body = parse_statements({"endmacro"}, true);
    macro_stack_.pop_back();
    return s;
  }

  StmtPtr parse_call_block() {
    auto s = std::make_unique<Stmt>(StmtKind::CallBlock, next().pos);
    if (cur().type == Tok::LParen) parse_signature(*s);
    s->expr = parse_expression(true);
    if (s->expr->kind != ExprKind::Call) fail(cur(), "expected call");
    macro_stack_.push_back(s.get());
    s->body = parse_statements({"endcall"}, true);
    macro_stack_.pop_back();
    return s;
  }

  StmtPtr parse_filter_block() {
    auto s = std::make_unique<Stmt>(StmtKind::FilterBlock, next().pos);
    s->expr = parse_filter(nullptr, true);
    s->body = parse_statements({"endfilter"}, true);
    return s;
  }

  StmtPtr parse_with() {
    auto s = std::make_unique<Stmt>(StmtKind::With, next().pos);
    while (cur().type != Tok::BlockEnd) {
      if (!s->targets.empty()) expect(Tok::Comma);
      s->targets.push_back(parse_assign_target(true, false, {}, false));
      expect(Tok::Assign);
      s->values.push_back(parse_expression(true));
    }
    s->body = parse_statements({"endwith"}, true);
    return s;
  }

  StmtPtr parse_print() {
    auto s = std::make_unique<Stmt>(StmtKind::Output, next().pos);
    auto tuple = std::make_unique<Expr>(ExprKind::Concat, s->pos);
    while (cur().type != Tok::BlockEnd) {
      if (!tuple->items.empty()) expect(Tok::Comma);
      tuple->items.push_back(parse_expression(true));
    }
    s->expr = std::move(tuple);
    return s;
  }

  ExprPtr parse_assign_target(bool with_tuple, bool name_only, const std::vector<std::string>& extra_end,
                              bool with_namespace) {
    ExprPtr target;
    const Token& start = cur();
    if (name_only) {
      target = std::make_unique<Expr>(ExprKind::Name, start.pos);
      target->name = expect(Tok::Name).text;
      return target;
    }
    if (with_tuple)
      target = parse_tuple(true, true, extra_end, false, with_namespace);
    else
      target = parse_primary(with_namespace);
    auto assignable = [](const Expr& e) { return e.kind == ExprKind::Name || e.kind == ExprKind::NSRef; };
    bool ok = assignable(*target);
    if (target->kind == ExprKind::Tuple) {
      ok = true;
      for (const auto& item : target->items) ok = ok && item->kind == ExprKind::Name;
    }
    if (!ok) fail(start, "can't assign to this expression");
    if (target->kind == ExprKind::Name && (target->name == "true" || target->name == "false" ||
                                           target->name == "none" || target->name == "True"))
      fail(start, "can't assign to a constant");
    return target;
  }

  // ---- expressions

  bool is_tuple_end(const std::vector<std::string>& extra_end) const {
    Tok t = cur().type;
    if (t == Tok::VariableEnd || t == Tok::BlockEnd || t == Tok::RParen) return true;
    for (const auto& e : extra_end)
      if (is_name(cur(), e)) return true;
    return false;
  }

  ExprPtr parse_tuple(bool simplified, bool with_condexpr, const std::vector<std::string>& extra_end,
                      bool explicit_parentheses, bool with_namespace = false) {
    SourcePos pos = cur().pos;
    std::vector<ExprPtr> args;
    bool is_tuple = false;
    while (true) {
      if (!args.empty()) expect(Tok::Comma);
      if (is_tuple_end(extra_end)) break;
      args.push_back(simplified ? parse_primary(with_namespace) : parse_expression(with_condexpr));
      if (cur().type == Tok::Comma)
        is_tuple = true;
      else
        break;
    }
    if (!is_tuple) {
      if (!args.empty()) return std::move(args[0]);
      if (!explicit_parentheses)
        fail(cur(), fmt::format("expected an expression, got {}", describe_token(cur())));
    }
    auto t = std::make_unique<Expr>(ExprKind::Tuple, pos);
    t->items = std::move(args);
    return t;
  }

  ExprPtr parse_expression(bool with_condexpr) { return with_condexpr ? parse_condexpr() : parse_or(); }

  ExprPtr parse_condexpr() {
    SourcePos pos = cur().pos;
    ExprPtr expr1 = parse_or();
    ChainGuard chain(*this);
    while (skip_if_name("if")) {
      chain.link();
      auto e = std::make_unique<Expr>(ExprKind::CondExpr, pos);
      e->b = parse_or();
      e->a = std::move(expr1);
      if (skip_if_name("else")) e->c = parse_condexpr();
      expr1 = std::move(e);
      pos = cur().pos;
    }
    return expr1;
  }

  ExprPtr binary(ExprKind k, SourcePos pos, ExprPtr a, ExprPtr b) {
    auto e = std::make_unique<Expr>(k, pos);
    e->a = std::move(a);
    e->b = std::move(b);
    return e;
  }

  ExprPtr parse_or() {
    SourcePos pos = cur().pos;
    ExprPtr left = parse_and();
    ChainGuard chain(*this);
    while (skip_if_name("or")) {
      chain.link();
      left = binary(ExprKind::Or, pos, std::move(left), parse_and());
      pos = cur().pos;
    }
    return left;
  }

  ExprPtr parse_and() {
    SourcePos pos = cur().pos;
    ExprPtr left = parse_not();
    ChainGuard chain(*this);
    while (skip_if_name("and")) {
      chain.link();
      left = binary(ExprKind::And, pos, std::move(left), parse_not());
      pos = cur().pos;
    }
    return left;
  }

  ExprPtr parse_not() {
    DepthGuard guard(*this);
    if (is_name(cur(), "not")) {
      auto e = std::make_unique<Expr>(ExprKind::Not, next().pos);
      e->a = parse_not();
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    SourcePos pos = cur().pos;
    ExprPtr expr = parse_math1();
    std::vector<std::pair<CmpOp, ExprPtr>> ops;
    while (true) {
      Tok t = cur().type;
      CmpOp op;
      if (t == Tok::Eq)
        op = CmpOp::Eq;
      else if (t == Tok::Ne)
        op = CmpOp::Ne;
      else if (t == Tok::Lt)
        op = CmpOp::Lt;
      else if (t == Tok::LtEq)
        op = CmpOp::LtEq;
      else if (t == Tok::Gt)
        op = CmpOp::Gt;
      else if (t == Tok::GtEq)
        op = CmpOp::GtEq;
      else if (is_name(cur(), "in"))
        op = CmpOp::In;
      else if (is_name(cur(), "not") && is_name(look(), "in")) {
        next();
        op = CmpOp::NotIn;
      } else
        break;
      next();
      ops.emplace_back(op, parse_math1());
    }
    if (ops.empty()) return expr;
    auto e = std::make_unique<Expr>(ExprKind::Compare, pos);
    e->a = std::move(expr);
    e->comparisons = std::move(ops);
    return e;
  }

  ExprPtr binop(BinOp op, SourcePos pos, ExprPtr a, ExprPtr b) {
    auto e = binary(ExprKind::BinOp, pos, std::move(a), std::move(b));
    e->op = op;
    return e;
  }

  ExprPtr parse_math1() {
    SourcePos pos = cur().pos;
    ExprPtr left = parse_concat();
    ChainGuard chain(*this);
    while (cur().type == Tok::Add || cur().type == Tok::Sub) {
      chain.link();
      BinOp op = next().type == Tok::Add ? BinOp::Add : BinOp::Sub;
      left = binop(op, pos, std::move(left), parse_concat());
      pos = cur().pos;
    }
    return left;
  }

  ExprPtr parse_concat() {
    SourcePos pos = cur().pos;
    std::vector<ExprPtr> args;
    args.push_back(parse_math2());
    while (skip_if(Tok::Tilde)) args.push_back(parse_math2());
    if (args.size() == 1) return std::move(args[0]);
    auto e = std::make_unique<Expr>(ExprKind::Concat, pos);
    e->items = std::move(args);
    return e;
  }

  ExprPtr parse_math2() {
    SourcePos pos = cur().pos;
    ExprPtr left = parse_pow();
    ChainGuard chain(*this);
    while (true) {
      chain.link();
      Tok t = cur().type;
      BinOp op;
      if (t == Tok::Mul)
        op = BinOp::Mul;
      else if (t == Tok::Div)
        op = BinOp::Div;
      else if (t == Tok::FloorDiv)
        op = BinOp::FloorDiv;
      else if (t == Tok::Mod)
        op = BinOp::Mod;
      else
        break;
      next();
      left = binop(op, pos, std::move(left), parse_pow());
      pos = cur().pos;
    }
    return left;
  }

  ExprPtr parse_pow() {
    SourcePos pos = cur().pos;
    ExprPtr left = parse_unary(true);
    ChainGuard chain(*this);
    while (skip_if(Tok::Pow)) {
      chain.link();
      left = binop(BinOp::Pow, pos, std::move(left), parse_unary(true));
      pos = cur().pos;
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    Tok t = cur().type;
    ExprPtr node;
    if (t == Tok::Sub || t == Tok::Add) {
      node = std::make_unique<Expr>(t == Tok::Sub ? ExprKind::Neg : ExprKind::Pos, next().pos);
      node->a = parse_unary(false);
    } else {
      node = parse_primary(false);
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary(bool with_namespace) {
    const Token& t = cur();
    ExprPtr node;
    if (t.type == Tok::Name) {
      next();
      if (t.text == "true" || t.text == "false" || t.text == "True" || t.text == "False") {
        node = std::make_unique<Expr>(ExprKind::Const, t.pos);
        node->constant = Value(t.text == "true" || t.text == "True");
      } else if (t.text == "none" || t.text == "None") {
        node = std::make_unique<Expr>(ExprKind::Const, t.pos);
        node->constant = Value::none();
      } else if (with_namespace && cur().type == Tok::Dot) {
        next();
        node = std::make_unique<Expr>(ExprKind::NSRef, t.pos);
        node->name = t.text;
        node->attr = expect(Tok::Name).text;
      } else {
        node = std::make_unique<Expr>(ExprKind::Name, t.pos);
        node->name = t.text;
        note_name_use(t.text);
      }
    } else if (t.type == Tok::String) {
      std::string buf;
      SourcePos pos = t.pos;
      while (cur().type == Tok::String) buf += next().text;
      node = std::make_unique<Expr>(ExprKind::Const, pos);
      node->constant = Value(std::move(buf));
    } else if (t.type == Tok::Integer || t.type == Tok::Float) {
      next();
      node = std::make_unique<Expr>(ExprKind::Const, t.pos);
      node->constant = t.type == Tok::Integer ? Value(t.int_value) : Value(t.float_value);
    } else if (t.type == Tok::LParen) {
      next();
      node = parse_tuple(false, true, {}, true);
      expect(Tok::RParen);
    } else if (t.type == Tok::LBracket) {
      node = std::make_unique<Expr>(ExprKind::List, next().pos);
      while (cur().type != Tok::RBracket) {
        if (!node->items.empty()) expect(Tok::Comma);
        if (cur().type == Tok::RBracket) break;
        node->items.push_back(parse_expression(true));
      }
      expect(Tok::RBracket);
    } else if (t.type == Tok::LBrace) {
      node = std::make_unique<Expr>(ExprKind::Dict, next().pos);
      while (cur().type != Tok::RBrace) {
        if (!node->items.empty()) expect(Tok::Comma);
        if (cur().type == Tok::RBrace) break;
        node->items.push_back(parse_expression(true));
        expect(Tok::Colon);
        node->values.push_back(parse_expression(true));
      }
      expect(Tok::RBrace);
    } else if (t.type == Tok::Eof) {
      fail(t, "unexpected end of template");
    } else {
      fail(t, fmt::format("unexpected {}", describe_token(t)));
    }
    return node;
  }

  void note_name_use(const std::string& name) {
    if (macro_stack_.empty()) return;
    if (name == "caller") macro_stack_.back()->uses_caller = true;
    if (name == "varargs") macro_stack_.back()->uses_varargs = true;
    if (name == "kwargs") macro_stack_.back()->uses_kwargs = true;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    ChainGuard chain(*this);
    while (true) {
      chain.link();
      Tok t = cur().type;
      if (t == Tok::Dot || t == Tok::LBracket)
        node = parse_subscript(std::move(node));
      else if (t == Tok::LParen)
        node = parse_call(std::move(node));
      else
        break;
    }
    return node;
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    ChainGuard chain(*this);
    while (true) {
      chain.link();
      Tok t = cur().type;
      if (t == Tok::Pipe)
        node = parse_filter(std::move(node), false);
      else if (is_name(cur(), "is"))
        node = parse_test(std::move(node));
      else if (t == Tok::LParen)
        node = parse_call(std::move(node));
      else
        break;
    }
    return node;
  }

  ExprPtr parse_subscript(ExprPtr node) {
    const Token& t = next();
    if (t.type == Tok::Dot) {
      const Token& attr = next();
      if (attr.type == Tok::Name) {
        auto e = std::make_unique<Expr>(ExprKind::Getattr, t.pos);
        e->a = std::move(node);
        e->attr = attr.text;
        return e;
      }
      if (attr.type != Tok::Integer) fail(attr, "expected name or number");
      auto e = std::make_unique<Expr>(ExprKind::Getitem, t.pos);
      e->a = std::move(node);
      e->b = std::make_unique<Expr>(ExprKind::Const, attr.pos);
      e->b->constant = Value(attr.int_value);
      return e;
    }
    std::vector<ExprPtr> args;
    while (cur().type != Tok::RBracket) {
      if (!args.empty()) expect(Tok::Comma);
      args.push_back(parse_subscribed());
    }
    expect(Tok::RBracket);
    auto e = std::make_unique<Expr>(ExprKind::Getitem, t.pos);
    e->a = std::move(node);
    if (args.size() == 1) {
      e->b = std::move(args[0]);
    } else {
      e->b = std::make_unique<Expr>(ExprKind::Tuple, t.pos);
      e->b->items = std::move(args);
    }
    return e;
  }

  ExprPtr parse_subscribed() {
    SourcePos pos = cur().pos;
    auto slice = std::make_unique<Expr>(ExprKind::Slice, pos);
    if (cur().type == Tok::Colon) {
      next();
    } else {
      ExprPtr node = parse_expression(true);
      if (cur().type != Tok::Colon) return node;
      next();
      slice->a = std::move(node);
    }
    if (cur().type != Tok::Colon && cur().type != Tok::RBracket && cur().type != Tok::Comma)
      slice->b = parse_expression(true);
    if (cur().type == Tok::Colon) {
      next();
      if (cur().type != Tok::RBracket && cur().type != Tok::Comma) slice->c = parse_expression(true);
    }
    return slice;
  }

  void parse_call_args(Expr& e) {
    const Token& open = expect(Tok::LParen);
    bool require_comma = false;
    auto ensure = [&](bool ok) {
      if (!ok) fail(open, "invalid syntax for function call expression");
    };
    while (cur().type != Tok::RParen) {
      if (require_comma) {
        expect(Tok::Comma);
        if (cur().type == Tok::RParen) break;
      }
      if (cur().type == Tok::Mul) {
        ensure(!e.dyn_args && !e.dyn_kwargs);
        next();
        e.dyn_args = parse_expression(true);
      } else if (cur().type == Tok::Pow) {
        ensure(!e.dyn_kwargs);
        next();
        e.dyn_kwargs = parse_expression(true);
      } else if (cur().type == Tok::Name && look().type == Tok::Assign) {
        ensure(!e.dyn_kwargs);
        std::string key = next().text;
        next();
        e.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        ensure(!e.dyn_args && !e.dyn_kwargs && e.kwargs.empty());
        e.items.push_back(parse_expression(true));
      }
      require_comma = true;
    }
    expect(Tok::RParen);
  }

  ExprPtr parse_call(ExprPtr node) {
    auto e = std::make_unique<Expr>(ExprKind::Call, cur().pos);
    e->a = std::move(node);
    parse_call_args(*e);
    return e;
  }

  ExprPtr parse_filter(ExprPtr node, bool start_inline) {
    ChainGuard chain(*this);
    while (cur().type == Tok::Pipe || start_inline) {
      chain.link();
      if (!start_inline) next();
      const Token& name = expect(Tok::Name);
      auto e = std::make_unique<Expr>(ExprKind::Filter, name.pos);
      e->name = name.text;
      while (cur().type == Tok::Dot) {
        next();
        e->name += "." + expect(Tok::Name).text;
      }
      if (cur().type == Tok::LParen) parse_call_args(*e);
      e->a = std::move(node);
      node = std::move(e);
      start_inline = false;
    }
    return node;
  }

  ExprPtr parse_test(ExprPtr node) {
    const Token& is = next();
    bool negated = skip_if_name("not");
    auto e = std::make_unique<Expr>(ExprKind::Test, is.pos);
    e->name = expect(Tok::Name).text;
    while (cur().type == Tok::Dot) {
      next();
      e->name += "." + expect(Tok::Name).text;
    }
    Tok t = cur().type;
    if (t == Tok::LParen) {
      parse_call_args(*e);
    } else if ((t == Tok::Name || t == Tok::String || t == Tok::Integer || t == Tok::Float ||
                t == Tok::LBracket || t == Tok::LBrace) &&
               !is_name(cur(), "else") && !is_name(cur(), "or") && !is_name(cur(), "and")) {
      if (is_name(cur(), "is")) fail(cur(), "You cannot chain multiple tests with is");
      e->items.push_back(parse_postfix(parse_primary(false)));
    }
    e->a = std::move(node);
    if (!negated) return e;
    auto n = std::make_unique<Expr>(ExprKind::Not, is.pos);
    n->a = std::move(e);
    return n;
  }
};

}  // namespace

Body parse(const std::vector<Token>& tokens) {
  return Parser(tokens).parse_template();
}

}  // namespace kiln::tmpl::jinja
