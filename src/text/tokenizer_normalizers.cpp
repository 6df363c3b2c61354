// Normalizers: NFC, NFD, NFKC, NFKD, Lowercase, Strip, Prepend, Replace and Sequence.
#include "text/tokenizer_components.h"
#include "text/tokenizer_json.h"
#include "text/unicode.h"

namespace moestream::tok {

namespace {

class UnicodeForm final : public Normalizer {
 public:
  explicit UnicodeForm(unicode::Form form) : form_(form) {}
  void normalize(std::string& text) const override { text = unicode::normalize(text, form_); }

 private:
  unicode::Form form_;
};

class Lowercase final : public Normalizer {
 public:
  void normalize(std::string& text) const override { text = unicode::lowercase(text); }
};

// Removes leading and/or trailing White_Space characters.
class Strip final : public Normalizer {
 public:
  Strip(bool left, bool right) : left_(left), right_(right) {}
  void normalize(std::string& text) const override {
    size_t begin = 0, end = text.size();
    if (left_) {
      while (begin < end) {
        size_t next = begin;
        if (!unicode::is_white_space(unicode::next_code_point(text, next))) break;
        begin = next;
      }
    }
    if (right_) {
      while (end > begin) {
        size_t start = end - 1;
        while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
        size_t pos = start;
        if (!unicode::is_white_space(unicode::next_code_point(text, pos))) break;
        end = start;
      }
    }
    text = text.substr(begin, end - begin);
  }

 private:
  bool left_, right_;
};

// SentencePiece-style models prepend "▁" to every non-empty segment.
class Prepend final : public Normalizer {
 public:
  explicit Prepend(std::string prefix) : prefix_(std::move(prefix)) {}
  void normalize(std::string& text) const override {
    if (!text.empty()) text.insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

class Replace final : public Normalizer {
 public:
  Replace(Regex pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void normalize(std::string& text) const override { text = pattern_.replace_all(text, content_); }

 private:
  Regex pattern_;
  std::string content_;
};

class Sequence final : public Normalizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  void normalize(std::string& text) const override {
    for (const auto& step : steps_) step->normalize(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(const json& spec, const std::string& file) {
  if (spec.is_null()) return nullptr;
  Where where{file, "normalizer"};
  std::string type = type_of(spec, where);
  where.component += " " + type;
  if (type == "NFC") return std::make_unique<UnicodeForm>(unicode::Form::NFC);
  if (type == "NFD") return std::make_unique<UnicodeForm>(unicode::Form::NFD);
  if (type == "NFKC") return std::make_unique<UnicodeForm>(unicode::Form::NFKC);
  if (type == "NFKD") return std::make_unique<UnicodeForm>(unicode::Form::NFKD);
  if (type == "Lowercase") return std::make_unique<Lowercase>();
  if (type == "Strip")
    return std::make_unique<Strip>(get_bool(spec, "strip_left", where, true),
                                   get_bool(spec, "strip_right", where, true));
  if (type == "Prepend") return std::make_unique<Prepend>(get_string(spec, "prepend", where));
  if (type == "Replace")
    return std::make_unique<Replace>(get_pattern(spec, "pattern", where),
                                     get_string(spec, "content", where));
  if (type == "Sequence") {
    const json& list = require(spec, "normalizers", where);
    if (!list.is_array()) fail(where.str(), ": field 'normalizers' must be an array");
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (const json& item : list)
      if (auto step = make_normalizer(item, file)) steps.push_back(std::move(step));
    return std::make_unique<Sequence>(std::move(steps));
  }
  fail(file, ": unsupported normalizer type '", type, "'");
}

}  // namespace moestream::tok
