// Parser of Jinja templates: tokens -> syntax tree, with jinja2's grammar and operator precedence
// (lowest first): inline if, or, and, not, comparisons (chained; in / not in), + -, ~, * / // %,
// **, unary - +, then postfix .attr [sub] (call), then | filter and "is" test.
// One recursive-descent grammar, kept whole (a little over 700 lines) so each precedence level and
// statement reads next to the one it calls; nesting is bounded (text/limits.h).
#include <algorithm>
#include <charconv>
#include <cstdlib>

#include "text/jinja_ast.h"
#include "text/jinja_lexer.h"
#include "text/limits.h"

namespace moestream::jinja {

namespace {

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  Body parse_template() {
    std::string end;
    Body b = parse_body({}, &end);
    return b;
  }

 private:
  std::vector<Token> t_;
  size_t i_ = 0;
  int nesting_ = 0;

  // One level of the parser's recursion (a bracket, a unary operator, a block): bounded, as the
  // parser, the evaluator and the tree's destructor all recurse that deep.
  struct Nest {
    Parser& p;
    explicit Nest(Parser& parser) : p(parser) {
      if (++p.nesting_ > text_limits::kMaxTemplateNesting)
        p.fail("the template is nested more than " + std::to_string(text_limits::kMaxTemplateNesting) +
               " levels deep");
    }
    ~Nest() { --p.nesting_; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;
  };

  // Seals a node whose children are in place: its height, bounded (a long chain such as a.b.c...
  // or 1 + 1 + ... is built by loops, not recursion, but is as deep to evaluate).
  ExprP done(ExprP e) {
    int h = 0;
    auto see = [&](const ExprP& c) {
      if (c) h = std::max(h, c->height);
    };
    see(e->a), see(e->b), see(e->c), see(e->d);
    for (const auto& x : e->items) see(x);
    for (const auto& x : e->args.pos) see(x);
    for (const auto& kv : e->args.kw) see(kv.second);
    see(e->args.star), see(e->args.starstar);
    e->height = h + 1;
    if (e->height > text_limits::kMaxExpressionDepth)
      fail("expression nested more than " + std::to_string(text_limits::kMaxExpressionDepth) + " levels deep");
    return e;
  }

  const Token& cur() const { return t_[i_]; }
  const Token& peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  int line() const { return cur().line; }
  [[noreturn]] void fail(const std::string& msg) const { throw RenderError{"TemplateSyntaxError", msg, line()}; }

  bool is_op(const char* op) const { return cur().kind == Token::Op && cur().text == op; }
  bool is_name(const char* n) const { return cur().kind == Token::Name && cur().text == n; }
  bool accept_op(const char* op) {
    if (!is_op(op)) return false;
    ++i_;
    return true;
  }
  bool accept_name(const char* n) {
    if (!is_name(n)) return false;
    ++i_;
    return true;
  }
  void expect_op(const char* op) {
    if (!accept_op(op)) fail(std::string("expected '") + op + "', got " + describe());
  }
  std::string expect_name() {
    if (cur().kind != Token::Name) fail("expected a name, got " + describe());
    return t_[i_++].text;
  }
  void expect_block_end() {
    if (cur().kind != Token::BlockEnd) fail("expected end of statement block, got " + describe());
    ++i_;
  }
  std::string describe() const {
    switch (cur().kind) {
      case Token::End: return "end of template";
      case Token::BlockEnd: return "'%}'";
      case Token::VarEnd: return "'}}'";
      case Token::Text: return "text";
      default: return "'" + cur().text + "'";
    }
  }

