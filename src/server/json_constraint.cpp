#include "server/json_constraint.h"

#include <array>
#include <bit>
#include <cstring>
#include <limits>

#include "text/tokenizer.h"

namespace moestream {

namespace {

bool is_space(unsigned char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }
bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
bool is_hex(unsigned char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

using Kind = JsonGrammar::Kind;

// Frame kinds: a value being written, or a container waiting for its next part.
enum FrameKind : uint8_t { f_object, f_map, f_array, f_string, f_number, f_literals, f_call };
// Container phases.
enum : uint8_t { p_open, p_key_start, p_key, p_colon, p_value, p_after };
// String phases.
enum : uint8_t { s_chars, s_escape, s_unicode };
// Number phases (JSON's number grammar).
enum : uint8_t { n_minus, n_zero, n_integer, n_dot, n_fraction, n_exp, n_exp_sign, n_exp_digits };
// Call phases.
enum : uint8_t { c_text, c_value, c_tail };

constexpr uint32_t kMaxNumber = 32;  // bytes of a number

bool number_accepting(uint8_t phase) {
  return phase == n_zero || phase == n_integer || phase == n_fraction || phase == n_exp_digits;
}

uint64_t bit(size_t i) { return uint64_t(1) << i; }

}  // namespace

JsonGrammar::JsonGrammar() {
  nodes.resize(kBuiltins);
  nodes[kAny].kind = Kind::any;
  nodes[kAnyString] = {.kind = Kind::string, .max = kMaxString};
  nodes[kKeyString] = {.kind = Kind::string, .max = kMaxKey};
  nodes[kAnyObject] = {.kind = Kind::map, .child = kAny};
  nodes[kAnyArray] = {.kind = Kind::array, .child = kAny, .max = kMaxItems};
  nodes[kNumber].kind = Kind::number;
  nodes[kTrueFalseNull] = {.kind = Kind::literals, .texts = {"true", "false", "null"}};
  nodes[kBoolean] = {.kind = Kind::literals, .texts = {"true", "false"}};
  nodes[kNull] = {.kind = Kind::literals, .texts = {"null"}};
}

int JsonGrammar::add(Node n) {
  nodes.push_back(std::move(n));
  return int(nodes.size() - 1);
}

std::shared_ptr<const JsonGrammar> JsonGrammar::after(const std::string& text, std::shared_ptr<const JsonGrammar> g) {
  auto out = std::make_shared<JsonGrammar>(*g);
  out->root = out->add({.kind = Kind::call, .texts = {text}, .alts = {g->root}});
  return out;
}

std::shared_ptr<const JsonGrammar> JsonGrammar::any_object() {
  static const std::shared_ptr<const JsonGrammar> g = [] {
    auto g = std::make_shared<JsonGrammar>();
    g->root = kAnyObject;
    return g;
  }();
  return g;
}

JsonMatcher::JsonMatcher(std::shared_ptr<const JsonGrammar> grammar) : g_(std::move(grammar)) {}

JsonMatcher& JsonMatcher::operator=(const JsonMatcher& o) {
  if (this == &o) return *this;
  if (g_ != o.g_) g_ = o.g_;  // the constraint's trial copies share one grammar: no refcount traffic
  depth_ = o.depth_;
  space_run_ = o.space_run_;
  done_ = o.done_;
  std::memcpy(frames_, o.frames_, sizeof(Frame) * size_t(depth_));
  return *this;
}

bool JsonMatcher::push(Frame f) {
  if (depth_ == kMaxDepth) return false;
  frames_[depth_++] = f;
  return true;
}

// The top value is complete: the container below it already moved to its next phase (a call
// with nothing after its node is complete too).
void JsonMatcher::pop() {
  if (--depth_ == 0) {
    done_ = true;
    return;
  }
  const Frame& f = frames_[depth_ - 1];
  if (f.kind == f_call && f.phase == c_tail && g_->nodes[f.node].tail.empty()) pop();
}

bool JsonMatcher::complete() const {
  if (depth_ == 0) return done_;
  // The top value may end here (a number, or a literal that is whole), and each frame below it
  // is a call whose text after its node is written (an empty one).
  const Frame& f = frames_[depth_ - 1];
  bool ends = false;
  if (f.kind == f_number) ends = number_accepting(f.phase);
  if (f.kind == f_literals) {
    const auto& texts = g_->nodes[f.node].texts;
    for (size_t i = 0; i < texts.size(); ++i)
      if ((f.alive & bit(i)) && texts[i].size() == f.pos) ends = true;
  }
  for (int i = depth_ - 2; ends && i >= 0; --i) {
    const Frame& below = frames_[i];
    ends = below.kind == f_call && below.phase == c_tail && g_->nodes[below.node].tail.size() == below.pos;
  }
  return ends;
}

// Starts a value of `node` whose first byte is c.
bool JsonMatcher::start(int node, unsigned char c) {
  const JsonGrammar::Node& n = g_->nodes[size_t(node)];
  Frame f;
  f.node = uint16_t(node);
  auto literals = [&](uint8_t kind) {
    f.kind = kind;
    for (size_t i = 0; i < n.texts.size(); ++i)
      if (!n.texts[i].empty() && (unsigned char)n.texts[i][0] == c) f.alive |= bit(i);
    if (!f.alive || !push(f)) return false;
    const Result r = feed_top(frames_[depth_ - 1], c);
    if (r == ended) pop();  // a one-byte literal
    return r != rejected;
  };
  // Containers need room for what goes inside them.
  const bool room = depth_ + 2 <= kMaxDepth;
  switch (n.kind) {
    case Kind::any:
      if (c == '{') return start(JsonGrammar::kAnyObject, c);
      if (c == '[') return start(JsonGrammar::kAnyArray, c);
      if (c == '"') return start(JsonGrammar::kAnyString, c);
      if (c == '-' || is_digit(c)) return start(JsonGrammar::kNumber, c);
      return start(JsonGrammar::kTrueFalseNull, c);
    case Kind::object:
      if (c != '{' || !room) return false;
      f.kind = f_object;
      return push(f);
    case Kind::map:
      if (c != '{' || !room) return false;
      f.kind = f_map;
      return push(f);
    case Kind::array:
      if (c != '[' || !room) return false;
      f.kind = f_array;
      return push(f);
    case Kind::string:
      if (c != '"') return false;
      f.kind = f_string;
      return push(f);
    case Kind::number:
    case Kind::integer:
      if (c != '-' && !is_digit(c)) return false;
      f.kind = f_number;
      f.phase = c == '-' ? n_minus : c == '0' ? n_zero : n_integer;
      f.count = 1;
      return push(f);
    case Kind::literals:
      return literals(f_literals);
    case Kind::call:
      return literals(f_call);
    case Kind::choice:
      for (int alt : n.alts) {
        JsonMatcher trial = *this;
        if (trial.start(alt, c)) return start(alt, c);
      }
      return false;
  }
  return false;
}

bool JsonMatcher::structural_space(unsigned char c) {
  if (!is_space(c)) {
    space_run_ = 0;
    return false;
  }
  return true;
}

JsonMatcher::Result JsonMatcher::feed_top(Frame& f, unsigned char c) {
  const JsonGrammar::Node& n = g_->nodes[f.node];
  switch (f.kind) {
    case f_string:
      if (f.phase == s_escape) {
        if (c == 'u') return f.phase = s_unicode, f.pos = 4, consumed;
        if (c == 0 || !std::strchr("\"\\/bfnrt", c)) return rejected;
        return f.phase = s_chars, consumed;
      }
      if (f.phase == s_unicode) {
        if (!is_hex(c)) return rejected;
        // No surrogates (\uD800-\uDFFF): a lone one is refused by most parsers, and a pair needs
        // characters a model writes as UTF-8 anyway.
        if (f.pos == 4) f.seen = (c == 'd' || c == 'D');
        if (f.pos == 3 && f.seen && !(c >= '0' && c <= '7')) return rejected;
        if (--f.pos == 0) f.phase = s_chars;
        return consumed;
      }
      if (f.pos > 0) {
        // Inside a UTF-8 character (pos bytes to come; seen: its first byte): only the bytes
        // that make it valid UTF-8, so the text needs no replacement characters.
        uint8_t lo = 0x80, hi = 0xBF;
        if (f.seen == 0xE0) lo = 0xA0;       // no overlong forms
        else if (f.seen == 0xED) hi = 0x9F;  // no surrogates
        else if (f.seen == 0xF0) lo = 0x90;
        else if (f.seen == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
        if (c < lo || c > hi) return rejected;
        f.seen = 0;
        --f.pos;
        return consumed;
      }
      if (c == '"') return f.count >= n.min ? ended : rejected;
      if (c < 0x20 || c == 0x7F) return rejected;
      if (f.count >= n.max) return rejected;
      if (c >= 0x80) {
        if (c >= 0xC2 && c <= 0xDF) f.pos = 1;
        else if (c >= 0xE0 && c <= 0xEF) f.pos = 2;
        else if (c >= 0xF0 && c <= 0xF4) f.pos = 3;
        else return rejected;
        f.seen = c;
      }
      ++f.count;
      if (c == '\\') f.phase = s_escape;
      return consumed;
    case f_number: {
      const bool integer = n.kind == Kind::integer;
      // Integers stay within 18 digits, so they fit an int64 where the client parses them.
      const bool room = f.count < (integer ? 18u : kMaxNumber);
      // Near the cap only digits, so a number can always end.
      const bool room_for_sign = f.count + 4 < kMaxNumber;
      auto next = [&](uint8_t phase) {
        f.phase = phase;
        ++f.count;
        return consumed;
      };
      switch (f.phase) {
        case n_minus:
          if (!is_digit(c) || !room) return rejected;
          return next(c == '0' ? n_zero : n_integer);
        case n_zero:
        case n_integer:
          if (room && is_digit(c) && f.phase == n_integer) return next(n_integer);
          if (room_for_sign && !integer && c == '.') return next(n_dot);
          if (room_for_sign && !integer && (c == 'e' || c == 'E')) return next(n_exp);
          break;
        case n_dot:
          if (!is_digit(c) || !room) return rejected;
          return next(n_fraction);
        case n_fraction:
          if (room && is_digit(c)) return next(n_fraction);
          if (room_for_sign && (c == 'e' || c == 'E')) return next(n_exp);
          break;
        case n_exp:
          if (room && (c == '+' || c == '-')) return next(n_exp_sign);
          [[fallthrough]];
        case n_exp_sign:
          if (!is_digit(c) || !room) return rejected;
          f.pos = 1;
          return next(n_exp_digits);
        case n_exp_digits:
          // At most two exponent digits: 1e999 would overflow a double, and parsers refuse it.
          if (room && is_digit(c) && f.pos < 2) return ++f.pos, next(n_exp_digits);
          break;
      }
      return number_accepting(f.phase) ? ended_before : rejected;  // the byte belongs to what follows
    }
    case f_literals:
    case f_call: {
      if (f.kind == f_call && f.phase == c_tail) {
        if ((unsigned char)n.tail[f.pos] != c) return rejected;
        return ++f.pos == n.tail.size() ? ended : consumed;
      }
      if (f.kind == f_call && f.phase == c_value) {
        f.phase = c_tail;
        f.pos = 0;
        return start(n.alts[f.count], c) ? consumed : rejected;
      }
      uint64_t alive = 0;
      bool whole = false;
      for (size_t i = 0; i < n.texts.size(); ++i) {
        if (!(f.alive & bit(i))) continue;
        if (f.pos < n.texts[i].size() && (unsigned char)n.texts[i][f.pos] == c) alive |= bit(i);
        else if (n.texts[i].size() == f.pos) whole = true;
      }
      if (!alive) return whole && f.kind == f_literals ? ended_before : rejected;
      f.alive = alive;
      ++f.pos;
      // Every remaining text is whole: the value ends here (calls go on to their node).
      bool longer = false;
      int64_t whole_one = -1;
      for (size_t i = 0; i < n.texts.size(); ++i)
        if (alive & bit(i)) {
          if (n.texts[i].size() > f.pos) longer = true;
          else whole_one = int64_t(i);
        }
      if (f.kind == f_call) {
        if (whole_one >= 0) f.phase = c_value, f.count = uint32_t(whole_one);  // texts are prefix-free
        return consumed;
      }
      return longer ? consumed : ended;
    }
    default:
      break;
  }
  // Containers.
  if (f.phase != p_key && structural_space(c)) {
    if (space_run_ >= kMaxWhitespace) return rejected;
    ++space_run_;
    return consumed;
  }
  const uint64_t all = n.props.size() >= 64 ? ~uint64_t(0) : bit(n.props.size()) - 1;
  switch (f.phase) {
    case p_open:
      if (f.kind == f_array) {
        if (c == ']') return n.min == 0 ? ended : rejected;
        if (n.max == 0) return rejected;
        f.phase = p_after;
        f.count = 1;
        return start(n.child, c) ? consumed : rejected;
      }
      if (c == '}') return (f.kind == f_map || (n.required & ~f.seen) == 0) ? ended : rejected;
      [[fallthrough]];
    case p_key_start:
      if (c != '"') return rejected;
      if (f.kind == f_map) {
        f.phase = p_colon;
        ++f.count;
        return start(JsonGrammar::kKeyString, c) ? consumed : rejected;
      }
      if ((all & ~f.seen) == 0) return rejected;
      f.phase = p_key;
      f.alive = all & ~f.seen;
      f.pos = 0;
      return consumed;
    case p_key: {
      uint64_t alive = 0;
      int64_t whole = -1;
      for (size_t i = 0; i < n.props.size(); ++i) {
        if (!(f.alive & bit(i))) continue;
        const std::string& k = n.props[i].key;
        if (f.pos < k.size() && (unsigned char)k[f.pos] == c) alive |= bit(i);
        else if (k.size() == f.pos) whole = int64_t(i);
      }
      if (alive) {
        f.alive = alive;
        ++f.pos;
        return consumed;
      }
      if (c != '"' || whole < 0) return rejected;
      f.seen |= bit(size_t(whole));
      f.count = uint32_t(whole);
      f.phase = p_colon;
      return consumed;
    }
    case p_colon:
      if (c != ':') return rejected;
      f.phase = p_value;
      return consumed;
    case p_value: {
      f.phase = p_after;
      int node = n.child;
      if (f.kind == f_object) node = n.props[f.count].node;
      if (f.kind == f_array) ++f.count;
      return start(node, c) ? consumed : rejected;
    }
    case p_after:
      if (f.kind == f_array) {
        if (c == ']') return f.count >= n.min ? ended : rejected;
        if (c != ',' || f.count >= n.max) return rejected;
        f.phase = p_value;
        return consumed;
      }
      if (c == '}') return (f.kind == f_map || (n.required & ~f.seen) == 0) ? ended : rejected;
      if (c != ',') return rejected;
      if (f.kind == f_map ? f.count >= JsonGrammar::kMaxMembers : (all & ~f.seen) == 0) return rejected;
      f.phase = p_key_start;
      return consumed;
  }
  return rejected;
}

bool JsonMatcher::feed(unsigned char c) {
  if (depth_ == 0) {
    if (done_) return false;
    // Space may lead a JSON value; a tool call starts at once (its markup is the whole reply).
    if (g_->nodes[size_t(g_->root)].kind != Kind::call && structural_space(c)) {
      if (space_run_ >= kMaxWhitespace) return false;
      ++space_run_;
      return true;
    }
    return start(g_->root, c);
  }
  // The frame may change below it (a value starting pushes one), so its index is kept.
  const int at = depth_ - 1;
  const Result r = feed_top(frames_[at], c);
  if (r == rejected) return false;
  if (r == consumed) return true;
  pop();
  return r == ended || feed(c);  // a number or literal ends on the byte after it, fed to its parent
}

std::shared_ptr<const TokenBytes> TokenBytes::build(const Tokenizer& tok, const std::vector<int32_t>& eos_ids) {
  auto t = std::make_shared<TokenBytes>();
  t->bytes.resize(size_t(tok.vocab_size()));
  for (int32_t id = 0; id < tok.vocab_size(); ++id)
    if (!tok.is_special(id)) t->bytes[size_t(id)] = tok.decode({id});
  t->eos = eos_ids;
  return t;
}

void GrammarConstraint::mask(std::span<float> logits) {
  const float off = -std::numeric_limits<float>::infinity();
  // Most tokens fail on their first byte; the 256 first bytes are tried once.
  std::array<bool, 256> first{};
  JsonMatcher next = state_;
  for (int b = 0; b < 256; ++b) {
    next = state_;
    first[size_t(b)] = next.feed((unsigned char)b);
  }
  for (size_t id = 0; id < logits.size(); ++id) {
    bool ok = false;
    if (id < vocab_->bytes.size()) {
      const std::string& bytes = vocab_->bytes[id];
      if (!bytes.empty() && first[(unsigned char)bytes[0]]) {
        next = state_;
        ok = next.feed(std::string_view(bytes));
      }
    }
    if (!ok) logits[id] = off;
  }
  if (state_.complete())
    for (int32_t e : vocab_->eos)
      if (size_t(e) < logits.size()) logits[size_t(e)] = 0.0f;
}

void GrammarConstraint::accept(int32_t token) {
  if (size_t(token) < vocab_->bytes.size()) state_.feed(std::string_view(vocab_->bytes[size_t(token)]));
}

TriggeredConstraint::TriggeredConstraint(std::shared_ptr<const TokenBytes> vocab, std::string trigger,
                                         std::shared_ptr<const JsonGrammar> grammar)
    : vocab_(std::move(vocab)), trigger_(std::move(trigger)), grammar_(std::move(grammar)) {
  for (size_t id = 0; id < vocab_->bytes.size(); ++id)
    if (vocab_->bytes[id].find(trigger_.back()) != std::string::npos) may_complete_.push_back(int32_t(id));
}

bool TriggeredConstraint::free_ok(const std::string& bytes) const {
  const std::string text = recent_ + bytes;
  const size_t at = text.find(trigger_);
  if (at == std::string::npos) return true;
  JsonMatcher m(grammar_);
  return m.feed(std::string_view(text).substr(at + trigger_.size()));
}

void TriggeredConstraint::mask(std::span<float> logits) {
  if (active_) return active_->mask(logits);
  const float off = -std::numeric_limits<float>::infinity();
  for (int32_t id : may_complete_)
    if (size_t(id) < logits.size() && !free_ok(vocab_->bytes[size_t(id)])) logits[size_t(id)] = off;
}

void TriggeredConstraint::accept(int32_t token) {
  if (size_t(token) >= vocab_->bytes.size()) return;
  const std::string& bytes = vocab_->bytes[size_t(token)];
  if (active_) {
    active_->accept(token);
    if (active_->state().complete()) active_.reset(), recent_.clear();
    return;
  }
  const std::string text = recent_ + bytes;
  const size_t at = text.find(trigger_);
  if (at == std::string::npos) {
    recent_ = text.substr(text.size() - std::min(text.size(), trigger_.size() - 1));
    return;
  }
  active_.emplace(vocab_, grammar_);
  active_->feed(std::string_view(text).substr(at + trigger_.size()));
  if (active_->state().complete()) active_.reset(), recent_.clear();
}

}  // namespace moestream
