// Builtins of the Jinja interpreter: jinja2's filters and tests, transformers' tojson,
// raise_exception and strftime_now, the globals range/namespace/dict/joiner/cycler, and the Python
// methods of str, dict and list that templates call. Each follows the Python/jinja2 definition;
// string positions and lengths count code points.
//
// Longer than the project's ~700-line files on purpose: it is one table of small, independent
// builtins (each a dozen lines), read by name from the registry at its end; split by letter or
// by kind, every part would need the same helpers and the registry would span files.
#include <utf8proc.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <unordered_map>
#include <unordered_set>

#include "text/jinja_interp.h"
#include "text/limits.h"

namespace moestream::jinja {

namespace {

// ---- helpers ----

const Value kNone{None{}};
const Value kFalse{false};
const Value kEmpty{std::string()};
const Value kZero{int64_t(0)};

std::string need_str(const Value& v, const char* what) {
  if (v.is_string()) return v.str();
  if (v.is_undefined()) throw_error("UndefinedError", v.undefined_hint());
  throw_error("TypeError", std::string(what) + " must be str, not " + type_name(v));
}

int64_t need_int(const Value& v, const char* what) {
  if (v.is_int() || v.is_bool()) return v.as_int();
  if (v.is_undefined()) throw_error("UndefinedError", v.undefined_hint());
  throw_error("TypeError", std::string(what) + ": '" + type_name(v) + "' object cannot be interpreted as an integer");
}

// n spaces (none for n <= 0), within the string size limit.
std::string spaces(int64_t n) {
  if (n <= 0) return {};
  check_string_size(uint64_t(n) > SIZE_MAX / 2 ? SIZE_MAX : size_t(n));
  charge_bytes(uint64_t(n));
  return std::string(size_t(n), ' ');
}

bool is_ascii(std::string_view s) {
  for (unsigned char c : s)
    if (c >= 0x80) return false;
  return true;
}

// Byte offset of code point index i (clamped like Python slice indices; negative from the end).
size_t cp_to_byte(std::string_view s, int64_t i) {
  int64_t n = int64_t(cp_count(s));
  if (i < 0) i = std::max<int64_t>(0, i + n);
  if (i >= n) return s.size();
  if (is_ascii(s)) return size_t(i);
  size_t pos = 0;
  for (int64_t k = 0; k < i; ++k) decode(s, pos);
  return pos;
}

int64_t byte_to_cp(std::string_view s, size_t b) { return int64_t(cp_count(s.substr(0, b))); }

std::string map_cps(std::string_view s, utf8proc_int32_t (*f)(utf8proc_int32_t)) {
  std::string out;
  charge_bytes(s.size());  // case maps keep the size, within a few bytes
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) append_cp(out, char32_t(f(utf8proc_int32_t(decode(s, i)))));
  return out;
}

std::string py_upper(std::string_view s) { return map_cps(s, utf8proc_toupper); }
std::string py_lower(std::string_view s) { return map_cps(s, utf8proc_tolower); }

bool is_cased(char32_t c) {
  auto cat = utf8proc_category(utf8proc_int32_t(c));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

std::string py_title(std::string_view s) {  // str.title()
  std::string out;
  charge_bytes(s.size());
  bool prev_cased = false;
  size_t i = 0;
  while (i < s.size()) {
    char32_t c = decode(s, i);
    bool cased = is_cased(c);
    if (cased) append_cp(out, char32_t(prev_cased ? utf8proc_tolower(utf8proc_int32_t(c)) : utf8proc_totitle(utf8proc_int32_t(c))));
    else append_cp(out, c);
    prev_cased = cased;
  }
  return out;
}

std::string py_capitalize(std::string_view s) {
  std::string out;
  charge_bytes(s.size());
  size_t i = 0;
  bool first = true;
  while (i < s.size()) {
    char32_t c = decode(s, i);
    append_cp(out, char32_t(first ? utf8proc_totitle(utf8proc_int32_t(c)) : utf8proc_tolower(utf8proc_int32_t(c))));
    first = false;
  }
  return out;
}

// str.strip family; chars == nullptr: whitespace.
std::string py_strip(std::string_view s, const std::string* chars, bool left, bool right) {
  std::vector<char32_t> set;
  if (chars) {
    size_t i = 0;
    while (i < chars->size()) set.push_back(decode(*chars, i));
  }
  auto strip_it = [&](char32_t c) {
    return chars ? std::find(set.begin(), set.end(), c) != set.end() : py_isspace(c);
  };
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e) {
      size_t i = b;
      char32_t c = decode(s, i);
      if (!strip_it(c)) break;
      b = i;
    }
  }
  if (right) {
    while (e > b) {
      size_t start = e - 1;
      while (start > b && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
      size_t i = start;
      char32_t c = decode(s, i);
      if (!strip_it(c)) break;
      e = start;
    }
  }
  charge_bytes(e - b);
  return std::string(s.substr(b, e - b));
}

std::vector<Value> py_split(std::string_view s, const Value& sep, int64_t maxsplit, bool from_right) {
  // "aaaa".split("a") makes a value for every byte: each part is charged before it is made.
  struct Parts : std::vector<std::string> {
    void emplace_back(std::string_view x) {
      charge_bytes(2 * kSlotBytes + kNewStringBytes + x.size());  // here, then as a Value
      push_back(std::string(x));
    }
  } parts;
  if (sep.is_none() || sep.is_undefined()) {
    // Runs of whitespace; leading/trailing whitespace ignored.
    std::vector<std::pair<size_t, size_t>> words;  // byte ranges
    size_t i = 0;
    while (i < s.size()) {
      size_t st = i;
      char32_t c = decode(s, i);
      if (py_isspace(c)) continue;
      size_t we = i;
      while (i < s.size()) {
        size_t k = i;
        char32_t d = decode(s, k);
        if (py_isspace(d)) break;
        i = k;
        we = i;
      }
      charge_bytes(sizeof(words[0]));
      words.emplace_back(st, we);
    }
    if (maxsplit < 0 || int64_t(words.size()) <= maxsplit + 1) {
      for (auto [b, e] : words) parts.emplace_back(s.substr(b, e - b));
    } else if (!from_right) {
      for (int64_t k = 0; k < maxsplit; ++k) parts.emplace_back(s.substr(words[size_t(k)].first, words[size_t(k)].second - words[size_t(k)].first));
      parts.emplace_back(s.substr(words[size_t(maxsplit)].first));  // the rest keeps its trailing whitespace
    } else {
      size_t first_kept = words.size() - size_t(maxsplit);
      parts.emplace_back(s.substr(0, words[first_kept - 1].second));  // keeps its leading whitespace
      for (size_t k = first_kept; k < words.size(); ++k) parts.emplace_back(s.substr(words[k].first, words[k].second - words[k].first));
    }
  } else {
    std::string d = need_str(sep, "sep");
    if (d.empty()) throw_error("ValueError", "empty separator");
    if (!from_right) {
      size_t pos = 0;
      int64_t n = 0;
      for (;;) {
        size_t f = (maxsplit < 0 || n < maxsplit) ? s.find(d, pos) : std::string_view::npos;
        if (f == std::string_view::npos) {
          parts.emplace_back(s.substr(pos));
          break;
        }
        parts.emplace_back(s.substr(pos, f - pos));
        pos = f + d.size();
        ++n;
      }
    } else {
      size_t end = s.size();
      int64_t n = 0;
      Parts rev;
      for (;;) {
        size_t f = std::string_view::npos;
        if ((maxsplit < 0 || n < maxsplit) && end >= d.size()) f = s.rfind(d, end - d.size());
        if (f == std::string_view::npos) {
          rev.emplace_back(s.substr(0, end));
          break;
        }
        rev.emplace_back(s.substr(f + d.size(), end - f - d.size()));
        end = f;
        ++n;
      }
      parts.assign(rev.rbegin(), rev.rend());
    }
  }
  std::vector<Value> out;
  out.reserve(parts.size());
  for (auto& p : parts) out.emplace_back(std::move(p));
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& neu, int64_t count) {
  std::string out;
  auto put = [&out](std::string_view x) {  // "" -> neu puts neu between every two characters
    will_append(out, x.size());
    out += x;
  };
  if (old.empty()) {
    int64_t n = 0;
    for (size_t i = 0;;) {
      if (count < 0 || n < count) {
        put(neu);
        ++n;
      }
      if (i >= s.size()) break;
      size_t start = i;
      decode(s, i);
      put(std::string_view(s).substr(start, i - start));
    }
    return out;
  }
  size_t pos = 0;
  int64_t n = 0;
  for (;;) {
    size_t f = (count < 0 || n < count) ? s.find(old, pos) : std::string::npos;
    if (f == std::string::npos) break;
    put(std::string_view(s).substr(pos, f - pos));
    put(neu);
    pos = f + old.size();
    ++n;
  }
  put(std::string_view(s).substr(pos));
  return out;
}

std::string html_escape(const std::string& s) {
  size_t size = s.size();
  for (char c : s) size += c == '&' || c == '"' || c == '\'' ? 4 : c == '<' || c == '>' ? 3 : 0;
  std::string out;
  will_append(out, size);
  out.reserve(size);
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

size_t py_len(const Value& v) {
  if (v.is_string()) return cp_count(v.str());
  if (v.is_list()) return v.list().size();
  if (v.is_dict()) return v.dict().items.size();
  if (v.is_undefined()) return 0;
  if (v.is_namespace()) return v.ns().attrs.size();
  throw_error("TypeError", std::string("object of type '") + type_name(v) + "' has no len()");
}

Value list_value(std::vector<Value> v) { return Value(List(std::move(v))); }

// Before a builtin makes a list of n items, each a new list of `inner` items ([key, value] pairs).
void charge_items(size_t n, size_t inner = 0) {
  charge_bytes(uint64_t(n) * (kSlotBytes + (inner ? kNewStringBytes + inner * kSlotBytes : 0)));
}

// Attribute lookup with dots ("a.b" and "0"), as jinja2's make_attrgetter. An evaluation step:
// join(sep, attribute) over the characters of a big string made millions of them.
Value get_path(Interp& in, const Value& v, const std::string& path) {
  in.charge(1);
  Value cur = v;
  size_t pos = 0;
  while (pos <= path.size()) {
    size_t dot = path.find('.', pos);
    std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    int64_t index = 0;
    // jinja2 makes a digit part an int; one past int64 finds nothing there either.
    if (digits && std::from_chars(part.data(), part.data() + part.size(), index).ec != std::errc())
      cur = Value::undefined(std::string(type_name(cur)) + " object has no element " + part);
    else
      cur = digits ? in.getitem(cur, Value(index)) : in.getitem(cur, Value(part));
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  return cur;
}

Value sort_key(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value(py_lower(v.str()));
  return v;
}

// ---- filters ----

Value f_abs(Interp&, const Value& v, Args&) {
  if (v.is_float()) return Value(std::fabs(v.real()));
  if (v.is_number()) return Value(v.as_int() < 0 ? checked_int("-", 0, v.as_int()) : v.as_int());
  throw_error("TypeError", std::string("bad operand type for abs(): '") + type_name(v) + "'");
}

Value f_attr(Interp& in, const Value& v, Args& a) {
  auto p = a.bind("attr", {{"name", nullptr}});
  return in.getattr(v, need_str(p[0], "attribute name"));
}

Value f_batch(Interp&, const Value& v, Args& a) {
  auto p = a.bind("batch", {{"linecount", nullptr}, {"fill_with", &kNone}});
  int64_t n = need_int(p[0], "batch");
  if (n <= 0) throw_error("ValueError", "batch size must be positive");
  std::vector<Value> items = Interp::iterate(v), out;
  // The items again in rows, the rows, and the fill of the last row.
  charge_items(items.size());
  charge_items(items.size() / uint64_t(n) + 1, 1);
  if (!p[1].is_none() && items.size() % uint64_t(n) != 0) {
    check_list_size(size_t(n));
    charge_items(size_t(n) - items.size() % uint64_t(n));
  }
  List cur;
  for (auto& x : items) {
    cur.push_back(x);
    if (int64_t(cur.size()) == n) out.push_back(Value(std::move(cur))), cur = {};
  }
  if (!cur.empty()) {
    if (!p[1].is_none()) {
      check_list_size(size_t(n));
      while (int64_t(cur.size()) < n) cur.push_back(p[1]);
    }
    out.push_back(Value(std::move(cur)));
  }
  return list_value(std::move(out));
}

Value f_capitalize(Interp&, const Value& v, Args&) { return Value(py_capitalize(to_str(v))); }

Value f_center(Interp&, const Value& v, Args& a) {
  static const Value k80{int64_t(80)};
  auto p = a.bind("center", {{"width", &k80}});
  std::string s = to_str(v);
  int64_t w = need_int(p[0], "width"), n = int64_t(cp_count(s));
  if (w <= n) return Value(s);
  int64_t marg = w - n, left = marg / 2 + (marg & w & 1);
  check_string_size(s.size() + size_t(marg));
  charge_bytes(s.size() + size_t(marg));
  return Value(std::string(size_t(left), ' ') + s + std::string(size_t(marg - left), ' '));
}

Value f_default(Interp&, const Value& v, Args& a) {
  auto p = a.bind("default", {{"default_value", &kEmpty}, {"boolean", &kFalse}});
  if (v.is_undefined() || (truthy(p[1]) && !truthy(v))) return p[0];
  return v;
}

Value f_dictsort(Interp&, const Value& v, Args& a) {
  static const Value kKey{"key"};
  auto p = a.bind("dictsort", {{"case_sensitive", &kFalse}, {"by", &kKey}, {"reverse", &kFalse}});
  if (!v.is_dict()) throw_error("TypeError", "dictsort: value must be a dict");
  int idx = to_str(p[1]) == "value" ? 1 : 0;
  if (to_str(p[1]) != "key" && to_str(p[1]) != "value") throw_error("FilterArgumentError", "You can only sort by either \"key\" or \"value\"");
  bool cs = truthy(p[0]);
  std::vector<Value> items;
  charge_items(v.dict().items.size(), 2);
  for (const auto& [k, x] : v.dict().items) items.push_back(Value(List{k, x}));
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    return less(sort_key(x.list()[size_t(idx)], cs), sort_key(y.list()[size_t(idx)], cs));
  });
  if (truthy(p[2])) std::reverse(items.begin(), items.end());
  return list_value(std::move(items));
}

Value f_escape(Interp&, const Value& v, Args&) { return Value(html_escape(to_str(v))); }

Value f_first(Interp&, const Value& v, Args&) {
  if (v.is_string()) {
    if (v.str().empty()) return Value::undefined("No first item, sequence was empty.");
    size_t i = 0;
    decode(v.str(), i);
    return Value(v.str().substr(0, i));
  }
  std::vector<Value> items = Interp::iterate(v);
  if (items.empty()) return Value::undefined("No first item, sequence was empty.");
  return items.front();
}

Value f_last(Interp&, const Value& v, Args&) {
  std::vector<Value> items = Interp::iterate(v);
  if (items.empty()) return Value::undefined("No last item, sequence was empty.");
  return items.back();
}

bool parse_py_float(std::string s, double& out) {
  s = py_strip(s, nullptr, true, true);
  std::string t;
  for (char c : s)
    if (c != '_') t += c;
  if (t.empty() || t.find_first_of("xXpP") != std::string::npos) return false;  // strtod takes hex, Python not
  std::string low = py_lower(t);
  if (low == "inf" || low == "+inf" || low == "infinity" || low == "+infinity") return out = INFINITY, true;
  if (low == "-inf" || low == "-infinity") return out = -INFINITY, true;
  if (low == "nan" || low == "+nan" || low == "-nan") return out = NAN, true;
  char* end = nullptr;
  out = std::strtod(t.c_str(), &end);
  return end == t.c_str() + t.size() && (std::isdigit(static_cast<unsigned char>(t.back())) || t.back() == '.');
}

Value f_float(Interp&, const Value& v, Args& a) {
  static const Value k0{0.0};
  auto p = a.bind("float", {{"default", &k0}});
  if (v.is_number()) return Value(v.as_double());
  if (v.is_string()) {
    double d;
    if (parse_py_float(v.str(), d)) return Value(d);
  }
  return p[0];
}

Value f_format(Interp&, const Value& v, Args& a) {
  // value % args (jinja2: soft_str(value) % (kwargs or args); keyword formatting is not supported)
  return Value(percent_format(to_str(v), a.pos, true));
}

Value f_indent(Interp&, const Value& v, Args& a) {
  static const Value k4{int64_t(4)};
  auto p = a.bind("indent", {{"width", &k4}, {"first", &kFalse}, {"blank", &kFalse}});
  std::string ind = p[0].is_string() ? p[0].str() : spaces(need_int(p[0], "width"));
  std::string s = to_str(v) + "\n";
  // str.splitlines() on "\n" (other separators are rare in templates)
  std::vector<std::string> lines;
  charge_bytes(s.size());  // the lines
  size_t pos = 0;
  while (pos < s.size()) {
    size_t nl = s.find('\n', pos);
    if (nl == std::string::npos) nl = s.size();
    lines.push_back(s.substr(pos, nl - pos));
    pos = nl + 1;
  }
  std::string rv;
  if (truthy(p[2])) {
    for (size_t i = 0; i < lines.size(); ++i) {
      will_append(rv, ind.size() + lines[i].size() + 1);
      rv += (i ? "\n" + ind : "") + lines[i];
    }
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) {
      will_append(rv, ind.size() + lines[i].size() + 1);
      rv += "\n" + (lines[i].empty() ? lines[i] : ind + lines[i]);
    }
  }
  will_append(rv, ind.size());
  if (truthy(p[1])) rv = ind + rv;
  return Value(rv);
}

