// The evaluator: statements, expressions and scoping as jinja2 runs them. A for-loop iteration, a
// macro call and a with-block get a scope of their own (a set inside them does not leak out); if
// blocks do not. Macros see the scope they were defined in.
#include "text/jinja_interp.h"

#include <algorithm>
#include <cmath>

#include "text/limits.h"

namespace moestream::jinja {

void undefined_error(const Value& v) {
  std::string hint = v.undefined_hint();
  // The sandbox's Undefined for list.append, dict.update, ... raises SecurityError.
  std::string type = hint.rfind("access to attribute ", 0) == 0 ? "SecurityError" : "UndefinedError";
  throw_error(std::move(type), std::move(hint));
}

namespace {

// One level of evaluator recursion (an expression, a statement), bounded for the whole render.
struct RenderDepth {
  int& d;
  explicit RenderDepth(int& depth) : d(depth) {
    if (++d > text_limits::kMaxRenderDepth) {
      --d;
      throw_error("RecursionError", "maximum recursion depth exceeded (" +
                                        std::to_string(text_limits::kMaxRenderDepth) + " nested evaluations)");
    }
  }
  ~RenderDepth() { --d; }
  RenderDepth(const RenderDepth&) = delete;
  RenderDepth& operator=(const RenderDepth&) = delete;
};

}  // namespace

void Interp::charge(int64_t steps) {
  render_steps_ += steps;
  if (render_steps_ > max_steps_)
    throw_error("RuntimeError", "the template takes more than " + std::to_string(max_steps_) + " evaluation steps");
}

void Interp::charge_scan(const Value& v) {
  if (v.is_string()) charge_scan(v.str().size());
  else if (v.is_list()) charge(int64_t(v.list().size()));
  else if (v.is_dict()) charge(int64_t(v.dict().items.size()));
}

std::string object_type_repr(const Value& v) {
  if (v.is_none()) return "None";
  return std::string(type_name(v)) + " object";
}

// ---- object protocol ----

Value Interp::getattr(const Value& obj, std::string_view name) {
  if (obj.is_undefined()) undefined_error(obj);
  if (obj.is_namespace()) {
    if (Value* v = obj.ns().find(name)) return *v;
  } else if (is_unsafe_method(obj, name)) {
    return Value::undefined("access to attribute '" + std::string(name) + "' of '" + type_name(obj) +
                            "' object is unsafe.");
  } else if (has_method(obj, name)) {
    // The object lives in `bound`, not in the closure, so that ~Value frees chains of them.
    auto f = std::make_shared<Function>();
    f->name = std::string(name);
    f->bound.push_back(obj);
    const Function* self = f.get();  // the closure is owned by *self
    f->fn = [self](Interp& in, Args& a) { return call_method(in, self->bound[0], self->name, a); };
    return Value(std::shared_ptr<const Function>(std::move(f)));
  } else if (obj.is_dict()) {
    if (const Value* v = obj.dict().find(name)) return *v;
  }
  return Value::undefined("'" + object_type_repr(obj) + "' has no attribute '" + std::string(name) + "'");
}

Value Interp::getitem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) undefined_error(obj);
  if (obj.is_dict()) {
    if (const Value* v = obj.dict().find(key)) return *v;
  } else if ((obj.is_list() || obj.is_string()) && (key.is_int() || key.is_bool())) {
    int64_t i = key.as_int();
    if (obj.is_list()) {
      const List& l = obj.list();
      int64_t n = int64_t(l.size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return l[size_t(i)];
    } else {
      const std::string& s = obj.str();
      bool ascii = true;
      for (unsigned char c : s) ascii = ascii && c < 0x80;
      if (ascii) {
        int64_t n = int64_t(s.size());
        if (i < 0) i += n;
        if (i >= 0 && i < n) return Value(std::string(1, s[size_t(i)]));
      } else {  // walks to the code point: s[0] of a big string in a loop must not copy it
        charge_scan(s.size());
        int64_t n = int64_t(cp_split_count(s));
        if (i < 0) i += n;
        if (i >= 0 && i < n) {
          size_t pos = 0;
          for (int64_t k = 0; k < i; ++k) decode(s, pos);
          size_t start = pos;
          decode(s, pos);
          return Value(s.substr(start, pos - start));
        }
      }
    }
    return Value::undefined(object_type_repr(obj) + " has no element " + to_repr(key));
  }
  if (key.is_string()) return getattr(obj, key.str());
  return Value::undefined(object_type_repr(obj) + " has no element " + to_repr(key));
}

