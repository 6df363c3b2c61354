// Syntax tree of a parsed Jinja template (internal to src/text/jinja*.cpp). Built once by the
// parser, then only read: rendering from several threads at once shares one tree.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "text/jinja_value.h"

namespace moestream::jinja {

struct Expr;
using ExprP = std::unique_ptr<Expr>;
struct Stmt;
using StmtP = std::unique_ptr<Stmt>;
using Body = std::vector<StmtP>;

struct CallArgs {
  std::vector<ExprP> pos;
  std::vector<std::pair<std::string, ExprP>> kw;
  ExprP star, starstar;  // *args, **kwargs
};

struct Expr {
  enum Kind {
    Literal,   // value
    Name,      // name
    GetAttr,   // a.name
    GetItem,   // a[b]
    Slice,     // a[b:c:d] (b, c, d may be null)
    Call,      // a(args)
    Filter,    // a | name(args)
    Test,      // a is [not] name(args)
    Neg,       // -a
    Pos,       // +a
    Not,       // not a
    Binary,    // a op b: + - * / // % ** ~
    And,       // a and b
    Or,        // a or b
    Compare,   // a ops[0] items[0] ops[1] items[1] ...: == != < <= > >= in notin
    CondExpr,  // a if b else c (c may be null)
    ListLit,   // [items]
    TupleLit,  // (items)
    DictLit,   // {items[0]: items[1], ...}
  } kind;
  int line = 0;
  Value value;
  std::string name;  // Name, GetAttr, Filter, Test; operator of Binary
  ExprP a, b, c, d;
  std::vector<ExprP> items;
  std::vector<std::string> ops;
  CallArgs args;
  bool negated = false;  // Test: is not
  int height = 1;        // of the tree below (bounded by the parser: evaluating it recurses)
  Expr(Kind k, int l) : kind(k), line(l) {}
};

// Assignment targets: a name, a tuple of names, or ns.attr.
struct Target {
  std::vector<std::string> names;  // one name, or several for unpacking
  std::string attr;                // set ns.attr = ... (names[0] is the namespace)
  bool tuple = false;
};

struct MacroDef {
  std::string name;
  std::vector<std::pair<std::string, ExprP>> params;  // default may be null
  Body body;
  bool uses_caller = false, uses_varargs = false, uses_kwargs = false;
};

struct Stmt {
  enum Kind {
    Text,         // text
    Output,       // {{ expr }}
    If,           // if expr: body; elif/else in orelse
    For,          // for target in expr [if cond]: body else orelse
    Set,          // set target = expr
    SetBlock,     // set target [| filters]: body
    Macro,        // macro definition
    CallBlock,    // call(params) expr: body
    FilterBlock,  // filter name(args)...: body
    With,         // with assignments: body
    Break,
    Continue,
    Scope,        // body rendered as is ({% generation %})
  } kind;
  int line = 0;
  std::string text;
  ExprP expr, cond;
  Target target;
  Body body, orelse;
  std::shared_ptr<MacroDef> macro;              // Macro, CallBlock (caller)
  std::vector<ExprP> filters;                   // SetBlock, FilterBlock: Filter exprs with a == null
  std::vector<std::pair<Target, ExprP>> assigns;  // With
  Stmt(Kind k, int l) : kind(k), line(l) {}
};

struct Program {
  std::string name;
  Body body;
};

// Parses a template (throws RenderError{"TemplateSyntaxError", ...} with the line).
std::shared_ptr<const Program> parse_program(std::string_view source, std::string name);

}  // namespace moestream::jinja
