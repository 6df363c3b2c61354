// The evaluator of the Jinja interpreter (internal): scopes, statements, expressions, and the
// builtin filters, tests, globals and methods (jinja_builtins.cpp) it calls.
#pragma once

#include <ctime>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "text/jinja_ast.h"
#include "text/jinja_value.h"

namespace moestream::jinja {

// A scope: a loop iteration, a macro call, the template's top level, the render variables, the
// globals. Lookups walk the parents.
struct Frame {
  std::shared_ptr<Frame> parent;
  std::vector<std::pair<std::string, Value>> vars;
  explicit Frame(std::shared_ptr<Frame> p) : parent(std::move(p)) {}
  Value* find_local(std::string_view name) {
    for (auto& [k, v] : vars)
      if (k == name) return &v;
    return nullptr;
  }
  void set(std::string_view name, Value v) {
    if (Value* p = find_local(name)) *p = std::move(v);
    else vars.emplace_back(std::string(name), std::move(v));
  }
};
using FrameP = std::shared_ptr<Frame>;

class Interp {
 public:
  Interp(std::time_t now, int64_t max_steps) : now_(now), max_steps_(max_steps) {}

  void render(const Body& body, const FrameP& frame, std::string& out);
  Value eval(const Expr& e, const FrameP& frame);
  Value call(const Value& fn, Args& args);
  Value apply_filter(std::string_view name, const Value& v, Args& args);
  bool apply_test(std::string_view name, const Value& v, Args& args);
  std::time_t now() const { return now_; }
  // Counts `steps` toward the render's budget (RenderOptions::max_steps): evaluations count one
  // each, and builtins that do work in proportion to a size (range) count that size. eval also
  // counts the strings (a step per 32 bytes) and lists (a step per item) an expression builds.
  void charge(int64_t steps);
  // A step per 32 bytes (or per item) that a builtin reads without building anything (length,
  // `in`, ==, find): `s | length` of a 60 MB string in a loop of 100,000 ran for half an hour.
  void charge_scan(size_t bytes) { charge(int64_t(bytes / 32)); }
  void charge_scan(const Value& v);  // a string's bytes, a list's or dict's items (32 each)

  // Python/jinja2 object protocol.
  Value getattr(const Value& obj, std::string_view name);
  Value getitem(const Value& obj, const Value& key);
  static std::vector<Value> iterate(const Value& v);  // list(v); TypeError when not iterable
  static bool contains(const Value& container, const Value& item);

 private:
  Value eval_node(const Expr& e, const FrameP& frame);  // eval without the size charge
  enum class Flow { Normal, Break, Continue };
  Flow exec(const Body& body, const FrameP& frame, std::string& out);
  Flow exec_stmt(const Stmt& s, const FrameP& frame, std::string& out);
  void exec_for(const Stmt& s, const FrameP& frame, std::string& out);
  void assign(const Target& t, Value v, const FrameP& frame);
  Value lookup(const std::string& name, const FrameP& frame);
  Value make_macro(std::shared_ptr<const MacroDef> m, const FrameP& frame);
  Value call_macro(const MacroDef& m, const FrameP& def_frame, Args& args);
  void eval_args(const CallArgs& ca, const FrameP& frame, Args& out);
  Value binary(const std::string& op, const Value& a, const Value& b);
  Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);
  std::time_t now_;
  int macro_depth_ = 0;   // macro calls in progress
  int render_depth_ = 0;  // eval and exec_stmt frames in progress
  int64_t max_steps_;
  int64_t render_steps_ = 0;  // steps so far in this render (charge)
};

// Python's int arithmetic on int64: OverflowError instead of wrapping ("+", "-", "*", "**", ...).
int64_t checked_int(const char* op, int64_t a, int64_t b);
// Raises UndefinedError (SecurityError for the sandbox's unsafe methods) naming v.
[[noreturn]] void undefined_error(const Value& v);
void require_defined(const Value& v);  // undefined_error(v) when v is Undefined
// "dict object", "None": the object in jinja2's messages.
std::string object_type_repr(const Value& v);
// int(x) of a float: ValueError for NaN, OverflowError outside int64.
int64_t float_to_int(double x);


// Builtins (jinja_builtins.cpp).
using FilterFn = Value (*)(Interp&, const Value&, Args&);
using TestFn = bool (*)(Interp&, const Value&, Args&);
FilterFn find_filter(std::string_view name);
TestFn find_test(std::string_view name);
// Whether a str, dict or list value has the Python method `name`, and calling it.
bool has_method(const Value& obj, std::string_view name);
// Mutating methods (list.append, dict.update, ...): the sandbox transformers renders in makes them
// an Undefined that raises when used.
bool is_unsafe_method(const Value& obj, std::string_view name);
Value call_method(Interp& in, const Value& obj, std::string_view name, Args& args);
// The frame of globals: range, namespace, dict, raise_exception, strftime_now, cycler, joiner.
FrameP make_globals();

}  // namespace moestream::jinja