std::vector<Value> Interp::iterate(const Value& v) {
  if (v.is_list()) {
    charge_bytes(v.list().size() * kSlotBytes);
    return v.list();
  }
  if (v.is_undefined()) return {};
  if (v.is_dict()) {
    std::vector<Value> out;
    charge_bytes(v.dict().items.size() * kSlotBytes);
    out.reserve(v.dict().items.size());
    for (const auto& kv : v.dict().items) out.push_back(kv.first);
    return out;
  }
  if (v.is_string()) {
    // A value a character: ~100 bytes for each byte of a string of ASCII.
    const std::string& s = v.str();
    const size_t n = cp_split_count(s);
    charge_bytes(n * (kSlotBytes + kNewStringBytes) + s.size());
    std::vector<Value> out;
    out.reserve(n);
    for (size_t i = 0; i < s.size();) {
      size_t start = i;
      decode(s, i);
      out.emplace_back(s.substr(start, i - start));
    }
    return out;
  }
  throw_error("TypeError", std::string("'") + type_name(v) + "' object is not iterable");
}

bool Interp::contains(const Value& c, const Value& item) {
  if (c.is_string()) {
    if (!item.is_string()) {
      if (item.is_undefined()) undefined_error(item);
      throw_error("TypeError", std::string("'in <string>' requires string as left operand, not ") + type_name(item));
    }
    return c.str().find(item.str()) != std::string::npos;
  }
  if (c.is_list()) {
    for (const auto& x : c.list())
      if (equals(x, item)) return true;
    return false;
  }
  if (c.is_dict()) return c.dict().find(item) != nullptr;
  if (c.is_undefined()) return false;
  throw_error("TypeError", std::string("argument of type '") + type_name(c) + "' is not iterable");
}

// ---- statements ----

void Interp::render(const Body& body, const FrameP& frame, std::string& out) {
  Flow f = exec(body, frame, out);
  (void)f;
}

Interp::Flow Interp::exec(const Body& body, const FrameP& frame, std::string& out) {
  for (const auto& s : body) {
    Flow f;
    try {
      f = exec_stmt(*s, frame, out);
    } catch (RenderError& e) {
      if (e.line == 0) e.line = s->line;
      throw;
    }
    if (f != Flow::Normal) return f;
  }
  return Flow::Normal;
}

void Interp::assign(const Target& t, Value v, const FrameP& frame) {
  if (!t.attr.empty()) {
    Value obj = lookup(t.names[0], frame);
    if (!obj.is_namespace()) throw_error("TemplateRuntimeError", "cannot assign attribute on non-namespace object");
    Namespace& ns = obj.ns();
    if (Value* p = ns.find(t.attr)) *p = std::move(v);
    else ns.attrs.emplace_back(t.attr, std::move(v));
    return;
  }
  if (!t.tuple) {
    frame->set(t.names[0], std::move(v));
    return;
  }
  std::vector<Value> items = iterate(v);
  if (items.size() != t.names.size())
    throw_error("ValueError", items.size() > t.names.size()
                                  ? "too many values to unpack (expected " + std::to_string(t.names.size()) + ")"
                                  : "not enough values to unpack (expected " + std::to_string(t.names.size()) +
                                        ", got " + std::to_string(items.size()) + ")");
  for (size_t i = 0; i < items.size(); ++i) frame->set(t.names[i], std::move(items[i]));
}

