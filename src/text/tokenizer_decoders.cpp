// Decoders: ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace and Sequence. They work on
// bytes: where `tokenizers` would turn bytes that are not valid UTF-8 into U+FFFD, these keep
// the bytes, so that a stream decoder can wait for the rest of a character.
#include <optional>

#include "text/tokenizer_components.h"
#include "text/tokenizer_json.h"
#include "text/unicode.h"

namespace moestream::tok {

namespace {

void replace_bytes(std::string& text, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  std::string out;
  size_t last = 0;
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, last)) {
    out.append(text, last, at - last);
    out.append(to);
    last = at + from.size();
  }
  if (last == 0) return;
  out.append(text, last);
  text = std::move(out);
}

// Inverse of the ByteLevel pre-tokenizer; all tokens become one string.
class ByteLevel final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const std::string& token : tokens) {
      size_t start = bytes.size();
      bool in_alphabet = true;
      for (size_t pos = 0; pos < token.size() && in_alphabet;) {
        int b = unicode::byte_of_char(unicode::next_code_point(token, pos));
        if (b < 0)
          in_alphabet = false;
        else
          bytes += static_cast<char>(b);
      }
      if (!in_alphabet) {  // e.g. an added token written in plain text: keep it as it is
        bytes.resize(start);
        bytes += token;
      }
    }
    tokens.assign(1, std::move(bytes));
  }
};

class Metaspace final : public Decoder {
 public:
  Metaspace(std::string replacement, bool strip_first)
      : replacement_(std::move(replacement)), strip_first_(strip_first) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    // In the first token the replacement characters are dropped (they stood for the prepended
    // space), elsewhere they become spaces.
    for (size_t i = 0; i < tokens.size(); ++i)
      replace_bytes(tokens[i], replacement_, i == 0 && strip_first_ ? "" : " ");
  }

 private:
  std::string replacement_;
  bool strip_first_;
};

// "<0x41>"-style tokens become their byte.
class ByteFallback final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string bytes;
    for (std::string& token : tokens) {
      if (auto b = byte_token(token)) {
        bytes += static_cast<char>(*b);
        continue;
      }
      if (!bytes.empty()) out.push_back(std::move(bytes));
      bytes.clear();
      out.push_back(std::move(token));
    }
    if (!bytes.empty()) out.push_back(std::move(bytes));
    tokens = std::move(out);
  }

 private:
  static std::optional<unsigned char> byte_token(const std::string& t) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return std::nullopt;
    int value = 0;
    for (char c : t.substr(3, 2)) {
      int digit = (c >= '0' && c <= '9')   ? c - '0'
                  : (c >= 'A' && c <= 'F') ? c - 'A' + 10
                  : (c >= 'a' && c <= 'f') ? c - 'a' + 10
                                           : -1;
      if (digit < 0) return std::nullopt;
      value = value * 16 + digit;
    }
    return static_cast<unsigned char>(value);
  }
};

class Fuse final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const std::string& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

// Removes up to `start` leading and `stop` trailing copies of `content` from each token.
class Strip final : public Decoder {
 public:
  Strip(std::string content, size_t start, size_t stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    const size_t n = content_.size();
    for (std::string& t : tokens) {
      size_t begin = 0, end = t.size();
      for (size_t k = 0; k < start_ && end - begin >= n && t.compare(begin, n, content_) == 0; ++k)
        begin += n;
      for (size_t k = 0; k < stop_ && end - begin >= n && t.compare(end - n, n, content_) == 0; ++k)
        end -= n;
      t = t.substr(begin, end - begin);
    }
  }

 private:
  std::string content_;
  size_t start_, stop_;
};

class Replace final : public Decoder {
 public:
  // A literal pattern is replaced bytewise (tokens may hold partial characters by now); a
  // regex needs valid UTF-8.
  Replace(std::string literal, std::optional<Regex> regex, std::string content)
      : literal_(std::move(literal)), regex_(std::move(regex)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) {
      if (regex_)
        t = regex_->replace_all(t, content_);
      else
        replace_bytes(t, literal_, content_);
    }
  }

 private:
  std::string literal_;
  std::optional<Regex> regex_;
  std::string content_;
};

class Sequence final : public Decoder {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& step : steps_) step->decode_chain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

std::unique_ptr<Decoder> make_replace(const json& spec, const Where& where) {
  const json& pattern = require(spec, "pattern", where);
  std::string content = get_string(spec, "content", where);
  if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string())
    return std::make_unique<Replace>(pattern["String"].get<std::string>(), std::nullopt, content);
  return std::make_unique<Replace>("", get_pattern(spec, "pattern", where), content);
}

std::unique_ptr<Decoder> make_metaspace(const json& spec, const Where& where) {
  bool strip_first = get_bool(spec, "add_prefix_space", where, true);
  if (spec.contains("prepend_scheme"))
    strip_first = get_string(spec, "prepend_scheme", where) != "never";
  return std::make_unique<Metaspace>(get_string(spec, "replacement", where, "\xE2\x96\x81"),
                                     strip_first);
}

}  // namespace

std::unique_ptr<Decoder> make_decoder(const json& spec, const std::string& file) {
  if (spec.is_null()) return nullptr;
  Where where{file, "decoder"};
  std::string type = type_of(spec, where);
  where.component += " " + type;
  if (type == "ByteLevel") return std::make_unique<ByteLevel>();
  if (type == "Metaspace") return make_metaspace(spec, where);
  if (type == "ByteFallback") return std::make_unique<ByteFallback>();
  if (type == "Fuse") return std::make_unique<Fuse>();
  if (type == "Strip") {
    int64_t start = get_int(spec, "start", where, 0), stop = get_int(spec, "stop", where, 0);
    if (start < 0 || stop < 0) fail(where.str(), ": start and stop must not be negative");
    return std::make_unique<Strip>(get_string(spec, "content", where), static_cast<size_t>(start),
                                   static_cast<size_t>(stop));
  }
  if (type == "Replace") return make_replace(spec, where);
  if (type == "Sequence") {
    const json& list = require(spec, "decoders", where);
    if (!list.is_array()) fail(where.str(), ": field 'decoders' must be an array");
    std::vector<std::unique_ptr<Decoder>> steps;
    for (const json& item : list)
      if (auto step = make_decoder(item, file)) steps.push_back(std::move(step));
    return std::make_unique<Sequence>(std::move(steps));
  }
  fail(file, ": unsupported decoder type '", type, "'");
}

}  // namespace moestream::tok
