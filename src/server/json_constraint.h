// Constrained decoding for JSON output: response_format json_object and json_schema, and forced
// tool calls. A grammar (JsonGrammar, compiled from a JSON Schema by json_schema.h or built here)
// drives a byte-level pushdown recognizer (JsonMatcher); each step the constraint masks every
// token whose bytes would not continue a valid prefix, and allows end-of-sequence only once the
// value is complete (and then nothing else).
//
// So that even a model that writes noise ends with a valid value, every unbounded part has a cap:
// runs of insignificant whitespace (kMaxWhitespace bytes, which also stops greedy decoding from
// looping on tabs), strings without maxLength, arrays without maxItems, members of free-form
// objects, number lengths and nesting. Objects with declared properties hold only those (in any
// order), which is a valid instance whatever additionalProperties says.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "server/engine.h"

namespace moestream {

class Tokenizer;

struct JsonGrammar {
  static constexpr uint32_t kMaxString = 2048;   // characters of a string without maxLength
  static constexpr uint32_t kMaxKey = 256;       // characters of a free-form object's key
  static constexpr uint32_t kMaxItems = 256;     // items of an array without maxItems
  static constexpr uint32_t kMaxMembers = 256;   // members of a free-form object
  static constexpr size_t kMaxProperties = 64;   // declared properties of one object
  static constexpr size_t kMaxLiterals = 64;     // enum values

  enum class Kind : uint8_t { any, object, map, array, string, number, integer, literals, choice, call };
  struct Property {
    std::string key;  // as written between the quotes (JSON-escaped)
    int node = 0;
  };
  struct Node {
    Kind kind = Kind::any;
    std::vector<Property> props;     // object
    uint64_t required = 0;           // object: a bit per property
    int child = 0;                   // map: the values' node; array: the items' node
    uint32_t min = 0, max = 0;       // array: items; string: characters
    std::vector<std::string> texts;  // literals: compact JSON texts; call: the text before each node
    std::vector<int> alts;           // choice: alternatives (told apart by first byte); call: nodes
    std::string tail;                // call: the text after the node
  };
  // Nodes every grammar has, at these indices.
  enum Builtin : int { kAny, kAnyObject, kAnyString, kKeyString, kAnyArray, kNumber, kTrueFalseNull, kBoolean, kNull, kBuiltins };

  std::vector<Node> nodes;
  int root = kAny;

  JsonGrammar();
  int add(Node n);
  // {"type": "json_object"}: any object.
  static std::shared_ptr<const JsonGrammar> any_object();
  // `text`, then what g matches (a prompt that opened a reasoning block: "</think>\n\n" first).
  static std::shared_ptr<const JsonGrammar> after(const std::string& text, std::shared_ptr<const JsonGrammar> g);
};

// An incremental recognizer over bytes: feed() says whether a byte can continue the text.
// Copying one is cheap (only the frames in use), so the constraint tries each token on a copy.
class JsonMatcher {
 public:
  static constexpr int kMaxDepth = 48;
  static constexpr int kMaxWhitespace = 16;  // longest run of insignificant whitespace

  explicit JsonMatcher(std::shared_ptr<const JsonGrammar> grammar);
  JsonMatcher(const JsonMatcher& o) { *this = o; }
  JsonMatcher& operator=(const JsonMatcher& o);

  bool feed(unsigned char c);
  bool feed(std::string_view bytes) {
    for (unsigned char c : bytes)
      if (!feed(c)) return false;
    return true;
  }
  bool complete() const;  // the text so far is a whole value (it may still go on, e.g. a number)

 private:
  struct Frame {
    uint16_t node = 0;
    uint8_t kind = 0, phase = 0;
    uint32_t count = 0;
    uint32_t pos = 0;
    uint64_t alive = 0, seen = 0;
  };
    // ended: the byte was the value's last; ended_before: the value ended before the byte (a number).
  enum Result { rejected, consumed, ended, ended_before };
  bool start(int node, unsigned char c);
  bool push(Frame f);
  void pop();
  Result feed_top(Frame& f, unsigned char c);
  bool structural_space(unsigned char c);

  std::shared_ptr<const JsonGrammar> g_;
  Frame frames_[kMaxDepth];
  int depth_ = 0;
  int space_run_ = 0;
  bool done_ = false;
};

// The bytes of every token, computed once per tokenizer and shared by all requests.
struct TokenBytes {
  std::vector<std::string> bytes;  // "" for tokens the constraint never allows (special tokens)
  std::vector<int32_t> eos;
  static std::shared_ptr<const TokenBytes> build(const Tokenizer& tok, const std::vector<int32_t>& eos_ids);
};

class GrammarConstraint : public TokenConstraint {
 public:
  GrammarConstraint(std::shared_ptr<const TokenBytes> vocab, std::shared_ptr<const JsonGrammar> grammar)
      : vocab_(std::move(vocab)), state_(std::move(grammar)) {}
  void mask(std::span<float> logits) override;
  void accept(int32_t token) override;
  const JsonMatcher& state() const { return state_; }
  void feed(std::string_view bytes) { state_.feed(bytes); }  // text written without a token

 private:
  std::shared_ptr<const TokenBytes> vocab_;
  JsonMatcher state_;
};

// Free text, until the model writes `trigger` (the opening of a tool call): from there the text
// must follow the grammar to its end, then it is free again. tool_choice "auto" with strict tools:
// the model decides whether to call, but a call it makes has well-formed arguments.
class TriggeredConstraint : public TokenConstraint {
 public:
  TriggeredConstraint(std::shared_ptr<const TokenBytes> vocab, std::string trigger,
                      std::shared_ptr<const JsonGrammar> grammar);
  void mask(std::span<float> logits) override;
  void accept(int32_t token) override;
  bool inside() const { return active_.has_value(); }

 private:
  // Whether free text followed by `bytes` is fine: if it completes the trigger, what follows the
  // trigger in `bytes` must start the grammar.
  bool free_ok(const std::string& bytes) const;

  std::shared_ptr<const TokenBytes> vocab_;
  std::string trigger_;
  std::shared_ptr<const JsonGrammar> grammar_;
  std::vector<int32_t> may_complete_;  // tokens holding the trigger's last byte
  std::optional<GrammarConstraint> active_;  // inside a triggered part
  std::string recent_;                 // the end of the free text (shorter than the trigger)
};

// response_format {"type": "json_object"}.
class JsonObjectConstraint : public GrammarConstraint {
 public:
  explicit JsonObjectConstraint(std::shared_ptr<const TokenBytes> vocab)
      : GrammarConstraint(std::move(vocab), JsonGrammar::any_object()) {}
};

// A recognizer of JSON object prefixes (json_object's grammar).
class JsonPrefix : public JsonMatcher {
 public:
  JsonPrefix() : JsonMatcher(JsonGrammar::any_object()) {}
  using JsonMatcher::feed;
  bool feed(const std::string& bytes) { return JsonMatcher::feed(std::string_view(bytes)); }
};

}  // namespace moestream