Value f_int(Interp&, const Value& v, Args& a) {
  static const Value k10{int64_t(10)};
  auto p = a.bind("int", {{"default", &kZero}, {"base", &k10}});
  if (v.is_float()) {
    if (std::isnan(v.real()) || std::isinf(v.real())) return p[0];
    return Value(float_to_int(v.real()));
  }
  if (v.is_number()) return Value(v.as_int());
  if (v.is_string()) {
    std::string s = py_strip(v.str(), nullptr, true, true), t;
    for (char c : s)
      if (c != '_') t += c;
    int64_t base = need_int(p[1], "base");
    char* end = nullptr;
    if (!t.empty() && (base == 0 || (base >= 2 && base <= 36))) {  // else Python's int() raises
      errno = 0;
      long long r = std::strtoll(t.c_str(), &end, int(base));
      if (end == t.c_str() + t.size()) {
        if (errno == ERANGE) throw_error("OverflowError", "int('" + s + "') does not fit in a 64-bit integer");
        return Value(int64_t(r));
      }
    }
    double d;
    if (parse_py_float(v.str(), d) && std::isfinite(d)) return Value(float_to_int(d));
  }
  return p[0];
}

Value f_items(Interp&, const Value& v, Args&) {
  if (v.is_undefined()) return list_value({});
  if (!v.is_dict()) throw_error("TypeError", "Can only get item pairs from a mapping.");
  std::vector<Value> out;
  charge_items(v.dict().items.size(), 2);
  for (const auto& [k, x] : v.dict().items) out.push_back(Value(List{k, x}));
  return list_value(std::move(out));
}

