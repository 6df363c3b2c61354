// The evaluator's operators: arithmetic with Python's int semantics on int64 (floor division and
// modulo of negatives, OverflowError where Python's big ints would not fit), string and list
// concatenation and repetition within text_limits, printf-style %, and slicing.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "text/jinja_interp.h"
#include "text/limits.h"

namespace moestream::jinja {

namespace {

int64_t py_floordiv(int64_t a, int64_t b) {
  if (b == -1) {  // INT64_MIN / -1 traps
    if (a == INT64_MIN)
      throw_error("OverflowError", std::to_string(a) + " // -1 does not fit in a 64-bit integer");
    return -a;
  }
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

int64_t py_mod(int64_t a, int64_t b) {
  if (b == -1) return 0;
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

}  // namespace

void require_defined(const Value& v) {
  if (v.is_undefined()) undefined_error(v);
}

int64_t checked_int(const char* op, int64_t a, int64_t b) {
  int64_t r = 0;
  bool over = false;
  switch (op[0]) {
    case '+': over = __builtin_add_overflow(a, b, &r); break;
    case '-': over = __builtin_sub_overflow(a, b, &r); break;
    case '*':
      if (op[1] != '*') {
        over = __builtin_mul_overflow(a, b, &r);
        break;
      }
      // a ** b (b >= 0) by squaring: 64 steps at most. A square is only taken when a higher bit
      // of b needs it, so it overflows only when the result does.
      r = 1;
      for (int64_t base = a, e = b; e > 0 && !over;) {
        if (e & 1) over = __builtin_mul_overflow(r, base, &r);
        e >>= 1;
        if (e > 0 && !over) over = __builtin_mul_overflow(base, base, &base);
      }
      break;
  }
  if (over)
    throw_error("OverflowError", std::to_string(a) + " " + op + " " + std::to_string(b) +
                                     " does not fit in a 64-bit integer (moestream's templates use int64)");
  return r;
}

int64_t float_to_int(double x) {
  if (std::isnan(x)) throw_error("ValueError", "cannot convert float NaN to integer");
  double t = std::trunc(x);
  if (!(t >= -9223372036854775808.0 && t < 9223372036854775808.0))
    throw_error("OverflowError", "float " + float_repr(x) + " does not fit in a 64-bit integer");
  return int64_t(t);
}

Value Interp::binary(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") {
    std::string r = a.is_string() ? a.str() : to_str(a);
    if (b.is_string()) {
      will_append(r, b.str().size());
      r += b.str();
    } else {
      const std::string y = to_str(b);
      will_append(r, y.size());
      r += y;
    }
    return Value(std::move(r));
  }
  require_defined(a);
  require_defined(b);
  auto unsupported = [&]() -> Value {
    throw_error("TypeError", "unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" +
                                 type_name(b) + "'");
  };
  char c = op[0];
  if (a.is_number() && b.is_number()) {
    bool fl = a.is_float() || b.is_float();
    if (op == "/") {
      if (b.as_double() == 0) throw_error("ZeroDivisionError", "division by zero");
      return Value(a.as_double() / b.as_double());
    }
    if (op == "**") {
      if (!fl && b.as_int() >= 0) return Value(checked_int("**", a.as_int(), b.as_int()));
      return Value(std::pow(a.as_double(), b.as_double()));
    }
    if (fl) {
      double x = a.as_double(), y = b.as_double();
      switch (c) {
        case '+': return Value(x + y);
        case '-': return Value(x - y);
        case '*': return Value(x * y);
        case '%': {
          if (y == 0) throw_error("ZeroDivisionError", "float modulo");
          double r = std::fmod(x, y);
          if (r != 0 && ((r < 0) != (y < 0))) r += y;
          return Value(r);
        }
        default:  // "//"
          if (y == 0) throw_error("ZeroDivisionError", "float floor division by zero");
          return Value(std::floor(x / y));
      }
    }
    int64_t x = a.as_int(), y = b.as_int();
    switch (c) {
      case '+':
      case '-':
      case '*': return Value(checked_int(op.c_str(), x, y));
      case '%':
        if (y == 0) throw_error("ZeroDivisionError", "integer modulo by zero");
        return Value(py_mod(x, y));
      default:
        if (y == 0) throw_error("ZeroDivisionError", "integer division or modulo by zero");
        return Value(py_floordiv(x, y));
    }
  }
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      check_string_size(a.str().size() + b.str().size());
      charge_bytes(a.str().size() + b.str().size());
      return Value(a.str() + b.str());
    }
    if (a.is_list() && b.is_list()) {
      check_list_size(a.list().size() + b.list().size());
      charge_bytes((a.list().size() + b.list().size()) * kSlotBytes);
      List l = a.list();
      l.insert(l.end(), b.list().begin(), b.list().end());
      return Value(std::move(l));
    }
    if (a.is_string())
      throw_error("TypeError", std::string("can only concatenate str (not \"") + type_name(b) + "\") to str");
    if (a.is_list())
      throw_error("TypeError", std::string("can only concatenate list (not \"") + type_name(b) + "\") to list");
    return unsupported();
  }
  if (op == "*") {
    const Value* seq = a.is_number() ? &b : &a;
    const Value* cnt = a.is_number() ? &a : &b;
    if (cnt->is_number() && !cnt->is_float() && (seq->is_string() || seq->is_list())) {
      const int64_t n = std::max<int64_t>(0, cnt->as_int());
      const size_t unit = seq->is_string() ? seq->str().size() : seq->list().size();
      if (unit > 0 && uint64_t(n) > (seq->is_string() ? text_limits::kMaxStringBytes : text_limits::kMaxListItems) / unit) {
        if (seq->is_string()) throw_error("MemoryError", "repeating a string of " + std::to_string(unit) + " bytes " +
                                                          std::to_string(n) + " times is over the limit of " +
                                                          std::to_string(text_limits::kMaxStringBytes) + " bytes");
        throw_error("MemoryError", "repeating a list of " + std::to_string(unit) + " items " + std::to_string(n) +
                                       " times is over the limit of " + std::to_string(text_limits::kMaxListItems) +
                                       " items");
      }
      if (unit == 0) return seq->is_string() ? Value(std::string()) : Value(List{});
      charge_bytes(unit * size_t(n) * (seq->is_string() ? 1 : kSlotBytes));
      if (seq->is_string()) {
        // By doubling: one append per copy took 50M appends for "a" * 50000000.
        const size_t total = unit * size_t(n);
        if (total == 0) return Value(std::string());
        std::string r;
        r.reserve(total);
        r += seq->str();
        while (r.size() < total) r.append(r, 0, std::min(r.size(), total - r.size()));
        return Value(std::move(r));
      }
      List r;
      r.reserve(unit * size_t(n));
      for (int64_t k = 0; k < n; ++k) r.insert(r.end(), seq->list().begin(), seq->list().end());
      return Value(std::move(r));
    }
    return unsupported();
  }
  if (op == "%" && a.is_string()) {
    return Value(percent_format(a.str(), b.is_list() ? b.list() : std::vector<Value>{b}, false));
  }
  return unsupported();
}

