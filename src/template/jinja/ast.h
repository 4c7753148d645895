// Syntax tree of a parsed Jinja template (mirrors jinja2.nodes, reduced to what templates use).
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "template/jinja/lexer.h"
#include "template/jinja/value.h"

namespace kiln::tmpl::jinja {

enum class ExprKind {
  Const,    // constant
  Name,     // name
  NSRef,    // name.attr as an assignment target
  Getattr,  // a.attr
  Getitem,  // a[b]
  Slice,    // a:b:c inside [] (each may be null)
  Call,     // a(items..., kwargs...)
  Filter,   // a|name(items..., kwargs...); a is null inside {% filter %} / {% set %} blocks
  Test,     // a is name(items...)
  Neg,
  Pos,
  Not,    // unary on a
  BinOp,  // a op b
  And,
  Or,        // a and/or b
  Concat,    // items joined with ~
  Compare,   // a op1 x1 op2 x2 ...
  CondExpr,  // a if b else c (c may be null)
  List,
  Tuple,  // items
  Dict,   // items (keys), values
};

enum class BinOp { Add, Sub, Mul, Div, FloorDiv, Mod, Pow };
enum class CmpOp { Eq, Ne, Lt, LtEq, Gt, GtEq, In, NotIn };

struct Expr {
  ExprKind kind;
  SourcePos pos;
  Value constant;
  std::string name;  // Name / NSRef namespace / Filter / Test name
  std::string attr;  // Getattr / NSRef attribute
  BinOp op = BinOp::Add;
  std::unique_ptr<Expr> a, b, c;
  std::vector<std::unique_ptr<Expr>> items;
  std::vector<std::unique_ptr<Expr>> values;
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> kwargs;
  std::unique_ptr<Expr> dyn_args, dyn_kwargs;
  std::vector<std::pair<CmpOp, std::unique_ptr<Expr>>> comparisons;

  Expr(ExprKind k, SourcePos p) : kind(k), pos(p) {}
};

using ExprPtr = std::unique_ptr<Expr>;

enum class StmtKind {
  Text,         // literal template data
  Output,       // {{ expr }}
  If,           // if expr: body, else: else_body (elif = nested If in else_body)
  For,          // for target in expr [if test] [recursive]: body, else: else_body
  Assign,       // set target = expr
  AssignBlock,  // set target [| filter]: body
  Macro,        // macro name(params=defaults): body
  CallBlock,    // call(params) expr: body (body becomes `caller`)
  FilterBlock,  // filter expr: body
  With,         // with targets = values: body
  Scope,        // body in a scope of its own ({% generation %}: HF renders it as a call block)
  Block,        // {% block %} without inheritance: body in place
  Break,
  Continue,
};

struct Stmt {
  StmtKind kind;
  SourcePos pos;
  std::string text;
  ExprPtr expr;
  ExprPtr target;
  ExprPtr test;
  bool recursive = false;
  std::vector<std::unique_ptr<Stmt>> body;
  std::vector<std::unique_ptr<Stmt>> else_body;
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // for the last defaults.size() params
  bool uses_caller = false, uses_varargs = false, uses_kwargs = false;
  std::vector<ExprPtr> targets, values;

  Stmt(StmtKind k, SourcePos p) : kind(k), pos(p) {}
};

using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

// Throws kiln::Error "chat template syntax error at line L, column C: ...".
Body parse(const std::vector<Token>& tokens);

}  // namespace kiln::tmpl::jinja