Value f_join(Interp& in, const Value& v, Args& a) {
  static const Value kNoAttr{None{}};
  auto p = a.bind("join", {{"d", &kEmpty}, {"attribute", &kNoAttr}});
  std::string sep = to_str(p[0]), out;
  bool first = true;
  // Over a string, every character gets a separator: a chain of joins multiplies the length at
  // every link, so each piece is charged before it is appended.
  for (const auto& x : Interp::iterate(v)) {
    if (!first) {
      will_append(out, sep.size());
      out += sep;
    }
    first = false;
    const Value& item = p[1].is_none() ? x : get_path(in, x, to_str(p[1]));
    if (item.is_string()) {
      will_append(out, item.str().size());
      out += item.str();
    } else {
      const std::string text = to_str(item);
      will_append(out, text.size());
      out += text;
    }
  }
  return Value(std::move(out));
}

Value f_length(Interp& in, const Value& v, Args&) {
  if (v.is_string()) in.charge_scan(v.str().size());  // code points are counted
  return Value(int64_t(py_len(v)));
}

Value f_list(Interp&, const Value& v, Args&) { return list_value(Interp::iterate(v)); }

Value f_lower(Interp&, const Value& v, Args&) { return Value(py_lower(to_str(v))); }
Value f_upper(Interp&, const Value& v, Args&) { return Value(py_upper(to_str(v))); }

Value f_map(Interp& in, const Value& v, Args& a) {
  std::vector<Value> items = Interp::iterate(v), out;
  charge_items(items.size());
  const Value* attr = nullptr;
  const Value* def = nullptr;
  for (const auto& [k, x] : a.kw) {
    if (k == "attribute") attr = &x;
    else if (k == "default") def = &x;
  }
  if (attr) {
    for (const auto& x : items) {
      Value r = get_path(in, x, to_str(*attr));
      if (r.is_undefined() && def) r = *def;
      out.push_back(r);
    }
    return list_value(std::move(out));
  }
  if (a.pos.empty()) throw_error("FilterArgumentError", "map requires a filter argument");
  std::string name = need_str(a.pos[0], "filter name");
  Args rest;
  rest.pos.assign(a.pos.begin() + 1, a.pos.end());
  rest.kw = a.kw;
  for (const auto& x : items) {
    Args b = rest;
    out.push_back(in.apply_filter(name, x, b));
  }
  return list_value(std::move(out));
}