  // Statements until "{% <one of ends> ..." (its name consumed and stored in *which), or the end.
  Body parse_body(std::initializer_list<const char*> ends, std::string* which) {
    Body body;
    for (;;) {
      const Token& tk = cur();
      if (tk.kind == Token::End) {
        if (ends.size() != 0) fail(std::string("unexpected end of template; expected '") + *ends.begin() + "'");
        return body;
      }
      if (tk.kind == Token::Text) {
        auto s = std::make_unique<Stmt>(Stmt::Text, tk.line);
        s->text = tk.text;
        body.push_back(std::move(s));
        ++i_;
        continue;
      }
      if (tk.kind == Token::VarBegin) {
        ++i_;
        auto s = std::make_unique<Stmt>(Stmt::Output, tk.line);
        s->expr = parse_tuple(true);
        if (cur().kind != Token::VarEnd) fail("expected '}}', got " + describe());
        ++i_;
        body.push_back(std::move(s));
        continue;
      }
      if (tk.kind != Token::BlockBegin) fail("unexpected " + describe());
      ++i_;
      if (cur().kind != Token::Name) fail("expected a statement name, got " + describe());
      for (const char* e : ends) {
        if (cur().text == e) {
          *which = t_[i_++].text;
          return body;
        }
      }
      body.push_back(parse_statement());
    }
  }

  StmtP parse_statement() {
    Nest nest(*this);
    int ln = line();
    std::string kw = t_[i_++].text;
    if (kw == "if") return parse_if(ln);
    if (kw == "for") return parse_for(ln);
    if (kw == "set") return parse_set(ln);
    if (kw == "macro") return parse_macro(ln);
    if (kw == "call") return parse_call_block(ln);
    if (kw == "filter") return parse_filter_block(ln);
    if (kw == "with") return parse_with(ln);
    if (kw == "break" || kw == "continue") {
      expect_block_end();
      return std::make_unique<Stmt>(kw == "break" ? Stmt::Break : Stmt::Continue, ln);
    }
    if (kw == "generation") {  // transformers' AssistantTracker extension: renders its body
      expect_block_end();
      auto s = std::make_unique<Stmt>(Stmt::Scope, ln);
      std::string end;
      s->body = parse_body({"endgeneration"}, &end);
      expect_block_end();
      return s;
    }
    --i_;
    fail("Encountered unknown tag '" + kw + "'.");
  }

  StmtP parse_if(int ln) {
    auto s = std::make_unique<Stmt>(Stmt::If, ln);
    s->cond = parse_tuple(false);
    expect_block_end();
    std::string end;
    s->body = parse_body({"elif", "else", "endif"}, &end);
    if (end == "elif") {
      Nest nest(*this);  // an elif is an if inside the else
      s->orelse.push_back(parse_if(line()));
    } else if (end == "else") {
      expect_block_end();
      s->orelse = parse_body({"endif"}, &end);
      expect_block_end();
    } else {
      expect_block_end();
    }
    return s;
  }

  Target parse_target(bool allow_attr) {
    Target t;
    bool paren = accept_op("(");
    t.names.push_back(expect_name());
    if (allow_attr && !paren && accept_op(".")) {
      t.attr = expect_name();
      return t;
    }
    while (accept_op(",")) {
      t.tuple = true;
      if (cur().kind != Token::Name) break;
      t.names.push_back(expect_name());
    }
    if (paren) {
      expect_op(")");
      t.tuple = t.tuple || t.names.size() > 1;
    }
    return t;
  }

  StmtP parse_for(int ln) {
    auto s = std::make_unique<Stmt>(Stmt::For, ln);
    s->target = parse_target(false);
    if (!accept_name("in")) fail("expected 'in', got " + describe());
    s->expr = parse_tuple(false, /*stop_at_if=*/true);
    if (accept_name("if")) s->cond = parse_tuple(true);
    if (is_name("recursive")) fail("recursive for loops are not supported");
    expect_block_end();
    std::string end;
    s->body = parse_body({"endfor", "else"}, &end);
    if (end == "else") {
      expect_block_end();
      s->orelse = parse_body({"endfor"}, &end);
    }
    expect_block_end();
    return s;
  }

