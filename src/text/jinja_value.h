// Values of the Jinja interpreter (internal to src/text/jinja*.cpp): the Python objects a chat
// template sees, with Python's semantics where the output depends on them: str() and repr() of
// every type (floats as Python's repr, dicts as {'a': 1}), json.dumps, truthiness, ==, <, and
// Jinja's Undefined. Lists and dicts are immutable once built (the sandbox transformers renders in
// forbids mutating them), so values share them by reference; only namespace() objects mutate.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "core/strings.h"

namespace moestream::jinja {

struct Value;
struct Args;
class Interp;

// Errors raised while rendering; `type` is the Python exception jinja2 would raise
// (TemplateError for raise_exception, UndefinedError, TypeError, ...).
struct RenderError {
  std::string type, message;
  int line = 0;
};
[[noreturn]] void throw_error(std::string type, std::string message);
// Throw MemoryError when a string or list the template builds would pass text_limits.
void check_string_size(size_t bytes);
void check_list_size(size_t items);

// The render's budget of bytes built (RenderOptions::max_bytes, text_limits::kMaxRenderBytes):
// every builder charges what it is about to build BEFORE it builds it, so that no template makes
// a value beyond the budget first (a chain of joins multiplies a string's length at every link).
// The budget belongs to the thread running the render (ByteBudget); outside a render nothing is
// counted. Throws MemoryError naming the budget when a charge passes it.
void charge_bytes(uint64_t bytes);
// check_string_size(out.size() + n), then charge_bytes(n): before a builder appends n bytes.
void will_append(const std::string& out, size_t n);
// Opens the byte budget of a render on this thread for its lifetime.
class ByteBudget {
 public:
  explicit ByteBudget(uint64_t max_bytes);
  ~ByteBudget();
  ByteBudget(const ByteBudget&) = delete;
  ByteBudget& operator=(const ByteBudget&) = delete;

 private:
  uint64_t used_ = 0, max_;
  ByteBudget* outer_;
  friend void charge_bytes(uint64_t bytes);
};

struct Undefined {
  std::shared_ptr<const std::string> hint;  // "'x' is undefined", "'dict object' has no attribute 'y'"
};
struct None {};
using List = std::vector<Value>;
struct Dict;
struct Namespace;
struct Function {
  std::string name;
  std::function<Value(Interp&, Args&)> fn;
  std::vector<Value> bound;  // values fn uses (a method's object), held here so ~Value can reach them
};

struct Value {
  using Storage = std::variant<Undefined, None, bool, int64_t, double, std::shared_ptr<const std::string>,
                               std::shared_ptr<const List>, std::shared_ptr<const Dict>, std::shared_ptr<Namespace>,
                               std::shared_ptr<const Function>>;
  Storage v;

  Value() = default;
  Value(const Value&) = default;
  Value(Value&&) noexcept = default;
  Value& operator=(const Value&) = default;
  Value& operator=(Value&&) noexcept = default;
  // A template can chain values far deeper than the stack (ns.x = [ns.x] in a loop): the last
  // owner of a container hands its containers to a loop instead of destroying them recursively.
  ~Value() {
    if (v.index() >= 6) release();
  }
  Value(None) : v(None{}) {}
  Value(bool b) : v(b) {}
  Value(int64_t i) : v(i) {}
  Value(int i) : v(int64_t(i)) {}
  Value(double d) : v(d) {}
  Value(std::string s) : v(std::make_shared<const std::string>(std::move(s))) {}
  Value(const char* s) : Value(std::string(s)) {}
  Value(List l) : v(std::shared_ptr<const List>(std::make_shared<List>(std::move(l)))) {}
  Value(std::shared_ptr<const List> l) : v(std::move(l)) {}
  Value(std::shared_ptr<const Dict> d) : v(std::move(d)) {}
  Value(std::shared_ptr<Namespace> n) : v(std::move(n)) {}
  Value(std::shared_ptr<const Function> f) : v(std::move(f)) {}
  static Value undefined(std::string hint = {}) {
    Value r;
    if (!hint.empty()) r.v = Undefined{std::make_shared<const std::string>(std::move(hint))};
    return r;
  }
  static Value function(std::string name, std::function<Value(Interp&, Args&)> fn) {
    return Value(std::make_shared<const Function>(Function{std::move(name), std::move(fn)}));
  }