Value minmax(Interp& in, const Value& v, Args& a, bool want_max) {
  auto p = a.bind(want_max ? "max" : "min", {{"case_sensitive", &kFalse}, {"attribute", &kNone}});
  std::vector<Value> items = Interp::iterate(v);
  if (items.empty()) return Value::undefined(std::string("No aggregated item, sequence was empty."));
  bool cs = truthy(p[0]);
  auto key = [&](const Value& x) { return sort_key(p[1].is_none() ? x : get_path(in, x, to_str(p[1])), cs); };
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    bool better = want_max ? less(key(items[best]), key(items[i])) : less(key(items[i]), key(items[best]));
    if (better) best = i;
  }
  return items[best];
}
Value f_max(Interp& in, const Value& v, Args& a) { return minmax(in, v, a, true); }
Value f_min(Interp& in, const Value& v, Args& a) { return minmax(in, v, a, false); }

Value select_impl(Interp& in, const Value& v, Args& a, bool attr_mode, bool keep_if) {
  std::vector<Value> items = Interp::iterate(v), out;
  charge_items(items.size());
  size_t k = 0;
  std::string attr;
  if (attr_mode) {
    if (a.pos.empty()) throw_error("FilterArgumentError", "Missing parameter for attribute name");
    attr = need_str(a.pos[0], "attribute");
    k = 1;
  }
  std::string test;
  if (k < a.pos.size()) test = need_str(a.pos[k++], "test name");
  Args targs;
  targs.pos.assign(a.pos.begin() + long(k), a.pos.end());
  targs.kw = a.kw;
  for (const auto& x : items) {
    Value subject = attr_mode ? get_path(in, x, attr) : x;
    bool r;
    if (test.empty()) {
      r = truthy(subject);
    } else {
      Args b = targs;
      r = in.apply_test(test, subject, b);
    }
    if (r == keep_if) out.push_back(x);
  }
  return list_value(std::move(out));
}
Value f_select(Interp& in, const Value& v, Args& a) { return select_impl(in, v, a, false, true); }
Value f_reject(Interp& in, const Value& v, Args& a) { return select_impl(in, v, a, false, false); }
Value f_selectattr(Interp& in, const Value& v, Args& a) { return select_impl(in, v, a, true, true); }
Value f_rejectattr(Interp& in, const Value& v, Args& a) { return select_impl(in, v, a, true, false); }

Value f_replace(Interp&, const Value& v, Args& a) {
  auto p = a.bind("replace", {{"old", nullptr}, {"new", nullptr}, {"count", &kNone}});
  int64_t count = p[2].is_none() ? -1 : need_int(p[2], "count");
  return Value(py_replace(to_str(v), to_str(p[0]), to_str(p[1]), count));
}

Value f_reverse(Interp&, const Value& v, Args&) {
  if (v.is_string()) {
    auto cps = cp_split(v.str());
    std::string out;
    charge_bytes(v.str().size());
    out.reserve(v.str().size());
    for (size_t i = cps.size(); i-- > 0;) out += cps[i];
    return Value(out);
  }
  std::vector<Value> items = Interp::iterate(v);
  std::reverse(items.begin(), items.end());
  return list_value(std::move(items));
}

Value f_round(Interp&, const Value& v, Args& a) {
  static const Value kCommon{"common"};
  auto p = a.bind("round", {{"precision", &kZero}, {"method", &kCommon}});
  std::string method = to_str(p[1]);
  if (method != "common" && method != "ceil" && method != "floor")
    throw_error("FilterArgumentError", "method must be common, ceil or floor");
  if (!v.is_number()) throw_error("TypeError", std::string("type ") + type_name(v) + " doesn't define __round__ method");
  double x = v.as_double();
  int64_t prec = need_int(p[0], "precision");
  double m = std::pow(10.0, double(prec));
  double r;
  if (method == "ceil") r = std::ceil(x * m) / m;
  else if (method == "floor") r = std::floor(x * m) / m;
  else {
    // Python round(): correctly rounded, halves to even; via the shortest repr of the scaled value.
    double scaled = x * m;
    double fl = std::floor(scaled), diff = scaled - fl;
    if (diff > 0.5) r = fl + 1;
    else if (diff < 0.5) r = fl;
    else r = std::fmod(fl, 2.0) == 0 ? fl : fl + 1;
    r /= m;
  }
  return Value(r);
}

Value f_safe(Interp&, const Value& v, Args&) { return v.is_string() ? v : Value(to_str(v)); }

Value f_sort(Interp& in, const Value& v, Args& a) {
  auto p = a.bind("sort", {{"reverse", &kFalse}, {"case_sensitive", &kFalse}, {"attribute", &kNone}});
  std::vector<Value> items = Interp::iterate(v);
  bool cs = truthy(p[1]);
  auto key = [&](const Value& x) { return sort_key(p[2].is_none() ? x : get_path(in, x, to_str(p[2])), cs); };
  bool rev = truthy(p[0]);
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    return rev ? less(key(y), key(x)) : less(key(x), key(y));
  });
  return list_value(std::move(items));
}

Value f_string(Interp&, const Value& v, Args&) { return v.is_string() ? v : Value(to_str(v)); }

Value f_sum(Interp& in, const Value& v, Args& a) {
  auto p = a.bind("sum", {{"attribute", &kNone}, {"start", &kZero}});
  Value acc = p[1];
  for (const auto& x : Interp::iterate(v)) {
    Value y = p[0].is_none() ? x : get_path(in, x, to_str(p[0]));
    if (acc.is_number() && y.is_number()) {
      if (acc.is_float() || y.is_float()) acc = Value(acc.as_double() + y.as_double());
      else acc = Value(checked_int("+", acc.as_int(), y.as_int()));
    } else if (acc.is_list() && y.is_list()) {
      check_list_size(acc.list().size() + y.list().size());
      charge_items(acc.list().size() + y.list().size());
      List l = acc.list();
      l.insert(l.end(), y.list().begin(), y.list().end());
      acc = Value(std::move(l));
    } else {
      throw_error("TypeError", std::string("unsupported operand type(s) for +: '") + type_name(acc) + "' and '" + type_name(y) + "'");
    }
  }
  return acc;
}

Value f_title(Interp&, const Value& v, Args&) {
  // jinja2: words split at runs of [-\s({\[<], each capitalised.
  std::string s = to_str(v), out, item;
  charge_bytes(s.size());
  auto is_sep = [](char32_t c) { return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_isspace(c); };
  auto flush = [&] {
    if (item.empty()) return;
    size_t i = 0;
    char32_t c = decode(item, i);
    append_cp(out, char32_t(utf8proc_toupper(utf8proc_int32_t(c))));
    out += py_lower(item.substr(i));
    item.clear();
  };
  size_t i = 0;
  while (i < s.size()) {
    size_t st = i;
    char32_t c = decode(s, i);
    if (is_sep(c)) {
      flush();
      out.append(s, st, i - st);
    } else {
      item.append(s, st, i - st);
    }
  }
  flush();
  return Value(out);
}