Interp::Flow Interp::exec_stmt(const Stmt& s, const FrameP& frame, std::string& out) {
  charge(1);
  RenderDepth depth(render_depth_);
  switch (s.kind) {
    case Stmt::Text:
      will_append(out, s.text.size());
      out += s.text;
      return Flow::Normal;
    case Stmt::Output: {
      Value v = eval(*s.expr, frame);
      if (v.is_string()) {
        will_append(out, v.str().size());
        out += v.str();
      } else if (!v.is_undefined()) {
        std::string text = to_str(v);
        will_append(out, text.size());
        out += text;
      }
      return Flow::Normal;
    }
    case Stmt::If: {
      if (truthy(eval(*s.cond, frame))) return exec(s.body, frame, out);
      return exec(s.orelse, frame, out);
    }
    case Stmt::For: exec_for(s, frame, out); return Flow::Normal;
    case Stmt::Set: assign(s.target, eval(*s.expr, frame), frame); return Flow::Normal;
    case Stmt::SetBlock: {
      std::string text;
      auto inner = std::make_shared<Frame>(frame);
      exec(s.body, inner, text);
      Value v(std::move(text));
      for (const auto& f : s.filters) {
        Args a;
        eval_args(f->args, frame, a);
        v = apply_filter(f->name, v, a);
      }
      assign(s.target, std::move(v), frame);
      return Flow::Normal;
    }
    case Stmt::Macro: frame->set(s.macro->name, make_macro(s.macro, frame)); return Flow::Normal;
    case Stmt::CallBlock: {
      const Expr& call = *s.expr;
      Value fn = eval(*call.a, frame);
      Args a;
      eval_args(call.args, frame, a);
      a.kw.emplace_back("caller", make_macro(s.macro, frame));
      Value r = this->call(fn, a);
      std::string text = to_str(r);
      will_append(out, text.size());
      out += text;
      return Flow::Normal;
    }
    case Stmt::FilterBlock: {
      std::string text;
      exec(s.body, frame, text);
      Value v(std::move(text));
      for (const auto& f : s.filters) {
        Args a;
        eval_args(f->args, frame, a);
        v = apply_filter(f->name, v, a);
      }
      const std::string result = to_str(v);
      will_append(out, result.size());
      out += result;
      return Flow::Normal;
    }
    case Stmt::With: {
      auto inner = std::make_shared<Frame>(frame);
      for (const auto& [t, e] : s.assigns) assign(t, eval(*e, frame), inner);
      return exec(s.body, inner, out);
    }
    case Stmt::Break: return Flow::Break;
    case Stmt::Continue: return Flow::Continue;
    case Stmt::Scope: return exec(s.body, frame, out);
  }
  return Flow::Normal;
}

void Interp::exec_for(const Stmt& s, const FrameP& frame, std::string& out) {
  std::vector<Value> items = iterate(eval(*s.expr, frame));
  if (s.cond) {
    std::vector<Value> kept;
    for (auto& it : items) {
      auto f = std::make_shared<Frame>(frame);
      assign(s.target, it, f);
      if (truthy(eval(*s.cond, f))) kept.push_back(std::move(it));
    }
    items = std::move(kept);
  }
  const int64_t n = int64_t(items.size());
  for (int64_t i = 0; i < n; ++i) {
    charge(1);  // an empty body costs no statement: nested loops over big lists ran for hours
    auto f = std::make_shared<Frame>(frame);
    assign(s.target, items[size_t(i)], f);
    auto loop = std::make_shared<Dict>();
    auto& L = loop->items;
    L.reserve(12);
    L.emplace_back(Value("index"), Value(i + 1));
    L.emplace_back(Value("index0"), Value(i));
    L.emplace_back(Value("revindex"), Value(n - i));
    L.emplace_back(Value("revindex0"), Value(n - i - 1));
    L.emplace_back(Value("first"), Value(i == 0));
    L.emplace_back(Value("last"), Value(i == n - 1));
    L.emplace_back(Value("length"), Value(n));
    L.emplace_back(Value("depth"), Value(int64_t(1)));
    L.emplace_back(Value("depth0"), Value(int64_t(0)));
    L.emplace_back(Value("previtem"), i > 0 ? items[size_t(i - 1)] : Value::undefined("there is no previous item"));
    L.emplace_back(Value("nextitem"), i + 1 < n ? items[size_t(i + 1)] : Value::undefined("there is no next item"));
    L.emplace_back(Value("cycle"), Value::function("cycle", [i](Interp&, Args& a) -> Value {
                     if (a.pos.empty()) throw_error("TypeError", "no items for cycling given");
                     return a.pos[size_t(i) % a.pos.size()];
                   }));
    f->set("loop", Value(std::shared_ptr<const Dict>(std::move(loop))));
    Flow fl = exec(s.body, f, out);
    if (fl == Flow::Break) break;
  }
  if (n == 0 && !s.orelse.empty()) {
    auto f = std::make_shared<Frame>(frame);
    exec(s.orelse, f, out);
  }
}

Value Interp::lookup(const std::string& name, const FrameP& frame) {
  for (Frame* f = frame.get(); f; f = f->parent.get())
    if (Value* v = f->find_local(name)) return *v;
  return Value::undefined("'" + name + "' is undefined");
}

// ---- macros ----

Value Interp::make_macro(std::shared_ptr<const MacroDef> m, const FrameP& frame) {
  std::weak_ptr<Frame> def_frame = frame;  // weak: the frame holds the macro (no reference cycle)
  std::string name = m->name;
  return Value::function(name, [m = std::move(m), def_frame](Interp& in, Args& a) {
    FrameP f = def_frame.lock();
    return in.call_macro(*m, f, a);
  });
}