  StmtP parse_set(int ln) {
    Target t = parse_target(true);
    if (accept_op("=")) {
      auto s = std::make_unique<Stmt>(Stmt::Set, ln);
      s->target = std::move(t);
      s->expr = parse_tuple(true);
      expect_block_end();
      return s;
    }
    auto s = std::make_unique<Stmt>(Stmt::SetBlock, ln);
    s->target = std::move(t);
    while (accept_op("|")) s->filters.push_back(parse_filter_tail(nullptr));
    expect_block_end();
    std::string end;
    s->body = parse_body({"endset"}, &end);
    expect_block_end();
    return s;
  }

  void parse_params(MacroDef& m) {
    expect_op("(");
    while (!accept_op(")")) {
      if (!m.params.empty()) expect_op(",");
      if (accept_op(")")) break;
      std::string name = expect_name();
      ExprP def;
      if (accept_op("=")) def = parse_expression();
      m.params.emplace_back(std::move(name), std::move(def));
    }
  }

  static void scan_names(const Body& body, MacroDef& m);

  StmtP parse_macro(int ln) {
    auto s = std::make_unique<Stmt>(Stmt::Macro, ln);
    s->macro = std::make_shared<MacroDef>();
    s->macro->name = expect_name();
    parse_params(*s->macro);
    expect_block_end();
    std::string end;
    s->macro->body = parse_body({"endmacro"}, &end);
    if (cur().kind == Token::Name && cur().text == s->macro->name) ++i_;
    expect_block_end();
    scan_names(s->macro->body, *s->macro);
    return s;
  }

  StmtP parse_call_block(int ln) {
    auto s = std::make_unique<Stmt>(Stmt::CallBlock, ln);
    s->macro = std::make_shared<MacroDef>();
    s->macro->name = "caller";
    if (is_op("(")) parse_params(*s->macro);
    s->expr = parse_expression();
    if (s->expr->kind != Expr::Call) fail("expected call");
    expect_block_end();
    std::string end;
    s->macro->body = parse_body({"endcall"}, &end);
    expect_block_end();
    scan_names(s->macro->body, *s->macro);
    return s;
  }

  StmtP parse_filter_block(int ln) {
    auto s = std::make_unique<Stmt>(Stmt::FilterBlock, ln);
    s->filters.push_back(parse_filter_tail(nullptr));
    while (accept_op("|")) s->filters.push_back(parse_filter_tail(nullptr));
    expect_block_end();
    std::string end;
    s->body = parse_body({"endfilter"}, &end);
    expect_block_end();
    return s;
  }

  StmtP parse_with(int ln) {
    auto s = std::make_unique<Stmt>(Stmt::With, ln);
    while (cur().kind != Token::BlockEnd) {
      if (!s->assigns.empty()) expect_op(",");
      Target t = parse_target(false);
      expect_op("=");
      s->assigns.emplace_back(std::move(t), parse_expression());
    }
    expect_block_end();
    std::string end;
    s->body = parse_body({"endwith"}, &end);
    expect_block_end();
    return s;
  }

  // ---- expressions ----

  ExprP make(Expr::Kind k, int ln) { return std::make_unique<Expr>(k, ln); }

  // The current Integer token (decimal digits; the lexer has checked it fits int64), consumed.
  Value integer_literal() {
    const std::string& text = cur().text;
    int64_t v = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || end != text.data() + text.size())
      fail("integer literal " + text + " is too large (the limit is 9223372036854775807)");
    ++i_;
    return Value(v);
  }

  ExprP parse_tuple(bool with_condexpr, bool stop_at_if = false) {
    int ln = line();
    auto one = [&] { return with_condexpr ? parse_expression() : parse_or(); };
    ExprP first = one();
    if (!is_op(",")) return first;
    auto t = make(Expr::TupleLit, ln);
    t->items.push_back(std::move(first));
    while (accept_op(",")) {
      if (cur().kind == Token::BlockEnd || cur().kind == Token::VarEnd || is_op(")") ||
          (stop_at_if && is_name("if")))
        break;
      t->items.push_back(one());
    }
    return done(std::move(t));
  }

