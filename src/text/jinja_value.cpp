// Python semantics of the interpreter's values: str(), repr(), json.dumps, ==, <, truthiness.
#include <utf8proc.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "text/jinja_interp.h"  // float_to_int
#include "text/jinja_value.h"
#include "text/limits.h"

namespace moestream::jinja {

void throw_error(std::string type, std::string message) { throw RenderError{std::move(type), std::move(message), 0}; }

namespace {

// Containers entered by the recursive walks below (print, compare, serialize, convert), per
// thread: one counter whichever walk calls which (a dict lookup inside ==, ...).
thread_local int value_depth = 0;

struct Nested {
  Nested() {
    if (++value_depth > text_limits::kMaxValueDepth) {
      --value_depth;
      throw_error("RecursionError", "value is nested more than " + std::to_string(text_limits::kMaxValueDepth) +
                                        " levels deep");
    }
  }
  ~Nested() { --value_depth; }
  Nested(const Nested&) = delete;
  Nested& operator=(const Nested&) = delete;
};

// Moves the containers held by x's container into `out` when x is its last owner.
void take_children(Value& x, std::vector<Value>& out) {
  auto keep = [&](Value& c) {
    if (c.v.index() >= 6) out.push_back(std::move(c));
  };
  // Every container is created non-const (make_shared<List>, <Dict>, ...) and only shared as
  // const, so its last owner may empty it.
  if (auto* l = std::get_if<std::shared_ptr<const List>>(&x.v)) {
    if (*l && l->use_count() == 1)
      for (Value& c : const_cast<List&>(**l)) keep(c);
  } else if (auto* d = std::get_if<std::shared_ptr<const Dict>>(&x.v)) {
    if (*d && d->use_count() == 1)
      for (auto& [k, c] : const_cast<Dict&>(**d).items) keep(k), keep(c);
  } else if (auto* n = std::get_if<std::shared_ptr<Namespace>>(&x.v)) {
    if (*n && n->use_count() == 1)
      for (auto& [k, c] : (*n)->attrs) keep(c);
  } else if (auto* f = std::get_if<std::shared_ptr<const Function>>(&x.v)) {
    if (*f && f->use_count() == 1)
      for (Value& c : const_cast<Function&>(**f).bound) keep(c);
  }
}

}  // namespace

void Value::release() noexcept {
  thread_local std::vector<Value>* pending = nullptr;
  if (pending) {  // inside the loop below: just hand over
    take_children(*this, *pending);
    return;
  }
  std::vector<Value> queue;
  pending = &queue;
  take_children(*this, queue);
  while (!queue.empty()) {
    Value x = std::move(queue.back());
    queue.pop_back();
  }  // each x's destructor moves its own children into the queue
  pending = nullptr;
}

void check_string_size(size_t bytes) {
  if (bytes > text_limits::kMaxStringBytes)
    throw_error("MemoryError", "string of " + std::to_string(bytes) + " bytes is over the limit of " +
                                   std::to_string(text_limits::kMaxStringBytes) + " bytes");
}

void check_list_size(size_t items) {
  if (items > text_limits::kMaxListItems)
    throw_error("MemoryError", "list of " + std::to_string(items) + " items is over the limit of " +
                                   std::to_string(text_limits::kMaxListItems) + " items");
}

namespace {
thread_local ByteBudget* byte_budget = nullptr;
}  // namespace

ByteBudget::ByteBudget(uint64_t max_bytes) : max_(max_bytes), outer_(byte_budget) { byte_budget = this; }
ByteBudget::~ByteBudget() { byte_budget = outer_; }

void charge_bytes(uint64_t bytes) {
  ByteBudget* b = byte_budget;
  if (!b) return;
  if (bytes > b->max_ - b->used_)
    throw_error("MemoryError", "render stopped: the template builds more than " + std::to_string(b->max_) +
                                   " bytes of strings and lists");
  b->used_ += bytes;
}

void will_append(const std::string& out, size_t n) {
  check_string_size(n > SIZE_MAX - out.size() ? SIZE_MAX : out.size() + n);
  charge_bytes(n);
}

std::string Value::undefined_hint() const {
  const auto& u = std::get<Undefined>(v);
  return u.hint ? *u.hint : std::string("value is undefined");
}

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, val] : items)
    if (k.is_string() && k.str() == key) return &val;
  return nullptr;
}