// transformers: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
Value f_tojson(Interp&, const Value& v, Args& a) {
  auto p = a.bind("tojson", {{"ensure_ascii", &kFalse}, {"indent", &kNone}, {"separators", &kNone}, {"sort_keys", &kFalse}});
  DumpOptions o;
  o.ensure_ascii = truthy(p[0]);
  o.sort_keys = truthy(p[3]);
  if (!p[1].is_none()) {
    o.has_indent = true;
    o.indent = p[1].is_string() ? p[1].str() : spaces(need_int(p[1], "indent"));
    o.item_sep = ",";
  }
  if (!p[2].is_none()) {
    std::vector<Value> seps = Interp::iterate(p[2]);
    if (seps.size() != 2) throw_error("ValueError", "separators must be a pair");
    o.item_sep = need_str(seps[0], "separator");
    o.key_sep = need_str(seps[1], "separator");
  }
  return Value(json_dumps(v, o));
}

Value f_trim(Interp&, const Value& v, Args& a) {
  auto p = a.bind("trim", {{"chars", &kNone}});
  std::string chars = p[0].is_none() ? std::string() : to_str(p[0]);
  return Value(py_strip(to_str(v), p[0].is_none() ? nullptr : &chars, true, true));
}

Value f_truncate(Interp&, const Value& v, Args& a) {
  static const Value k255{int64_t(255)}, kDots{"..."}, k5{int64_t(5)};
  auto p = a.bind("truncate", {{"length", &k255}, {"killwords", &kFalse}, {"end", &kDots}, {"leeway", &k5}});
  std::string s = to_str(v), end = to_str(p[2]);
  int64_t length = need_int(p[0], "length"), leeway = need_int(p[3], "leeway");
  // jinja2's own checks, which also keep `keep` below the length of s.
  if (length < int64_t(cp_count(end)))
    throw_error("AssertionError", "expected length >= " + std::to_string(cp_count(end)) + ", got " + std::to_string(length));
  if (leeway < 0) throw_error("AssertionError", "expected leeway >= 0, got " + std::to_string(leeway));
  int64_t limit = 0;
  if (__builtin_add_overflow(length, leeway, &limit) || int64_t(cp_split_count(s)) <= limit) return Value(s);
  int64_t keep = std::max<int64_t>(0, length - int64_t(cp_count(end)));  // < the code points of s
  size_t head_end = 0;
  for (int64_t i = 0; i < keep; ++i) decode(s, head_end);
  charge_bytes(head_end + end.size());
  std::string head = s.substr(0, head_end);
  if (truthy(p[1])) return Value(head + end);
  size_t sp = head.rfind(' ');
  if (sp != std::string::npos) head = head.substr(0, sp);
  return Value(head + end);
}

Value f_unique(Interp& in, const Value& v, Args& a) {
  auto p = a.bind("unique", {{"case_sensitive", &kFalse}, {"attribute", &kNone}});
  std::vector<Value> out, seen;
  bool cs = truthy(p[0]);
  for (const auto& x : Interp::iterate(v)) {
    in.charge(int64_t(seen.size()));  // compares with every item kept: range(100000) | unique took minutes
    charge_items(2);
    Value k = sort_key(p[1].is_none() ? x : get_path(in, x, to_str(p[1])), cs);
    bool dup = false;
    for (const auto& s : seen) dup = dup || equals(s, k);
    if (!dup) seen.push_back(k), out.push_back(x);
  }
  return list_value(std::move(out));
}

Value f_wordcount(Interp&, const Value& v, Args&) {
  return Value(int64_t(py_split(to_str(v), kNone, -1, false).size()));
}

// ---- tests ----

bool t_defined(Interp&, const Value& v, Args&) { return !v.is_undefined(); }
bool t_undefined(Interp&, const Value& v, Args&) { return v.is_undefined(); }
bool t_none(Interp&, const Value& v, Args&) { return v.is_none(); }
bool t_boolean(Interp&, const Value& v, Args&) { return v.is_bool(); }
bool t_true(Interp&, const Value& v, Args&) { return v.is_bool() && v.boolean(); }
bool t_false(Interp&, const Value& v, Args&) { return v.is_bool() && !v.boolean(); }
bool t_integer(Interp&, const Value& v, Args&) { return v.is_int(); }
bool t_float(Interp&, const Value& v, Args&) { return v.is_float(); }
bool t_number(Interp&, const Value& v, Args&) { return v.is_number(); }
bool t_string(Interp&, const Value& v, Args&) { return v.is_string(); }
bool t_mapping(Interp&, const Value& v, Args&) { return v.is_dict(); }
bool t_iterable(Interp&, const Value& v, Args&) { return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined(); }
bool t_sequence(Interp&, const Value& v, Args&) { return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined(); }
bool t_callable(Interp&, const Value& v, Args&) { return v.is_function() || v.is_undefined(); }  // Undefined has __call__
bool t_escaped(Interp&, const Value&, Args&) { return false; }
bool t_lower(Interp&, const Value& v, Args&) {
  if (!v.is_string()) return false;
  return py_lower(v.str()) == v.str() && py_upper(v.str()) != v.str();
}
bool t_upper(Interp&, const Value& v, Args&) {
  if (!v.is_string()) return false;
  return py_upper(v.str()) == v.str() && py_lower(v.str()) != v.str();
}
const Value& arg0(Args& a, const char* test) {
  if (a.pos.empty() && a.kw.empty()) throw_error("TypeError", std::string(test) + "() missing required argument");
  return a.pos.empty() ? a.kw[0].second : a.pos[0];
}
bool t_eq(Interp&, const Value& v, Args& a) { return equals(v, arg0(a, "eq")); }
bool t_ne(Interp&, const Value& v, Args& a) { return !equals(v, arg0(a, "ne")); }
bool t_lt(Interp&, const Value& v, Args& a) { return less(v, arg0(a, "lt")); }
bool t_le(Interp&, const Value& v, Args& a) { return less(v, arg0(a, "le")) || equals(v, arg0(a, "le")); }
bool t_gt(Interp&, const Value& v, Args& a) { return less(arg0(a, "gt"), v); }
bool t_ge(Interp&, const Value& v, Args& a) { return less(arg0(a, "ge"), v) || equals(v, arg0(a, "ge")); }
bool t_in(Interp&, const Value& v, Args& a) { return Interp::contains(arg0(a, "in"), v); }
bool t_sameas(Interp&, const Value& v, Args& a) {
  const Value& o = arg0(a, "sameas");
  if (v.v.index() != o.v.index()) return false;
  if (v.is_none() || v.is_undefined()) return true;
  if (v.is_bool()) return v.boolean() == o.boolean();
  if (v.is_int()) return v.integer() == o.integer();  // small ints are shared in CPython
  if (v.is_string()) return &v.str() == &o.str();
  if (v.is_list()) return &v.list() == &o.list();
  if (v.is_dict()) return &v.dict() == &o.dict();
  return equals(v, o);
}
bool t_odd(Interp&, const Value& v, Args&) { return need_int(v, "odd") % 2 != 0; }
bool t_even(Interp&, const Value& v, Args&) { return need_int(v, "even") % 2 == 0; }
bool t_divisibleby(Interp&, const Value& v, Args& a) {
  int64_t d = need_int(arg0(a, "divisibleby"), "divisibleby");
  if (d == 0) throw_error("ZeroDivisionError", "integer division or modulo by zero");
  int64_t x = need_int(v, "divisibleby");
  return x % d == 0;
}
bool t_filter(Interp&, const Value& v, Args&) { return v.is_string() && find_filter(v.str()) != nullptr; }
bool t_test(Interp&, const Value& v, Args&) { return v.is_string() && find_test(v.str()) != nullptr; }