  ExprP parse_expression() { return parse_condexpr(); }

  ExprP parse_condexpr() {
    Nest nest(*this);
    int ln = line();
    ExprP e = parse_or();
    while (accept_name("if")) {
      auto c = make(Expr::CondExpr, ln);
      c->b = parse_or();
      if (accept_name("else")) c->c = parse_condexpr();
      c->a = std::move(e);
      e = done(std::move(c));
    }
    return e;
  }

  ExprP parse_or() {
    ExprP e = parse_and();
    while (is_name("or")) {
      auto n = make(Expr::Or, line());
      ++i_;
      n->a = std::move(e);
      n->b = parse_and();
      e = done(std::move(n));
    }
    return e;
  }

  ExprP parse_and() {
    ExprP e = parse_not();
    while (is_name("and")) {
      auto n = make(Expr::And, line());
      ++i_;
      n->a = std::move(e);
      n->b = parse_not();
      e = done(std::move(n));
    }
    return e;
  }

  ExprP parse_not() {
    if (is_name("not")) {
      Nest nest(*this);
      auto n = make(Expr::Not, line());
      ++i_;
      n->a = parse_not();
      return done(std::move(n));
    }
    return parse_compare();
  }

  ExprP parse_compare() {
    int ln = line();
    ExprP e = parse_math1();
    ExprP cmp;
    for (;;) {
      std::string op;
      if (cur().kind == Token::Op &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == "<=" || cur().text == ">" ||
           cur().text == ">=")) {
        op = t_[i_++].text;
      } else if (is_name("in")) {
        ++i_;
        op = "in";
      } else if (is_name("not") && peek().kind == Token::Name && peek().text == "in") {
        i_ += 2;
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(Expr::Compare, ln);
        cmp->a = std::move(e);
      }
      cmp->ops.push_back(op);
      cmp->items.push_back(parse_math1());
    }
    return cmp ? done(std::move(cmp)) : std::move(e);
  }

  ExprP binary(ExprP a, const std::string& op, ExprP b, int ln) {
    auto n = make(Expr::Binary, ln);
    n->name = op;
    n->a = std::move(a);
    n->b = std::move(b);
    return done(std::move(n));
  }

  ExprP parse_math1() {
    ExprP e = parse_concat();
    while (is_op("+") || is_op("-")) {
      int ln = line();
      std::string op = t_[i_++].text;
      e = binary(std::move(e), op, parse_concat(), ln);
    }
    return e;
  }

  ExprP parse_concat() {
    ExprP e = parse_math2();
    while (is_op("~")) {
      int ln = line();
      ++i_;
      e = binary(std::move(e), "~", parse_math2(), ln);
    }
    return e;
  }