const Value* Dict::find(const Value& key) const {
  if (key.is_string()) return find(std::string_view(key.str()));
  for (const auto& [k, val] : items)
    if (equals(k, key)) return &val;
  return nullptr;
}

Value* Namespace::find(std::string_view key) {
  for (auto& [k, val] : attrs)
    if (k == key) return &val;
  return nullptr;
}

std::vector<Value> Args::bind(std::string_view fname,
                              const std::vector<std::pair<std::string, const Value*>>& params) const {
  std::vector<Value> out(params.size());
  std::vector<bool> set(params.size(), false);
  if (pos.size() > params.size())
    throw_error("TypeError", std::string(fname) + "() takes at most " + std::to_string(params.size()) +
                                 " arguments (" + std::to_string(pos.size()) + " given)");
  for (size_t i = 0; i < pos.size(); ++i) out[i] = pos[i], set[i] = true;
  for (const auto& [k, val] : kw) {
    size_t i = 0;
    while (i < params.size() && params[i].first != k) ++i;
    if (i == params.size())
      throw_error("TypeError", std::string(fname) + "() got an unexpected keyword argument '" + k + "'");
    if (set[i]) throw_error("TypeError", std::string(fname) + "() got multiple values for argument '" + k + "'");
    out[i] = val, set[i] = true;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (set[i]) continue;
    if (!params[i].second)
      throw_error("TypeError", std::string(fname) + "() missing required argument '" + params[i].first + "'");
    out[i] = *params[i].second;
  }
  return out;
}

const char* type_name(const Value& v) {
  switch (v.v.index()) {
    case 0: return "Undefined";
    case 1: return "NoneType";
    case 2: return "bool";
    case 3: return "int";
    case 4: return "float";
    case 5: return "str";
    case 6: return "list";
    case 7: return "dict";
    case 8: return "Namespace";
    default: return "function";
  }
}

bool truthy(const Value& v) {
  switch (v.v.index()) {
    case 0:
    case 1: return false;
    case 2: return v.boolean();
    case 3: return v.integer() != 0;
    case 4: return v.real() != 0.0;
    case 5: return !v.str().empty();
    case 6: return !v.list().empty();
    case 7: return !v.dict().items.empty();
    default: return true;
  }
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.v.index() != b.v.index()) return false;
  switch (a.v.index()) {
    case 0:
    case 1: return true;
    case 5: return a.str() == b.str();
    case 6: {
      Nested nested;
      const List &x = a.list(), &y = b.list();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!equals(x[i], y[i])) return false;
      return true;
    }
    case 7: {
      Nested nested;
      const Dict &x = a.dict(), &y = b.dict();
      if (x.items.size() != y.items.size()) return false;
      for (const auto& [k, val] : x.items) {
        const Value* o = y.find(k);
        if (!o || !equals(val, *o)) return false;
      }
      return true;
    }
    case 8: return &a.ns() == &b.ns();
    case 9: return &a.fn() == &b.fn();
  }
  return false;
}

