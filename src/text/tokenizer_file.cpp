#include "text/tokenizer_file.h"

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "text/limits.h"

namespace moestream::tok {

namespace {

using nlohmann::json;

// A SAX handler (the interface nlohmann::json::sax_parse drives) that builds the DOM, except
// that the object at model.vocab and the array at model.merges go into `tables`.
class Reader {
 public:
  explicit Reader(TokenizerFile& out) : out_(out) {}

  bool null() { return mode_ == Mode::Dom ? insert(json()) : bad("null"); }
  bool boolean(bool b) { return mode_ == Mode::Dom ? insert(json(b)) : bad("a boolean"); }
  bool number_integer(json::number_integer_t v) {
    return mode_ == Mode::Vocab ? vocab_entry(v)
           : mode_ == Mode::Dom ? insert(json(v))
                                : bad("a number");
  }
  bool number_unsigned(json::number_unsigned_t v) {
    if (mode_ == Mode::Vocab) return vocab_entry(v > INT64_MAX ? -1 : static_cast<int64_t>(v));
    return mode_ == Mode::Dom ? insert(json(v)) : bad("a number");
  }
  bool number_float(json::number_float_t v, const std::string&) {
    return mode_ == Mode::Dom ? insert(json(v)) : bad("a fractional number");
  }
  bool binary(json::binary_t&) { return bad("binary data"); }

  bool string(std::string& s) {
    if (mode_ == Mode::Dom) return insert(json(std::move(s)));
    if (mode_ == Mode::Vocab) return bad("a string where a token id belongs");
    if (in_pair_) {
      if (pair_parts_ == 0)
        merge_.first = std::move(s);
      else if (pair_parts_ == 1)
        merge_.second = std::move(s);
      else
        return fail_with("model.merges: a merge has more than two tokens");
      ++pair_parts_;
      return true;
    }
    // The older spelling: one string "a b".
    size_t space = s.find(' ');
    if (space == std::string::npos)
      return fail_with("model.merges: merge '" + s + "' is not two tokens separated by a space");
    out_.tables.merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    return true;
  }

  bool start_object(std::size_t) {
    if (mode_ != Mode::Dom) return bad("an object");
    if (at_model_level() && key_ == "vocab") {
      mode_ = Mode::Vocab;
      out_.tables.has_vocab = true;
      return true;
    }
    return open(json::object());
  }
  bool key(std::string& k) {
    key_ = std::move(k);
    return true;
  }
  bool end_object() {
    if (mode_ == Mode::Vocab) {
      mode_ = Mode::Dom;
      return true;
    }
    return close();
  }

  bool start_array(std::size_t) {
    if (mode_ == Mode::Merges) {
      if (in_pair_) return bad("a nested array");
      in_pair_ = true;
      pair_parts_ = 0;
      return true;
    }
    if (mode_ == Mode::Vocab) return bad("an array");
    if (at_model_level() && key_ == "merges") {
      mode_ = Mode::Merges;
      out_.tables.has_merges = true;
      return true;
    }
    return open(json::array());
  }
  bool end_array() {
    if (mode_ == Mode::Merges) {
      if (!in_pair_) {
        mode_ = Mode::Dom;
        return true;
      }
      in_pair_ = false;
      if (pair_parts_ != 2) return fail_with("model.merges: a merge must be two tokens");
      out_.tables.merges.push_back(std::move(merge_));
      return true;
    }
    return close();
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    return fail_with(std::string("malformed JSON: ") + e.what());
  }

  const std::string& error() const { return error_; }

 private:
  enum class Mode { Dom, Vocab, Merges };

  // Directly inside the top-level "model" object.
  bool at_model_level() const { return stack_.size() == 2 && model_is_open_; }

  bool insert(json value) {
    place(std::move(value));
    return true;
  }
  json& place(json value) {
    if (stack_.empty()) return out_.root = std::move(value);
    json& top = *stack_.back();
    if (top.is_object()) return top[key_] = std::move(value);
    top.push_back(std::move(value));
    return top.back();
  }
  bool open(json container) {
    // Building the DOM does not recurse, but reading it does (Sequence inside Sequence, and
    // copying or printing JSON), so deep nesting stops here.
    if (stack_.size() == 1)
      field_ =
          stack_.back()->is_object() ? key_ : "[" + std::to_string(stack_.back()->size()) + "]";
    if (int(stack_.size()) >= text_limits::kMaxTokenizerJsonDepth)
      return fail_with("field '" + field_ + "' is nested more than " +
                       std::to_string(text_limits::kMaxTokenizerJsonDepth) + " levels deep");
    bool is_model = stack_.size() == 1 && stack_.back()->is_object() && key_ == "model";
    stack_.push_back(&place(std::move(container)));
    if (is_model) model_is_open_ = true;
    return true;
  }
  bool close() {
    if (stack_.size() == 2) model_is_open_ = false;
    stack_.pop_back();
    return true;
  }

  bool vocab_entry(int64_t id) {
    if (id < 0) return fail_with("model.vocab: token '" + key_ + "' has an invalid id");
    if (id > text_limits::kMaxTokenId)
      return fail_with("model.vocab: token '" + key_ + "' has id " + std::to_string(id) +
                       ", above the largest supported (" + std::to_string(text_limits::kMaxTokenId) + ")");
    out_.tables.vocab.emplace_back(std::move(key_), static_cast<int32_t>(id));
    return true;
  }

  bool bad(const char* what) {
    const char* where = mode_ == Mode::Vocab    ? "model.vocab: "
                        : mode_ == Mode::Merges ? "model.merges: "
                                                : "";
    return fail_with(std::string(where) + "unexpected " + what);
  }
  bool fail_with(std::string message) {
    error_ = std::move(message);
    return false;  // stops the parser
  }

  TokenizerFile& out_;
  std::vector<json*> stack_;  // open containers; each lives inside its parent
  std::string key_;           // the last object key seen
  std::string field_;         // the top-level field being read
  bool model_is_open_ = false;
  Mode mode_ = Mode::Dom;
  bool in_pair_ = false;  // inside one ["a", "b"] merge
  int pair_parts_ = 0;
  std::pair<std::string, std::string> merge_;
  std::string error_;
};

}  // namespace

TokenizerFile parse_tokenizer_file(std::string_view text, const std::string& path) {
  TokenizerFile file;
  file.tables.vocab.reserve(text.size() / 64);
  file.tables.merges.reserve(text.size() / 64);
  Reader reader(file);
  if (!json::sax_parse(text, &reader)) fail(path, ": ", reader.error());
  return file;
}

}  // namespace moestream::tok