Value Interp::slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.is_undefined()) undefined_error(obj);
  if (!obj.is_list() && !obj.is_string()) return Value::undefined(object_type_repr(obj) + " has no element slice");
  auto idx = [](const Value& v, bool& given) -> int64_t {
    given = !(v.is_none() || v.is_undefined());
    if (!given) return 0;
    if (!v.is_int() && !v.is_bool()) throw_error("TypeError", "slice indices must be integers or None");
    return v.as_int();
  };
  bool has_start, has_stop, has_step;
  int64_t st = idx(step, has_step);
  if (!has_step) st = 1;
  if (st == 0) throw_error("ValueError", "slice step cannot be zero");
  int64_t b = idx(start, has_start), e = idx(stop, has_stop);
  bool ascii = true;
  if (obj.is_string())
    for (unsigned char ch : obj.str()) ascii = ascii && ch < 0x80;
  int64_t n = obj.is_list() ? int64_t(obj.list().size()) : ascii ? int64_t(obj.str().size()) : int64_t(cp_split_count(obj.str()));
  // Python's PySlice_AdjustIndices.
  if (!has_start) b = st < 0 ? n - 1 : 0;
  else if (b < 0) b = std::max<int64_t>(b + n, st < 0 ? -1 : 0);
  else if (b >= n) b = st < 0 ? n - 1 : n;
  if (!has_stop) e = st < 0 ? -1 : n;
  else if (e < 0) e = std::max<int64_t>(e + n, st < 0 ? -1 : 0);
  else if (e >= n) e = st < 0 ? n - 1 : n;
  // The indices b, b + st, ... before e; a step past the end of int64 is past e too.
  auto next = [&](int64_t& i) { return !__builtin_add_overflow(i, st, &i) && (st > 0 ? i < e : i > e); };
  bool any = st > 0 ? b < e : b > e;
  // The items taken: at most n, charged before they are copied.
  const uint64_t taken = !any ? 0 : st > 0 ? uint64_t(e - b - 1) / uint64_t(st) + 1 : uint64_t(b - e - 1) / (0 - uint64_t(st)) + 1;
  if (obj.is_list()) {
    charge_bytes(taken * kSlotBytes);
    List r;
    r.reserve(taken);
    for (int64_t i = b; any; any = next(i)) r.push_back(obj.list()[size_t(i)]);
    return Value(std::move(r));
  }
  std::string r;
  charge_bytes(ascii ? taken : std::min<uint64_t>(obj.str().size(), taken * 4));
  if (ascii && st == 1) return Value(b < e ? obj.str().substr(size_t(b), size_t(e - b)) : std::string());
  if (st == 1) {  // s[b:e] of UTF-8: the byte offsets of b and e, no table of code points
    if (b >= e) return Value(std::string());
    const std::string& str = obj.str();
    size_t pos = 0;
    for (int64_t k = 0; k < b; ++k) decode(str, pos);
    const size_t from = pos;
    for (int64_t k = b; k < e; ++k) decode(str, pos);
    return Value(str.substr(from, pos - from));
  }
  std::vector<std::string_view> cps;
  if (!ascii) cps = cp_split(obj.str());
  for (int64_t i = b; any; any = next(i)) {
    if (ascii) r += obj.str()[size_t(i)];
    else r += cps[size_t(i)];
  }
  return Value(std::move(r));
}

}  // namespace moestream::jinja
