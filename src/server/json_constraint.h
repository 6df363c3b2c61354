// response_format {"type": "json_object"}: a token constraint that lets the model write only a
// JSON object. Each step masks every token whose bytes would not continue a valid JSON prefix,
// and allows end-of-sequence only once the object is complete (and then nothing else).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "server/engine.h"

namespace moestream {

class Tokenizer;

// An incremental JSON recognizer over bytes: feed() says whether a byte can continue the text.
class JsonPrefix {
 public:
  bool feed(unsigned char c);
  bool complete() const { return top_done_ && lex_ == Lex::none; }
  bool feed(const std::string& bytes) {
    for (unsigned char c : bytes)
      if (!feed(c)) return false;
    return true;
  }

 private:
  enum class Expect : uint8_t { value, key_or_close, key, colon, comma_or_close, value_or_close };
  enum class Lex : uint8_t { none, string, escape, unicode, number, literal };
  enum class Num : uint8_t { minus, zero, integer, dot, fraction, exp, exp_sign, exp_digits };
  bool value_start(unsigned char c);
  void value_end();
  bool number_accepting() const { return num_ == Num::zero || num_ == Num::integer || num_ == Num::fraction || num_ == Num::exp_digits; }

  static constexpr int kMaxDepth = 64;
  std::array<char, kMaxDepth> stack_{};
  int depth_ = 0;
  Expect expect_ = Expect::value;
  Lex lex_ = Lex::none;
  Num num_ = Num::minus;
  bool string_is_key_ = false;
  bool top_done_ = false;
  uint8_t unicode_left_ = 0;
  const char* literal_ = nullptr;  // "true", "false" or "null"
  uint8_t literal_pos_ = 0;
};

// The bytes of every token, computed once per tokenizer and shared by all requests.
struct TokenBytes {
  std::vector<std::string> bytes;  // "" for tokens the constraint never allows (special tokens)
  std::vector<int32_t> eos;
  static std::shared_ptr<const TokenBytes> build(const Tokenizer& tok, const std::vector<int32_t>& eos_ids);
};

class JsonObjectConstraint : public TokenConstraint {
 public:
  explicit JsonObjectConstraint(std::shared_ptr<const TokenBytes> vocab) : vocab_(std::move(vocab)) {}
  void mask(std::span<float> logits) override;
  void accept(int32_t token) override;

 private:
  std::shared_ptr<const TokenBytes> vocab_;
  JsonPrefix state_;
};

}  // namespace moestream
