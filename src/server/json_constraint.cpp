#include "server/json_constraint.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "text/tokenizer.h"

namespace moestream {

namespace {
bool is_space(unsigned char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }
bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
bool is_hex(unsigned char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
}  // namespace

bool JsonPrefix::value_start(unsigned char c) {
  if (depth_ == 0 && c != '{') return false;  // json_object: the top level is an object
  switch (c) {
    case '{':
    case '[':
      if (depth_ == kMaxDepth) return false;
      stack_[size_t(depth_++)] = char(c);
      expect_ = c == '{' ? Expect::key_or_close : Expect::value_or_close;
      return true;
    case '"':
      lex_ = Lex::string;
      string_is_key_ = false;
      return true;
    case 't': literal_ = "true"; break;
    case 'f': literal_ = "false"; break;
    case 'n': literal_ = "null"; break;
    default:
      if (c == '-' || is_digit(c)) {
        lex_ = Lex::number;
        num_ = c == '-' ? Num::minus : c == '0' ? Num::zero : Num::integer;
        return true;
      }
      return false;
  }
  lex_ = Lex::literal;
  literal_pos_ = 1;
  return true;
}

void JsonPrefix::value_end() {
  lex_ = Lex::none;
  if (depth_ == 0) {
    top_done_ = true;
  } else {
    expect_ = Expect::comma_or_close;
  }
}

bool JsonPrefix::feed(unsigned char c) {
  switch (lex_) {
    case Lex::string:
      if (c == '"') {
        if (string_is_key_) {
          lex_ = Lex::none;
          expect_ = Expect::colon;
        } else {
          value_end();
        }
        return true;
      }
      if (c == '\\') lex_ = Lex::escape;
      return c >= 0x20;
    case Lex::escape:
      if (c == 'u') {
        lex_ = Lex::unicode;
        unicode_left_ = 4;
        return true;
      }
      lex_ = Lex::string;
      return std::strchr("\"\\/bfnrt", c) != nullptr && c != 0;
    case Lex::unicode:
      if (!is_hex(c)) return false;
      if (--unicode_left_ == 0) lex_ = Lex::string;
      return true;
    case Lex::literal:
      if (c != (unsigned char)literal_[literal_pos_]) return false;
      if (literal_[++literal_pos_] == '\0') value_end();
      return true;
    case Lex::number:
      switch (num_) {
        case Num::minus:
          if (!is_digit(c)) return false;
          num_ = c == '0' ? Num::zero : Num::integer;
          return true;
        case Num::zero:
        case Num::integer:
          if (is_digit(c) && num_ == Num::integer) return true;
          if (c == '.') return num_ = Num::dot, true;
          if (c == 'e' || c == 'E') return num_ = Num::exp, true;
          break;
        case Num::dot:
          if (!is_digit(c)) return false;
          num_ = Num::fraction;
          return true;
        case Num::fraction:
          if (is_digit(c)) return true;
          if (c == 'e' || c == 'E') return num_ = Num::exp, true;
          break;
        case Num::exp:
          if (c == '+' || c == '-') return num_ = Num::exp_sign, true;
          if (!is_digit(c)) return false;
          num_ = Num::exp_digits;
          return true;
        case Num::exp_sign:
          if (!is_digit(c)) return false;
          num_ = Num::exp_digits;
          return true;
        case Num::exp_digits:
          if (is_digit(c)) return true;
          break;
      }
      if (!number_accepting()) return false;
      value_end();  // the number ended; the byte belongs to what follows
      return feed(c);
    case Lex::none:
      break;
  }
  if (is_space(c)) return true;
  if (top_done_) return false;
  switch (expect_) {
    case Expect::value:
      return value_start(c);
    case Expect::value_or_close:
      if (c == ']') {
        --depth_;
        value_end();
        return true;
      }
      return value_start(c);
    case Expect::key_or_close:
      if (c == '}') {
        --depth_;
        value_end();
        return true;
      }
      [[fallthrough]];
    case Expect::key:
      if (c != '"') return false;
      lex_ = Lex::string;
      string_is_key_ = true;
      return true;
    case Expect::colon:
      if (c != ':') return false;
      expect_ = Expect::value;
      return true;
    case Expect::comma_or_close: {
      const char open = stack_[size_t(depth_ - 1)];
      if (c == ',') {
        expect_ = open == '{' ? Expect::key : Expect::value;
        return true;
      }
      if ((open == '{' && c == '}') || (open == '[' && c == ']')) {
        --depth_;
        value_end();
        return true;
      }
      return false;
    }
  }
  return false;
}

std::shared_ptr<const TokenBytes> TokenBytes::build(const Tokenizer& tok, const std::vector<int32_t>& eos_ids) {
  auto t = std::make_shared<TokenBytes>();
  t->bytes.resize(size_t(tok.vocab_size()));
  for (int32_t id = 0; id < tok.vocab_size(); ++id)
    if (!tok.is_special(id)) t->bytes[size_t(id)] = tok.decode({id});
  t->eos = eos_ids;
  return t;
}

void JsonObjectConstraint::mask(std::span<float> logits) {
  const float off = -std::numeric_limits<float>::infinity();
  const bool done = state_.complete();
  for (size_t id = 0; id < logits.size(); ++id) {
    bool ok = false;
    if (id < vocab_->bytes.size() && !vocab_->bytes[id].empty() && !done) {
      JsonPrefix next = state_;
      ok = next.feed(vocab_->bytes[id]);
    }
    if (!ok) logits[id] = off;
  }
  if (done)
    for (int32_t e : vocab_->eos)
      if (size_t(e) < logits.size()) logits[size_t(e)] = 0.0f;
}

void JsonObjectConstraint::accept(int32_t token) {
  if (size_t(token) < vocab_->bytes.size()) state_.feed(vocab_->bytes[size_t(token)]);
}

}  // namespace moestream