// ---- methods ----

Value m_str(Interp& in, const std::string& s, std::string_view name, Args& a) {
  auto startsends = [&](bool starts) {
    auto p = a.bind(starts ? "startswith" : "endswith", {{"prefix", nullptr}, {"start", &kNone}, {"end", &kNone}});
    size_t b = p[1].is_none() ? 0 : cp_to_byte(s, need_int(p[1], "start"));
    size_t e = p[2].is_none() ? s.size() : cp_to_byte(s, need_int(p[2], "end"));
    std::string_view sub = b <= e ? std::string_view(s).substr(b, e - b) : std::string_view();
    std::vector<Value> cands = p[0].is_list() ? p[0].list() : std::vector<Value>{p[0]};
    for (const auto& c : cands) {
      std::string x = need_str(c, starts ? "startswith first arg" : "endswith first arg");
      if (b > s.size() || (b > e)) continue;
      if (starts ? sub.substr(0, x.size()) == x : (sub.size() >= x.size() && sub.substr(sub.size() - x.size()) == x))
        return Value(true);
    }
    return Value(false);
  };
  if (name == "startswith") return startsends(true);
  if (name == "endswith") return startsends(false);
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    auto p = a.bind(name, {{"chars", &kNone}});
    std::string chars = p[0].is_none() ? std::string() : need_str(p[0], "chars");
    return Value(py_strip(s, p[0].is_none() ? nullptr : &chars, name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    static const Value kM1{int64_t(-1)};
    auto p = a.bind(name, {{"sep", &kNone}, {"maxsplit", &kM1}});
    return list_value(py_split(s, p[0], need_int(p[1], "maxsplit"), name == "rsplit"));
  }
  if (name == "splitlines") {
    auto p = a.bind(name, {{"keepends", &kFalse}});
    std::vector<Value> out;
    size_t pos = 0;
    while (pos < s.size()) {
      size_t e = pos;
      while (e < s.size() && s[e] != '\n' && s[e] != '\r') ++e;
      size_t next = e;
      if (next < s.size()) next += (s[next] == '\r' && next + 1 < s.size() && s[next + 1] == '\n') ? 2 : 1;
      charge_bytes(kSlotBytes + kNewStringBytes + (truthy(p[0]) ? next : e) - pos);
      out.emplace_back(s.substr(pos, (truthy(p[0]) ? next : e) - pos));
      pos = next;
    }
    return list_value(std::move(out));
  }
  if (name == "replace") {
    static const Value kM1{int64_t(-1)};
    auto p = a.bind(name, {{"old", nullptr}, {"new", nullptr}, {"count", &kM1}});
    return Value(py_replace(s, need_str(p[0], "replace() argument 1"), need_str(p[1], "replace() argument 2"), need_int(p[2], "count")));
  }
  if (name == "removeprefix" || name == "removesuffix") {
    auto p = a.bind(name, {{"affix", nullptr}});
    std::string x = need_str(p[0], std::string(name).c_str());
    charge_bytes(s.size());
    if (name == "removeprefix") return Value(s.compare(0, x.size(), x) == 0 ? s.substr(x.size()) : s);
    bool ends = s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
    return Value(ends && !x.empty() ? s.substr(0, s.size() - x.size()) : s);
  }
  if (name == "isascii") return Value(is_ascii(s));
  if (name == "upper") return Value(py_upper(s));
  if (name == "lower" || name == "casefold") return Value(py_lower(s));
  if (name == "title") return Value(py_title(s));
  if (name == "capitalize") return Value(py_capitalize(s));
  if (name == "swapcase") {
    std::string out;
    charge_bytes(s.size());
    size_t i = 0;
    while (i < s.size()) {
      char32_t c = decode(s, i);
      auto u = utf8proc_toupper(utf8proc_int32_t(c)), l = utf8proc_tolower(utf8proc_int32_t(c));
      append_cp(out, char32_t(char32_t(u) != c ? u : l));
    }
    return Value(out);
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    in.charge_scan(s.size());
    auto p = a.bind(name, {{"sub", nullptr}, {"start", &kNone}, {"end", &kNone}});
    std::string sub = need_str(p[0], "must be str");
    size_t b = p[1].is_none() ? 0 : cp_to_byte(s, need_int(p[1], "start"));
    size_t e = p[2].is_none() ? s.size() : cp_to_byte(s, need_int(p[2], "end"));
    if (name == "count") {
      if (b > e) return Value(int64_t(0));
      std::string_view hay = std::string_view(s).substr(b, e - b);
      if (sub.empty()) return Value(int64_t(cp_count(hay) + 1));
      int64_t n = 0;
      for (size_t f = hay.find(sub); f != std::string_view::npos; f = hay.find(sub, f + sub.size())) ++n;
      return Value(n);
    }
    size_t f = std::string::npos;
    if (b <= e && e - b >= sub.size()) {
      std::string_view hay = std::string_view(s).substr(0, e);
      f = name[0] == 'r' ? hay.rfind(sub) : hay.find(sub, b);
      if (f != std::string::npos && f < b) f = std::string::npos;
    }
    if (f == std::string::npos) {
      if (name == "index" || name == "rindex") throw_error("ValueError", "substring not found");
      return Value(int64_t(-1));
    }
    return Value(byte_to_cp(s, f));
  }
  if (name == "join") {
    auto p = a.bind(name, {{"iterable", nullptr}});
    std::string out;
    bool first = true;
    for (const auto& x : Interp::iterate(p[0])) {
      if (!first) {
        will_append(out, s.size());
        out += s;
      }
      first = false;
      const std::string& item = x.is_string() ? x.str() : need_str(x, "sequence item");
      will_append(out, item.size());
      out += item;
    }
    return Value(std::move(out));
  }
  if (name == "isdigit" || name == "isnumeric" || name == "isdecimal" || name == "isalpha" || name == "isalnum" ||
      name == "isspace" || name == "islower" || name == "isupper") {
    if (s.empty()) return Value(false);
    if (name == "islower" || name == "isupper") {
      bool any_cased = false;
      size_t i = 0;
      while (i < s.size()) {
        char32_t c = decode(s, i);
        auto cat = utf8proc_category(utf8proc_int32_t(c));
        if (cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LT) {
          if (name == "islower") return Value(false);
          any_cased = true;
        } else if (cat == UTF8PROC_CATEGORY_LL) {
          if (name == "isupper") return Value(false);
          any_cased = true;
        }
      }
      return Value(any_cased);
    }
    size_t i = 0;
    while (i < s.size()) {
      char32_t c = decode(s, i);
      auto cat = utf8proc_category(utf8proc_int32_t(c));
      bool digit = cat == UTF8PROC_CATEGORY_ND;
      bool alpha = cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT ||
                   cat == UTF8PROC_CATEGORY_LM || cat == UTF8PROC_CATEGORY_LO;
      bool ok = name == "isspace" ? py_isspace(c) : name == "isalpha" ? alpha : name == "isalnum" ? (alpha || digit) : digit;
      if (!ok) return Value(false);
    }
    return Value(true);
  }
  if (name == "center" || name == "ljust" || name == "rjust") {
    static const Value kSpace{" "};
    auto p = a.bind(name, {{"width", nullptr}, {"fillchar", &kSpace}});
    int64_t w = need_int(p[0], "width"), n = int64_t(cp_count(s));
    std::string fill = need_str(p[1], "fillchar");
    if (w <= n) return Value(s);
    int64_t pad = w - n, left = name == "ljust" ? 0 : name == "rjust" ? pad : pad / 2 + (pad & w & 1);
    if (fill.empty() || cp_count(fill) != 1) throw_error("TypeError", "The fill character must be exactly one character long");
    if (uint64_t(pad) > text_limits::kMaxStringBytes / fill.size()) check_string_size(SIZE_MAX);
    check_string_size(s.size() + size_t(pad) * fill.size());
    charge_bytes(s.size() + size_t(pad) * fill.size());
    std::string out;
    for (int64_t k = 0; k < left; ++k) out += fill;
    out += s;
    for (int64_t k = 0; k < pad - left; ++k) out += fill;
    return Value(out);
  }
  if (name == "zfill") {
    auto p = a.bind(name, {{"width", nullptr}});
    int64_t w = need_int(p[0], "width"), n = int64_t(cp_count(s));
    if (w <= n) return Value(s);
    check_string_size(s.size() + size_t(w - n));
    charge_bytes(s.size() + size_t(w - n));
    std::string out = s;
    size_t at = (!s.empty() && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
    out.insert(at, std::string(size_t(w - n), '0'));
    return Value(out);
  }
  if (name == "partition" || name == "rpartition") {
    auto p = a.bind(name, {{"sep", nullptr}});
    std::string sep = need_str(p[0], "sep");
    if (sep.empty()) throw_error("ValueError", "empty separator");
    charge_items(3, 1);
    charge_bytes(s.size());
    size_t f = name == "partition" ? s.find(sep) : s.rfind(sep);
    if (f == std::string::npos)
      return name == "partition" ? Value(List{Value(s), Value(""), Value("")}) : Value(List{Value(""), Value(""), Value(s)});
    return Value(List{Value(s.substr(0, f)), Value(sep), Value(s.substr(f + sep.size()))});
  }
  if (name == "format") {
    // '{0}{0}{0}'.format(s) repeats an argument: every piece is charged before it is appended.
    std::string out;
    auto put = [&out](std::string_view x) {
      will_append(out, x.size());
      out += x;
    };
    size_t auto_idx = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      char c = s[i];
      if (c == '{' && i + 1 < s.size() && s[i + 1] == '{') {
        put("{"), ++i;
      } else if (c == '}' && i + 1 < s.size() && s[i + 1] == '}') {
        put("}"), ++i;
      } else if (c == '{') {
        size_t e = s.find('}', i);
        if (e == std::string::npos) throw_error("ValueError", "Single '{' encountered in format string");
        std::string field = s.substr(i + 1, e - i - 1);
        size_t colon = field.find_first_of(":!");
        std::string key = field.substr(0, colon);
        Value v;
        if (key.empty()) {
          if (auto_idx >= a.pos.size()) throw_error("IndexError", "Replacement index out of range");
          v = a.pos[auto_idx++];
        } else if (std::all_of(key.begin(), key.end(), [](char d) { return d >= '0' && d <= '9'; })) {
          size_t k = 0;
          if (std::from_chars(key.data(), key.data() + key.size(), k).ec != std::errc())
            throw_error("ValueError", "Too many decimal digits in format string");
          if (k >= a.pos.size()) throw_error("IndexError", "Replacement index out of range");
          v = a.pos[k];
        } else {
          bool found = false;
          for (const auto& [k, x] : a.kw)
            if (k == key) v = x, found = true;
          if (!found) throw_error("KeyError", "'" + key + "'");
        }
        put(v.is_string() ? v.str() : to_str(v));
        i = e;
      } else {
        const size_t e = std::min(s.find_first_of("{}", i + 1), s.size());  // the text up to the next brace
        put(std::string_view(s).substr(i, e - i));
        i = e - 1;
      }
    }
    (void)in;
    return Value(std::move(out));
  }
  throw_error("AttributeError", "'str' object has no attribute '" + std::string(name) + "'");
}

Value m_dict(const Value& self, std::string_view name, Args& a) {
  const Dict& d = self.dict();
  if (name == "get") {
    auto p = a.bind("get", {{"key", nullptr}, {"default", &kNone}});
    const Value* v = d.find(p[0]);
    return v ? *v : p[1];
  }
  if (name == "items") {
    a.bind("items", {});
    std::vector<Value> out;
    charge_items(d.items.size(), 2);
    for (const auto& [k, x] : d.items) out.push_back(Value(List{k, x}));
    return list_value(std::move(out));
  }
  if (name == "keys" || name == "values") {
    a.bind(name, {});
    std::vector<Value> out;
    charge_items(d.items.size());
    for (const auto& [k, x] : d.items) out.push_back(name == "keys" ? k : x);
    return list_value(std::move(out));
  }
  if (name == "copy") return self;
  throw_error("SecurityError", "access to attribute '" + std::string(name) + "' of 'dict' object is unsafe.");
}

Value m_list(const Value& self, std::string_view name, Args& a) {
  const List& l = self.list();
  if (name == "index") {
    auto p = a.bind("index", {{"value", nullptr}});
    for (size_t i = 0; i < l.size(); ++i)
      if (equals(l[i], p[0])) return Value(int64_t(i));
    throw_error("ValueError", to_repr(p[0]) + " is not in list");
  }
  if (name == "count") {
    auto p = a.bind("count", {{"value", nullptr}});
    int64_t n = 0;
    for (const auto& x : l) n += equals(x, p[0]);
    return Value(n);
  }
  if (name == "copy") return self;
  throw_error("SecurityError", "access to attribute '" + std::string(name) + "' of 'list' object is unsafe.");
}

const std::unordered_map<std::string_view, FilterFn>& filter_table() {
  static const std::unordered_map<std::string_view, FilterFn> t = {
      {"abs", f_abs},         {"attr", f_attr},           {"batch", f_batch},         {"capitalize", f_capitalize},
      {"center", f_center},   {"count", f_length},        {"d", f_default},           {"default", f_default},
      {"dictsort", f_dictsort}, {"e", f_escape},          {"escape", f_escape},       {"forceescape", f_escape},
      {"first", f_first},     {"float", f_float},         {"format", f_format},       {"indent", f_indent},
      {"int", f_int},         {"items", f_items},         {"join", f_join},           {"last", f_last},
      {"length", f_length},   {"list", f_list},           {"lower", f_lower},         {"map", f_map},
      {"max", f_max},         {"min", f_min},             {"reject", f_reject},       {"rejectattr", f_rejectattr},
      {"replace", f_replace}, {"reverse", f_reverse},     {"round", f_round},         {"safe", f_safe},
      {"select", f_select},   {"selectattr", f_selectattr}, {"sort", f_sort},         {"string", f_string},
      {"sum", f_sum},         {"title", f_title},         {"tojson", f_tojson},       {"trim", f_trim},
      {"truncate", f_truncate}, {"unique", f_unique},     {"upper", f_upper},         {"wordcount", f_wordcount},
  };
  return t;
}

const std::unordered_map<std::string_view, TestFn>& test_table() {
  static const std::unordered_map<std::string_view, TestFn> t = {
      {"defined", t_defined},   {"undefined", t_undefined}, {"none", t_none},         {"boolean", t_boolean},
      {"true", t_true},         {"false", t_false},         {"integer", t_integer},   {"float", t_float},
      {"number", t_number},     {"string", t_string},       {"mapping", t_mapping},   {"iterable", t_iterable},
      {"sequence", t_sequence}, {"callable", t_callable},   {"escaped", t_escaped},   {"lower", t_lower},
      {"upper", t_upper},       {"eq", t_eq},               {"equalto", t_eq},        {"==", t_eq},
      {"ne", t_ne},             {"!=", t_ne},               {"lt", t_lt},             {"lessthan", t_lt},
      {"<", t_lt},              {"le", t_le},               {"<=", t_le},             {"gt", t_gt},
      {"greaterthan", t_gt},    {">", t_gt},                {"ge", t_ge},             {">=", t_ge},
      {"in", t_in},             {"sameas", t_sameas},       {"odd", t_odd},           {"even", t_even},
      {"divisibleby", t_divisibleby}, {"filter", t_filter}, {"test", t_test},
  };
  return t;
}

// A hash set: called for every lookup of an attribute of a string (join(sep, attribute) over a
// big string's characters made millions), where 40 comparisons were most of a fuzz build's time.
bool is_str_method(std::string_view n) {
  static const std::unordered_set<std::string_view> names = {
      "startswith", "endswith", "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "replace", "upper",
      "lower", "casefold", "title", "capitalize", "swapcase", "find", "rfind", "index", "rindex", "count", "join",
      "isdigit", "isnumeric", "isdecimal", "isalpha", "isalnum", "isspace", "islower", "isupper", "center", "ljust",
      "rjust", "zfill", "partition", "rpartition", "format", "removeprefix", "removesuffix", "isascii"};
  return names.count(n) != 0;
}

}  // namespace