  ExprP parse_math2() {
    ExprP e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      int ln = line();
      std::string op = t_[i_++].text;
      e = binary(std::move(e), op, parse_pow(), ln);
    }
    return e;
  }

  ExprP parse_pow() {
    ExprP e = parse_unary(true);
    while (is_op("**")) {
      int ln = line();
      ++i_;
      e = binary(std::move(e), "**", parse_unary(true), ln);
    }
    return e;
  }

  ExprP parse_unary(bool with_filter) {
    int ln = line();
    ExprP e;
    if (is_op("-") || is_op("+")) {
      Nest nest(*this);
      bool neg = cur().text == "-";
      ++i_;
      e = make(neg ? Expr::Neg : Expr::Pos, ln);
      e->a = parse_unary(false);
      e = done(std::move(e));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprP parse_primary() {
    Nest nest(*this);
    const Token& tk = cur();
    int ln = tk.line;
    switch (tk.kind) {
      case Token::Name: {
        ++i_;
        const std::string& n = tk.text;
        auto lit = [&](Value v) {
          auto e = make(Expr::Literal, ln);
          e->value = std::move(v);
          return e;
        };
        if (n == "true" || n == "True") return lit(Value(true));
        if (n == "false" || n == "False") return lit(Value(false));
        if (n == "none" || n == "None") return lit(Value(None{}));
        auto e = make(Expr::Name, ln);
        e->name = n;
        return e;
      }
      case Token::String: {
        std::string s;
        while (cur().kind == Token::String) s += t_[i_++].text;
        auto e = make(Expr::Literal, ln);
        e->value = Value(std::move(s));
        return e;
      }
      case Token::Integer: {
        auto e = make(Expr::Literal, ln);
        e->value = integer_literal();
        return e;
      }
      case Token::Float: {
        ++i_;
        auto e = make(Expr::Literal, ln);
        e->value = Value(std::strtod(tk.text.c_str(), nullptr));
        return e;
      }
      case Token::Op: {
        if (accept_op("(")) {
          if (accept_op(")")) return make(Expr::TupleLit, ln);
          ExprP first = parse_expression();
          if (accept_op(")")) return first;
          auto t = make(Expr::TupleLit, ln);
          t->items.push_back(std::move(first));
          while (accept_op(",")) {
            if (is_op(")")) break;
            t->items.push_back(parse_expression());
          }
          expect_op(")");
          return done(std::move(t));
        }
        if (accept_op("[")) {
          auto l = make(Expr::ListLit, ln);
          while (!accept_op("]")) {
            if (!l->items.empty()) expect_op(",");
            if (accept_op("]")) break;
            l->items.push_back(parse_expression());
          }
          return done(std::move(l));
        }
        if (accept_op("{")) {
          auto d = make(Expr::DictLit, ln);
          while (!accept_op("}")) {
            if (!d->items.empty()) expect_op(",");
            if (accept_op("}")) break;
            d->items.push_back(parse_expression());
            expect_op(":");
            d->items.push_back(parse_expression());
          }
          return done(std::move(d));
        }
        break;
      }
      default: break;
    }
    fail("unexpected " + describe());
  }

  ExprP parse_postfix(ExprP e) {
    for (;;) {
      int ln = line();
      if (accept_op(".")) {
        if (cur().kind == Token::Integer) {  // foo.0 is foo[0]
          auto n = make(Expr::GetItem, ln);
          n->a = std::move(e);
          n->b = make(Expr::Literal, ln);
          n->b->value = integer_literal();
          e = done(std::move(n));
          continue;
        }
        auto n = make(Expr::GetAttr, ln);
        n->a = std::move(e);
        n->name = expect_name();
        e = done(std::move(n));
      } else if (accept_op("[")) {
        e = parse_subscript(std::move(e), ln);
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprP parse_subscript(ExprP obj, int ln) {
    ExprP parts[3];
    int n = 0;
    bool slice = false;
    for (;;) {
      if (is_op(":")) {
        slice = true;
        ++i_;
        ++n;
        if (n > 2) fail("invalid slice");
        continue;
      }
      if (is_op("]")) break;
      if (parts[n]) fail("expected ']' or ':'");
      parts[n] = parse_expression();
      if (!slice && is_op(",")) {  // a[1, 2]: tuple key
        auto t = make(Expr::TupleLit, ln);
        t->items.push_back(std::move(parts[0]));
        while (accept_op(",")) {
          if (is_op("]")) break;
          t->items.push_back(parse_expression());
        }
        parts[0] = std::move(t);
      }
    }
    expect_op("]");
    if (!slice) {
      auto e = make(Expr::GetItem, ln);
      e->a = std::move(obj);
      e->b = std::move(parts[0]);
      if (!e->b) fail("expected subscript expression");
      return done(std::move(e));
    }
    auto e = make(Expr::Slice, ln);
    e->a = std::move(obj);
    e->b = std::move(parts[0]);
    e->c = std::move(parts[1]);
    e->d = std::move(parts[2]);
    return done(std::move(e));
  }

  void parse_call_args(CallArgs& args) {
    expect_op("(");
    bool first = true;
    while (!accept_op(")")) {
      if (!first) {
        expect_op(",");
        if (accept_op(")")) break;
      }
      first = false;
      if (accept_op("*")) {
        args.star = parse_expression();
      } else if (accept_op("**")) {
        args.starstar = parse_expression();
      } else if (cur().kind == Token::Name && peek().kind == Token::Op && peek().text == "=") {
        std::string k = t_[i_].text;
        i_ += 2;
        args.kw.emplace_back(std::move(k), parse_expression());
      } else {
        if (!args.kw.empty()) fail("positional argument after keyword argument");
        args.pos.push_back(parse_expression());
      }
    }
  }

  ExprP parse_call(ExprP fn) {
    auto e = make(Expr::Call, line());
    e->a = std::move(fn);
    parse_call_args(e->args);
    return done(std::move(e));
  }

  // After '|': name[.name...][(args)]; the filtered value goes in a.
  ExprP parse_filter_tail(ExprP value) {
    auto f = make(Expr::Filter, line());
    f->name = expect_name();
    while (accept_op(".")) f->name += "." + expect_name();
    if (is_op("(")) parse_call_args(f->args);
    f->a = std::move(value);
    return done(std::move(f));
  }

  ExprP parse_filter_expr(ExprP e) {
    for (;;) {
      if (accept_op("|")) {
        e = parse_filter_tail(std::move(e));
      } else if (is_name("is")) {
        ++i_;
        auto t = make(Expr::Test, line());
        t->negated = accept_name("not");
        t->name = expect_name();
        while (accept_op(".")) t->name += "." + expect_name();
        if (is_op("(")) {
          parse_call_args(t->args);
        } else if ((cur().kind == Token::Name || cur().kind == Token::String || cur().kind == Token::Integer ||
                    cur().kind == Token::Float || is_op("(") || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          if (is_name("is")) fail("You cannot chain multiple tests with is");
          t->args.pos.push_back(parse_postfix(parse_primary()));
        }
        t->a = std::move(e);
        e = done(std::move(t));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }
};

// Whether a macro body refers to caller / varargs / kwargs (jinja2 then accepts extra arguments).
void scan_expr(const Expr* e, MacroDef& m) {
  if (!e) return;
  if (e->kind == Expr::Name) {
    if (e->name == "caller") m.uses_caller = true;
    if (e->name == "varargs") m.uses_varargs = true;
    if (e->name == "kwargs") m.uses_kwargs = true;
  }
  scan_expr(e->a.get(), m);
  scan_expr(e->b.get(), m);
  scan_expr(e->c.get(), m);
  scan_expr(e->d.get(), m);
  for (const auto& x : e->items) scan_expr(x.get(), m);
  for (const auto& x : e->args.pos) scan_expr(x.get(), m);
  for (const auto& x : e->args.kw) scan_expr(x.second.get(), m);
  scan_expr(e->args.star.get(), m);
  scan_expr(e->args.starstar.get(), m);
}

void Parser::scan_names(const Body& body, MacroDef& m) {
  for (const auto& s : body) {
    if (s->kind == Stmt::Macro) continue;  // nested macros have their own
    scan_expr(s->expr.get(), m);
    scan_expr(s->cond.get(), m);
    for (const auto& f : s->filters) scan_expr(f.get(), m);
    for (const auto& a : s->assigns) scan_expr(a.second.get(), m);
    scan_names(s->body, m);
    scan_names(s->orelse, m);
    if (s->kind == Stmt::CallBlock && s->macro) scan_names(s->macro->body, m);
  }
}

}  // namespace

std::shared_ptr<const Program> parse_program(std::string_view source, std::string name) {
  auto p = std::make_shared<Program>();
  p->name = std::move(name);
  Parser parser(tokenize(source));
  p->body = parser.parse_template();
  return p;
}

}  // namespace moestream::jinja