bool less(const Value& a, const Value& b) {
  if (a.is_undefined() || b.is_undefined())
    throw_error("UndefinedError", (a.is_undefined() ? a : b).undefined_hint());
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() < b.as_double();
    return a.as_int() < b.as_int();
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str();  // UTF-8 byte order == code point order
  if (a.is_list() && b.is_list()) {
    Nested nested;
    const List &x = a.list(), &y = b.list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (equals(x[i], y[i])) continue;
      return less(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  throw_error("TypeError", std::string("'<' not supported between instances of '") + type_name(a) + "' and '" +
                               type_name(b) + "'");
}

// ---- UTF-8 ----

char32_t decode(std::string_view s, size_t& i) {
  auto c = static_cast<unsigned char>(s[i]);
  size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (len == 1 || i + len > s.size()) {
    ++i;
    return c;
  }
  char32_t cp = c & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += len;
  return cp;
}

size_t cp_count(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

std::vector<std::string_view> cp_split(std::string_view s) {
  std::vector<std::string_view> out;
  charge_bytes(s.size() * sizeof(std::string_view));
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    size_t start = i;
    decode(s, i);
    out.push_back(s.substr(start, i - start));
  }
  return out;
}

size_t cp_split_count(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size(); ++n) decode(s, i);
  return n;
}

bool py_isspace(char32_t c) {
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F);
  if (c == 0x85) return true;
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_ZS || cat == UTF8PROC_CATEGORY_ZL || cat == UTF8PROC_CATEGORY_ZP;
}

std::string percent_format(const std::string& f, const std::vector<Value>& args, bool all_used) {
  std::string r;
  size_t k = 0;
  auto put = [&r](std::string_view x) {
    will_append(r, x.size());
    r += x;
  };
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] != '%' || i + 1 >= f.size()) {
      const size_t e = std::min(f.find('%', i + 1), f.size());  // the text up to the next %
      put(std::string_view(f).substr(i, e - i));
      i = e - 1;
      continue;
    }
    char t = f[++i];
    if (t == '%') {
      put("%");
      continue;
    }
    if (k >= args.size()) throw_error("TypeError", "not enough arguments for format string");
    const Value& x = args[k++];
    if (t == 's') put(x.is_string() ? x.str() : to_str(x));
    else if (t == 'r') put(to_repr(x));
    else if ((t == 'd' || t == 'i') && x.is_number()) put(std::to_string(x.is_float() ? float_to_int(x.real()) : x.as_int()));
    else throw_error("TypeError", "unsupported format character");
  }
  if (all_used && k < args.size()) throw_error("TypeError", "not all arguments converted during string formatting");
  return r;
}

// ---- str() / repr() ----

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // e.g. "-1.2345e+17" (shortest round-trip digits)
  bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  size_t epos = sci.find('e');
  int exp = std::stoi(sci.substr(epos + 1));
  std::string digits;
  for (size_t i = 0; i < epos; ++i)
    if (sci[i] != '.') digits += sci[i];
  std::string out = neg ? "-" : "";
  if (exp >= -5 + 1 && exp < 16) {  // Python repr: fixed notation when -4 <= exp < 16
    if (exp >= 0) {
      if (digits.size() <= size_t(exp) + 1) {
        out += digits + std::string(size_t(exp) + 1 - digits.size(), '0') + ".0";
      } else {
        out += digits.substr(0, size_t(exp) + 1) + "." + digits.substr(size_t(exp) + 1);
      }
    } else {
      out += "0." + std::string(size_t(-exp - 1), '0') + digits;
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    out += eb;
  }
  return out;
}

static bool py_isprintable(char32_t c) {
  if (c < 0x80) return c >= 0x20 && c < 0x7F;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS: return false;
    default: return true;
  }
}

// repr(s) appended to out; printable runs are appended whole, each append charged before it.
static void str_repr_into(std::string& out, std::string_view s) {
  char quote = '\'';
  if (s.find('\'') != std::string_view::npos && s.find('"') == std::string_view::npos) quote = '"';
  auto put = [&out](std::string_view x) {
    will_append(out, x.size());
    out += x;
  };
  put(std::string_view(&quote, 1));
  size_t i = 0, run = 0;  // s[run, start) is printable and not yet appended
  while (i < s.size()) {
    size_t start = i;
    char32_t c = decode(s, i);
    if (py_isprintable(c) && c != static_cast<char32_t>(quote) && c != '\\') continue;
    put(s.substr(run, start - run));
    run = i;
    char buf[16];
    if (c == static_cast<char32_t>(quote) || c == '\\')
      buf[0] = '\\', buf[1] = static_cast<char>(c), buf[2] = 0;
    else if (c == '\t')
      std::snprintf(buf, sizeof buf, "\\t");
    else if (c == '\n')
      std::snprintf(buf, sizeof buf, "\\n");
    else if (c == '\r')
      std::snprintf(buf, sizeof buf, "\\r");
    else if (c < 0x100)
      std::snprintf(buf, sizeof buf, "\\x%02x", unsigned(c));
    else if (c < 0x10000)
      std::snprintf(buf, sizeof buf, "\\u%04x", unsigned(c));
    else
      std::snprintf(buf, sizeof buf, "\\U%08x", unsigned(c));
    put(buf);
  }
  put(s.substr(run));
  put(std::string_view(&quote, 1));
}