FilterFn find_filter(std::string_view name) {
  auto it = filter_table().find(name);
  return it == filter_table().end() ? nullptr : it->second;
}

TestFn find_test(std::string_view name) {
  auto it = test_table().find(name);
  return it == test_table().end() ? nullptr : it->second;
}

bool has_method(const Value& obj, std::string_view n) {
  if (obj.is_string()) return is_str_method(n);
  if (obj.is_dict()) return n == "get" || n == "items" || n == "keys" || n == "values" || n == "copy" || is_unsafe_method(obj, n);
  if (obj.is_list()) return n == "index" || n == "count" || n == "copy" || is_unsafe_method(obj, n);
  return false;
}

bool is_unsafe_method(const Value& obj, std::string_view n) {
  if (obj.is_dict()) return n == "pop" || n == "update" || n == "setdefault" || n == "clear" || n == "popitem";
  if (obj.is_list())
    return n == "append" || n == "extend" || n == "insert" || n == "pop" || n == "remove" || n == "reverse" ||
           n == "sort" || n == "clear";
  return false;
}

Value call_method(Interp& in, const Value& obj, std::string_view name, Args& args) {
  if (obj.is_string()) return m_str(in, obj.str(), name, args);
  if (obj.is_dict()) return m_dict(obj, name, args);
  if (obj.is_list()) {
    in.charge_scan(obj);  // index, count: compares with every item
    return m_list(obj, name, args);
  }
  throw_error("AttributeError", std::string("'") + type_name(obj) + "' object has no attribute '" + std::string(name) + "'");
}