Value Interp::call_macro(const MacroDef& m, const FrameP& def_frame, Args& args) {
  if (macro_depth_ >= text_limits::kMaxMacroDepth)
    throw_error("RecursionError", "maximum recursion depth exceeded in macro '" + m.name + "' (" +
                                      std::to_string(text_limits::kMaxMacroDepth) + " nested calls)");
  ++macro_depth_;
  struct Depth {
    int& d;
    ~Depth() { --d; }
  } guard{macro_depth_};
  auto f = std::make_shared<Frame>(def_frame);
  std::vector<bool> set(m.params.size(), false);
  List varargs;
  for (size_t i = 0; i < args.pos.size(); ++i) {
    if (i < m.params.size()) {
      f->set(m.params[i].first, args.pos[i]);
      set[i] = true;
    } else if (m.uses_varargs) {
      varargs.push_back(args.pos[i]);
    } else {
      throw_error("TypeError", "macro '" + m.name + "' takes not more than " + std::to_string(m.params.size()) +
                                   " argument(s)");
    }
  }
  auto kwargs = std::make_shared<Dict>();
  bool caller_given = false;
  for (auto& [k, v] : args.kw) {
    size_t i = 0;
    while (i < m.params.size() && m.params[i].first != k) ++i;
    if (i < m.params.size()) {
      if (set[i]) throw_error("TypeError", "macro '" + m.name + "' got multiple values for argument '" + k + "'");
      f->set(k, v);
      set[i] = true;
    } else if (k == "caller") {
      f->set("caller", v);
      caller_given = true;
    } else if (m.uses_kwargs) {
      kwargs->items.emplace_back(Value(k), v);
    } else {
      throw_error("TypeError", "macro '" + m.name + "' takes no keyword argument '" + k + "'");
    }
  }
  for (size_t i = 0; i < m.params.size(); ++i) {
    if (set[i]) continue;
    if (m.params[i].second) f->set(m.params[i].first, eval(*m.params[i].second, f));
    else f->set(m.params[i].first, Value::undefined("parameter '" + m.params[i].first + "' was not provided"));
  }
  if (m.uses_varargs) f->set("varargs", Value(std::move(varargs)));
  if (m.uses_kwargs) f->set("kwargs", Value(std::shared_ptr<const Dict>(std::move(kwargs))));
  if (m.uses_caller && !caller_given) f->set("caller", Value::undefined("No caller defined"));
  std::string out;
  exec(m.body, f, out);
  return Value(std::move(out));
}

// ---- expressions ----

void Interp::eval_args(const CallArgs& ca, const FrameP& frame, Args& out) {
  for (const auto& e : ca.pos) out.pos.push_back(eval(*e, frame));
  if (ca.star) {
    for (auto& v : iterate(eval(*ca.star, frame))) out.pos.push_back(std::move(v));
  }
  for (const auto& [k, e] : ca.kw) out.kw.emplace_back(k, eval(*e, frame));
  if (ca.starstar) {
    Value d = eval(*ca.starstar, frame);
    if (!d.is_dict()) throw_error("TypeError", "argument after ** must be a mapping");
    for (const auto& [k, v] : d.dict().items) out.kw.emplace_back(to_str(k), v);
  }
}

Value Interp::call(const Value& fn, Args& args) {
  if (fn.is_function()) return fn.fn().fn(*this, args);
  if (fn.is_undefined()) undefined_error(fn);
  throw_error("TypeError", std::string("'") + type_name(fn) + "' object is not callable");
}

Value Interp::apply_filter(std::string_view name, const Value& v, Args& args) {
  FilterFn f = find_filter(name);
  if (!f) throw_error("TemplateAssertionError", "No filter named '" + std::string(name) + "'.");
  return f(*this, v, args);
}

bool Interp::apply_test(std::string_view name, const Value& v, Args& args) {
  TestFn t = find_test(name);
  if (!t) throw_error("TemplateAssertionError", "No test named '" + std::string(name) + "'.");
  return t(*this, v, args);
}

// A single step can build 64 MB ("a" * 50000000, s | upper), so a loop of a few hundred such
// steps ran for minutes inside the step budget; what an expression builds counts by its size.
// Only the kinds that make a new value count (a name, an attribute, an item, `and`, `or`, `if`
// hand back one that exists).
Value Interp::eval(const Expr& e, const FrameP& frame) {
  Value v = eval_node(e, frame);
  const bool builds = e.kind == Expr::Slice || e.kind == Expr::Call || e.kind == Expr::Filter ||
                      e.kind == Expr::Binary || e.kind == Expr::ListLit || e.kind == Expr::TupleLit;
  if (builds && v.is_string()) charge(int64_t(v.str().size() / 32));
  if (builds && v.is_list()) charge(int64_t(v.list().size()));
  return v;
}