std::string str_repr(std::string_view s) {
  std::string out;
  str_repr_into(out, s);
  return out;
}

static void repr_into(std::string& out, const Value& v);

// Appends x to out, charged before. A list holding one big string many times, or lists of such
// lists, prints to far more than the values hold: every piece is charged before it is appended.
static void put(std::string& out, std::string_view x) {
  will_append(out, x.size());
  out += x;
}

static void str_into(std::string& out, const Value& v) {
  switch (v.v.index()) {
    case 0: return;
    case 1: put(out, "None"); return;
    case 2: put(out, v.boolean() ? "True" : "False"); return;
    case 3: put(out, std::to_string(v.integer())); return;
    case 4: put(out, float_repr(v.real())); return;
    case 5: put(out, v.str()); return;
    default: repr_into(out, v);
  }
}

static void repr_into(std::string& out, const Value& v) {
  switch (v.v.index()) {
    case 0: put(out, "Undefined"); return;
    case 5: str_repr_into(out, v.str()); return;
    case 6: {
      Nested nested;
      put(out, "[");
      bool first = true;
      for (const auto& x : v.list()) {
        if (!first) put(out, ", ");
        first = false;
        repr_into(out, x);
      }
      put(out, "]");
      return;
    }
    case 7: {
      Nested nested;
      put(out, "{");
      bool first = true;
      for (const auto& [k, x] : v.dict().items) {
        if (!first) put(out, ", ");
        first = false;
        repr_into(out, k);
        put(out, ": ");
        repr_into(out, x);
      }
      put(out, "}");
      return;
    }
    case 8: {
      Nested nested;
      put(out, "<Namespace {");
      bool first = true;
      for (const auto& [k, x] : v.ns().attrs) {
        if (!first) put(out, ", ");
        first = false;
        str_repr_into(out, k);
        put(out, ": ");
        repr_into(out, x);
      }
      put(out, "}>");
      return;
    }
    case 9: put(out, "<function " + v.fn().name + ">"); return;
    default: str_into(out, v);
  }
}

std::string to_str(const Value& v) {
  if (v.is_string()) return v.str();
  std::string out;
  str_into(out, v);
  return out;
}

std::string to_repr(const Value& v) {
  std::string out;
  repr_into(out, v);
  return out;
}

// ---- json.dumps ----

static void json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  put(out, "\"");
  size_t i = 0, run = 0;  // s[run, start) needs no escape and is not yet appended
  while (i < s.size()) {
    size_t start = i;
    char32_t c = decode(s, i);
    const char* esc = c == '"' ? "\\\"" : c == '\\' ? "\\\\" : c == '\n' ? "\\n" : c == '\r' ? "\\r"
                    : c == '\t' ? "\\t" : c == '\b' ? "\\b" : c == '\f' ? "\\f" : nullptr;
    if (!esc && !(c < 0x20 || (ensure_ascii && c >= 0x7F))) continue;
    put(out, s.substr(run, start - run));
    run = i;
    char buf[16];
    if (!esc) {
      if (c >= 0x10000) {
        char32_t v = c - 0x10000;
        std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", unsigned(0xD800 | (v >> 10)), unsigned(0xDC00 | (v & 0x3FF)));
      } else {
        std::snprintf(buf, sizeof buf, "\\u%04x", unsigned(c));
      }
      esc = buf;
    }
    put(out, esc);
  }
  put(out, s.substr(run));
  put(out, "\"");
}