  bool is_undefined() const { return std::holds_alternative<Undefined>(v); }
  bool is_none() const { return std::holds_alternative<None>(v); }
  bool is_bool() const { return std::holds_alternative<bool>(v); }
  bool is_int() const { return std::holds_alternative<int64_t>(v); }  // not bool
  bool is_float() const { return std::holds_alternative<double>(v); }
  bool is_number() const { return is_int() || is_float() || is_bool(); }
  bool is_string() const { return std::holds_alternative<std::shared_ptr<const std::string>>(v); }
  bool is_list() const { return std::holds_alternative<std::shared_ptr<const List>>(v); }
  bool is_dict() const { return std::holds_alternative<std::shared_ptr<const Dict>>(v); }
  bool is_namespace() const { return std::holds_alternative<std::shared_ptr<Namespace>>(v); }
  bool is_function() const { return std::holds_alternative<std::shared_ptr<const Function>>(v); }

  const std::string& str() const { return *std::get<std::shared_ptr<const std::string>>(v); }
  const List& list() const { return *std::get<std::shared_ptr<const List>>(v); }
  const Dict& dict() const { return *std::get<std::shared_ptr<const Dict>>(v); }
  Namespace& ns() const { return *std::get<std::shared_ptr<Namespace>>(v); }
  const Function& fn() const { return *std::get<std::shared_ptr<const Function>>(v); }
  bool boolean() const { return std::get<bool>(v); }
  int64_t integer() const { return std::get<int64_t>(v); }
  double real() const { return std::get<double>(v); }
  // Python int value of an int or bool.
  int64_t as_int() const { return is_bool() ? int64_t(boolean()) : integer(); }
  double as_double() const { return is_float() ? real() : double(as_int()); }
  std::string undefined_hint() const;

 private:
  void release() noexcept;
};

// What charge_bytes counts for an item of a list or dict besides its text: its slot, and the heap
// block of a string made for it (shared_ptr control block and std::string, with malloc's rounding).
inline constexpr uint64_t kSlotBytes = sizeof(Value);
inline constexpr uint64_t kNewStringBytes = 64;

// A dict keeps insertion order (Python 3.7+ dicts, json.loads); keys are values (strings in JSON).
struct Dict {
  std::vector<std::pair<Value, Value>> items;
  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
};

// namespace(): the one mutable object ({% set ns.x = ... %}).
struct Namespace {
  std::vector<std::pair<std::string, Value>> attrs;
  Value* find(std::string_view key);
};

// Call arguments: positional, then keyword.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  // Binds to parameters (name, default; a default of nullptr means required) as Python would;
  // throws TypeError naming `fname` on missing/unknown/duplicate arguments.
  std::vector<Value> bind(std::string_view fname,
                          const std::vector<std::pair<std::string, const Value*>>& params) const;
};

const char* type_name(const Value& v);  // Python type name: 'str', 'int', 'dict', 'NoneType', ...

bool truthy(const Value& v);
bool equals(const Value& a, const Value& b);
// Python a < b; throws TypeError for unorderable types.
bool less(const Value& a, const Value& b);

std::string to_str(const Value& v);   // Python str(); Undefined -> ""
std::string to_repr(const Value& v);  // Python repr()
// Python's printf-style `f % args` for %s, %r, %d, %i and %%; with all_used, arguments left over
// are a TypeError too (the format filter's rule; the % operator does not check it).
std::string percent_format(const std::string& f, const std::vector<Value>& args, bool all_used);
std::string float_repr(double d);
std::string str_repr(std::string_view s);

struct DumpOptions {
  bool ensure_ascii = false;
  bool sort_keys = false;
  std::string item_sep = ", ", key_sep = ": ";
  bool has_indent = false;
  std::string indent;
};
std::string json_dumps(const Value& v, const DumpOptions& o);

Value from_json(const nlohmann::ordered_json& j);

// UTF-8 code point helpers (Python strings index by code point).
size_t cp_count(std::string_view s);
std::vector<std::string_view> cp_split(std::string_view s);
// cp_split(s).size() without the table (decode's count, which differs from cp_count on bad UTF-8).
size_t cp_split_count(std::string_view s);
bool py_isspace(char32_t c);
char32_t decode(std::string_view s, size_t& i);  // next code point; advances i (tolerates bad UTF-8)
inline void append_cp(std::string& out, char32_t cp) { append_utf8(out, cp); }

}  // namespace moestream::jinja