FrameP make_globals() {
  auto g = std::make_shared<Frame>(nullptr);
  g->set("range", Value::function("range", [](Interp& in, Args& a) -> Value {
           if (!a.kw.empty() || a.pos.empty() || a.pos.size() > 3) throw_error("TypeError", "range expected 1 to 3 integer arguments");
           int64_t start = 0, stop, step = 1;
           if (a.pos.size() == 1) stop = need_int(a.pos[0], "range");
           else start = need_int(a.pos[0], "range"), stop = need_int(a.pos[1], "range");
           if (a.pos.size() == 3) step = need_int(a.pos[2], "range");
           if (step == 0) throw_error("ValueError", "range() arg 3 must not be zero");
           // The items, counted in unsigned arithmetic (stop - start may pass int64), then built.
           uint64_t count = 0;
           if (step > 0 && start < stop) count = (uint64_t(stop) - uint64_t(start) - 1) / uint64_t(step) + 1;
           if (step < 0 && start > stop) count = (uint64_t(start) - uint64_t(stop) - 1) / (0 - uint64_t(step)) + 1;
           if (count > 100000) throw_error("OverflowError", "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
           in.charge(int64_t(count));
           charge_items(count);
           List out;
           out.reserve(count);
           for (int64_t i = start; out.size() < count; i += step) {
             out.push_back(Value(i));
             if (out.size() == count) break;  // the next i may pass int64
           }
           return Value(std::move(out));
         }));
  g->set("namespace", Value::function("namespace", [](Interp&, Args& a) -> Value {
           auto ns = std::make_shared<Namespace>();
           for (const auto& p : a.pos) {
             if (!p.is_dict()) throw_error("TypeError", "namespace() positional argument must be a mapping");
             for (const auto& [k, v] : p.dict().items) {
               std::string key = to_str(k);
               if (Value* x = ns->find(key)) *x = v;
               else ns->attrs.emplace_back(key, v);
             }
           }
           for (const auto& [k, v] : a.kw) {
             if (Value* x = ns->find(k)) *x = v;
             else ns->attrs.emplace_back(k, v);
           }
           return Value(ns);
         }));
  g->set("dict", Value::function("dict", [](Interp&, Args& a) -> Value {
           auto d = std::make_shared<Dict>();
           for (const auto& p : a.pos)
             if (p.is_dict()) charge_items(p.dict().items.size(), 1), d->items = p.dict().items;
           for (const auto& [k, v] : a.kw) {
             bool found = false;
             for (auto& kv : d->items)
               if (kv.first.is_string() && kv.first.str() == k) kv.second = v, found = true;
             if (!found) d->items.emplace_back(Value(k), v);
           }
           return Value(std::shared_ptr<const Dict>(std::move(d)));
         }));
  g->set("raise_exception", Value::function("raise_exception", [](Interp&, Args& a) -> Value {
           auto p = a.bind("raise_exception", {{"message", nullptr}});
           throw_error("TemplateError", to_str(p[0]));
         }));
  g->set("strftime_now", Value::function("strftime_now", [](Interp& in, Args& a) -> Value {
           auto p = a.bind("strftime_now", {{"format", nullptr}});
           std::string fmt = need_str(p[0], "format");
           std::time_t t = in.now();
           std::tm tm{};
           localtime_r(&t, &tm);
           char buf[512];
           size_t n = fmt.empty() ? 0 : std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
           return Value(std::string(buf, n));
         }));
  g->set("joiner", Value::function("joiner", [](Interp&, Args& a) -> Value {
           static const Value kComma{", "};
           auto p = a.bind("joiner", {{"sep", &kComma}});
           auto used = std::make_shared<bool>(false);
           std::string sep = to_str(p[0]);
           return Value::function("joiner", [used, sep](Interp&, Args&) -> Value {
             if (!*used) {
               *used = true;
               return Value(std::string());
             }
             return Value(sep);
           });
         }));
  return g;
}

}  // namespace moestream::jinja