static std::string json_key(const Value& k) {
  if (k.is_string()) return k.str();
  if (k.is_bool()) return k.boolean() ? "true" : "false";
  if (k.is_int()) return std::to_string(k.integer());
  if (k.is_float()) return float_repr(k.real());
  if (k.is_none()) return "null";
  throw_error("TypeError", std::string("keys must be str, int, float, bool or None, not ") + type_name(k));
}

static void dump_into(std::string& out, const Value& v, const DumpOptions& o, int depth) {
  auto newline = [&](int d) {
    will_append(out, 1 + size_t(d) * o.indent.size());  // d <= kMaxValueDepth, indent < 64 MB
    out += '\n';
    for (int i = 0; i < d; ++i) out += o.indent;
  };
  switch (v.v.index()) {
    case 1: put(out, "null"); return;
    case 2: put(out, v.boolean() ? "true" : "false"); return;
    case 3: put(out, std::to_string(v.integer())); return;
    case 4: {
      double d = v.real();
      if (std::isnan(d)) put(out, "NaN");
      else if (std::isinf(d)) put(out, d > 0 ? "Infinity" : "-Infinity");
      else put(out, float_repr(d));
      return;
    }
    case 5: json_string(out, v.str(), o.ensure_ascii); return;
    case 6: {
      Nested nested;
      const List& l = v.list();
      if (l.empty()) {
        put(out, "[]");
        return;
      }
      put(out, "[");
      for (size_t i = 0; i < l.size(); ++i) {
        if (i) put(out, o.item_sep);
        if (o.has_indent) newline(depth + 1);
        dump_into(out, l[i], o, depth + 1);
      }
      if (o.has_indent) newline(depth);
      put(out, "]");
      return;
    }
    case 7: {
      Nested nested;
      const Dict& d = v.dict();
      if (d.items.empty()) {
        put(out, "{}");
        return;
      }
      std::vector<std::pair<std::string, const Value*>> items;
      items.reserve(d.items.size());
      for (const auto& [k, x] : d.items) items.emplace_back(json_key(k), &x);
      if (o.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      put(out, "{");
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) put(out, o.item_sep);
        if (o.has_indent) newline(depth + 1);
        json_string(out, items[i].first, o.ensure_ascii);
        put(out, o.key_sep);
        dump_into(out, *items[i].second, o, depth + 1);
      }
      if (o.has_indent) newline(depth);
      put(out, "}");
      return;
    }
    default:
      throw_error("TypeError", std::string("Object of type ") + type_name(v) + " is not JSON serializable");
  }
}

std::string json_dumps(const Value& v, const DumpOptions& o) {
  std::string out;
  dump_into(out, v, o, 0);
  return out;
}

Value from_json(const nlohmann::ordered_json& j) {
  using T = nlohmann::ordered_json::value_t;
  switch (j.type()) {
    case T::null: return Value(None{});
    case T::boolean: return Value(j.get<bool>());
    case T::number_integer: return Value(j.get<int64_t>());
    case T::number_unsigned: {
      auto u = j.get<uint64_t>();
      if (u <= uint64_t(INT64_MAX)) return Value(int64_t(u));
      return Value(double(u));
    }
    case T::number_float: return Value(j.get<double>());
    case T::string: return Value(j.get<std::string>());
    case T::array: {
      Nested nested;
      List l;
      l.reserve(j.size());
      for (const auto& x : j) l.push_back(from_json(x));
      return Value(std::move(l));
    }
    case T::object: {
      Nested nested;
      auto d = std::make_shared<Dict>();
      d->items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) d->items.emplace_back(Value(it.key()), from_json(it.value()));
      return Value(std::shared_ptr<const Dict>(std::move(d)));
    }
    default: return Value(None{});
  }
}

}  // namespace moestream::jinja