Value Interp::eval_node(const Expr& e, const FrameP& frame) {
  try {
    charge(1);
    RenderDepth depth(render_depth_);
    switch (e.kind) {
      case Expr::Literal: return e.value;
      case Expr::Name: return lookup(e.name, frame);
      case Expr::GetAttr: return getattr(eval(*e.a, frame), e.name);
      case Expr::GetItem: return getitem(eval(*e.a, frame), eval(*e.b, frame));
      case Expr::Slice: {
        Value obj = eval(*e.a, frame);
        Value b = e.b ? eval(*e.b, frame) : Value(None{});
        Value c = e.c ? eval(*e.c, frame) : Value(None{});
        Value d = e.d ? eval(*e.d, frame) : Value(None{});
        return slice(obj, b, c, d);
      }
      case Expr::Call: {
        Value fn = eval(*e.a, frame);
        Args a;
        eval_args(e.args, frame, a);
        return call(fn, a);
      }
      case Expr::Filter: {
        Value v = eval(*e.a, frame);
        Args a;
        eval_args(e.args, frame, a);
        return apply_filter(e.name, v, a);
      }
      case Expr::Test: {
        Value v = eval(*e.a, frame);
        Args a;
        eval_args(e.args, frame, a);
        bool r = apply_test(e.name, v, a);
        return Value(e.negated ? !r : r);
      }
      case Expr::Neg:
      case Expr::Pos: {
        Value v = eval(*e.a, frame);
        require_defined(v);
        if (v.is_float()) return Value(e.kind == Expr::Neg ? -v.real() : v.real());
        if (v.is_number()) return Value(e.kind == Expr::Neg ? checked_int("-", 0, v.as_int()) : v.as_int());
        throw_error("TypeError", std::string("bad operand type for unary ") + (e.kind == Expr::Neg ? "-" : "+") +
                                     ": '" + type_name(v) + "'");
      }
      case Expr::Not: return Value(!truthy(eval(*e.a, frame)));
      case Expr::And: {
        Value a = eval(*e.a, frame);
        if (!truthy(a)) return a;
        return eval(*e.b, frame);
      }
      case Expr::Or: {
        Value a = eval(*e.a, frame);
        if (truthy(a)) return a;
        return eval(*e.b, frame);
      }
      case Expr::Binary: return binary(e.name, eval(*e.a, frame), eval(*e.b, frame));
      case Expr::Compare: {
        Value left = eval(*e.a, frame);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.items[i], frame);
          const std::string& op = e.ops[i];
          // == and < read strings to their first difference, `in` reads the whole container.
          if (op == "in" || op == "not in") charge_scan(right);
          else if (left.is_string() && right.is_string()) charge_scan(std::min(left.str().size(), right.str().size()));
          bool r;
          if (op == "==") r = equals(left, right);
          else if (op == "!=") r = !equals(left, right);
          else if (op == "<") r = less(left, right);
          else if (op == ">") r = less(right, left);
          else if (op == "<=") r = less(left, right) || equals(left, right);
          else if (op == ">=") r = less(right, left) || equals(left, right);
          else if (op == "in") r = contains(right, left);
          else r = !contains(right, left);
          if (!r) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case Expr::CondExpr: {
        if (truthy(eval(*e.b, frame))) return eval(*e.a, frame);
        if (e.c) return eval(*e.c, frame);
        return Value::undefined("the inline if-expression on line " + std::to_string(e.line) +
                                " evaluated to false and no else section was defined.");
      }
      case Expr::ListLit:
      case Expr::TupleLit: {
        List l;
        charge_bytes(e.items.size() * kSlotBytes);
        l.reserve(e.items.size());
        for (const auto& x : e.items) l.push_back(eval(*x, frame));
        return Value(std::move(l));
      }
      case Expr::DictLit: {
        auto d = std::make_shared<Dict>();
        charge_bytes(e.items.size() * kSlotBytes);
        for (size_t i = 0; i + 1 < e.items.size(); i += 2) {
          Value k = eval(*e.items[i], frame);
          Value v = eval(*e.items[i + 1], frame);
          bool replaced = false;
          for (auto& kv : d->items)
            if (equals(kv.first, k)) kv.second = v, replaced = true;
          if (!replaced) d->items.emplace_back(std::move(k), std::move(v));
        }
        return Value(std::shared_ptr<const Dict>(std::move(d)));
      }
    }
  } catch (RenderError& err) {
    if (err.line == 0) err.line = e.line;
    throw;
  }
  return Value();
}

}  // namespace moestream::jinja
