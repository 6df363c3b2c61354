// Tokenizer::load and the encode/decode pipeline over the components of tokenizer.json, plus
// StreamDecoder.
#include "text/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "core/files.h"
#include "text/tokenizer_added_tokens.h"
#include "text/tokenizer_components.h"
#include "text/tokenizer_file.h"
#include "text/limits.h"
#include "text/tokenizer_json.h"
#include "text/unicode.h"

namespace moestream {

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

json parse_json_text(std::string_view text, const std::string& file) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(file, ": malformed JSON: ", e.what());
  }
}

// bos_token / eos_token are a string, {"content": "..."} (AddedToken form) or null.
std::optional<std::string> config_token(const json& config, const char* key,
                                        const std::string& file) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  fail(file, ": field '", key, "' must be a string or an object with \"content\"");
}

// chat_template is a string, or a list of {"name", "template"} of which "default" is used.
std::string config_chat_template(const json& config, const std::string& file) {
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    for (const json& entry : *it)
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
          entry["template"].is_string())
        return entry["template"].get<std::string>();
    fail(file, ": chat_template is a list without a \"default\" entry");
  }
  fail(file, ": field 'chat_template' must be a string or a list of {name, template}");
}

class HfTokenizer final : public Tokenizer {
 public:
  HfTokenizer(std::string_view tokenizer_json, std::optional<std::string_view> config_json,
              const fs::path& dir);
  void set_chat_template(std::string text) { chat_template_ = std::move(text); }

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;

  int32_t vocab_size() const override { return vocab_size_; }
  std::optional<int32_t> token_id(std::string_view token) const override {
    if (auto it = added_by_content_.find(std::string(token)); it != added_by_content_.end())
      return it->second;
    return model_->token_to_id(token);
  }
  std::string piece(int32_t id) const override { return token_text(id); }
  bool is_special(int32_t id) const override {
    auto it = added_by_id_.find(id);
    return it != added_by_id_.end() && added_[it->second].special;
  }

  bool add_bos() const override { return add_bos_; }
  std::optional<int32_t> bos_id() const override { return bos_id_; }
  std::optional<int32_t> eos_id() const override { return eos_id_; }
  const std::string& chat_template() const override { return chat_template_; }

 private:
  void load_tokenizer_json(std::string_view text, const std::string& file);
  void load_config(std::string_view text, const std::string& file);
  const std::string& token_text(int32_t id) const;
  void encode_plain(std::string_view text, bool at_input_start, std::vector<int32_t>& ids) const;

  std::unique_ptr<tok::Normalizer> normalizer_;
  std::unique_ptr<tok::PreTokenizer> pre_tokenizer_;
  std::unique_ptr<tok::Model> model_;
  std::unique_ptr<tok::Decoder> decoder_;

  std::vector<tok::AddedToken> added_;
  std::unordered_map<int32_t, size_t> added_by_id_;  // id -> index in added_
  std::unordered_map<std::string, int32_t> added_by_content_;
  tok::AddedTokenMatcher raw_matcher_;         // tokens with normalized = false
  tok::AddedTokenMatcher normalized_matcher_;  // tokens with normalized = true

  int32_t vocab_size_ = 0;
  bool add_bos_ = false;
  std::optional<int32_t> bos_id_, eos_id_;
  std::string chat_template_;
};

HfTokenizer::HfTokenizer(std::string_view tokenizer_json,
                         std::optional<std::string_view> config_json, const fs::path& dir) {
  load_tokenizer_json(tokenizer_json, (dir / "tokenizer.json").string());
  if (config_json) load_config(*config_json, (dir / "tokenizer_config.json").string());
}

void HfTokenizer::load_tokenizer_json(std::string_view text, const std::string& file) {
  tok::TokenizerFile parsed = tok::parse_tokenizer_file(text, file);
  const json& root = parsed.root;
  if (!root.is_object()) fail(file, ": expected a JSON object at the top level");
  try {
    tok::Where where{file, "tokenizer"};
    normalizer_ = tok::make_normalizer(root.value("normalizer", json()), file);
    pre_tokenizer_ = tok::make_pre_tokenizer(root.value("pre_tokenizer", json()), file);
    model_ = tok::make_model(tok::require(root, "model", where), std::move(parsed.tables), file);
    decoder_ = tok::make_decoder(root.value("decoder", json()), file);

    const json& added = root.value("added_tokens", json::array());
    if (!added.is_array()) fail(file, ": field 'added_tokens' must be an array");
    for (const json& entry : added) {
      tok::Where at{file, "added_tokens entry"};
      tok::AddedToken t;
      t.content = tok::get_string(entry, "content", at);
      int64_t id = tok::get_int(entry, "id", at, -1);
      if (id < 0) fail(at.str(), " '", t.content, "': missing or invalid id");
      if (id > text_limits::kMaxTokenId)
        fail(at.str(), " '", t.content, "': id ", id, " is above the largest supported (", text_limits::kMaxTokenId, ")");
      t.id = static_cast<int32_t>(id);
      t.special = tok::get_bool(entry, "special", at, false);
      t.single_word = tok::get_bool(entry, "single_word", at, false);
      t.lstrip = tok::get_bool(entry, "lstrip", at, false);
      t.rstrip = tok::get_bool(entry, "rstrip", at, false);
      t.normalized = tok::get_bool(entry, "normalized", at, !t.special);
      if (t.content.empty()) continue;  // an empty token can never match
      added_.push_back(std::move(t));
    }
  } catch (const json::exception& e) {
    fail(file, ": ", e.what());
  }

  vocab_size_ = model_->max_id() + 1;
  std::vector<std::string> raw_patterns, normalized_patterns;
  std::vector<const tok::AddedToken*> raw_tokens, normalized_tokens;
  for (size_t i = 0; i < added_.size(); ++i) {
    const tok::AddedToken& t = added_[i];
    added_by_id_.emplace(t.id, i);
    added_by_content_.emplace(t.content, t.id);
    vocab_size_ = std::max(vocab_size_, t.id + 1);
  }
  // Special tokens go first, so they win over a plain added token with the same text.
  std::vector<const tok::AddedToken*> ordered;
  for (const auto& t : added_)
    if (t.special) ordered.push_back(&t);
  for (const auto& t : added_)
    if (!t.special) ordered.push_back(&t);
  for (const tok::AddedToken* tp : ordered) {
    const tok::AddedToken& t = *tp;
    if (t.normalized) {
      std::string pattern = t.content;
      if (normalizer_) normalizer_->normalize(pattern);
      normalized_patterns.push_back(std::move(pattern));
      normalized_tokens.push_back(&t);
    } else {
      raw_patterns.push_back(t.content);
      raw_tokens.push_back(&t);
    }
  }
  raw_matcher_ = tok::AddedTokenMatcher(raw_patterns, raw_tokens);
  normalized_matcher_ = tok::AddedTokenMatcher(normalized_patterns, normalized_tokens);
}

void HfTokenizer::load_config(std::string_view text, const std::string& file) {
  json config = parse_json_text(text, file);
  if (!config.is_object()) fail(file, ": expected a JSON object at the top level");
  auto it = config.find("add_bos_token");
  if (it != config.end() && !it->is_null()) {
    if (!it->is_boolean()) fail(file, ": field 'add_bos_token' must be true or false");
    add_bos_ = it->get<bool>();
  }
  auto resolve = [&](const char* key) -> std::optional<int32_t> {
    auto text = config_token(config, key, file);
    if (!text) return std::nullopt;
    auto id = token_id(*text);
    if (!id) fail(file, ": ", key, " '", *text, "' is not in the vocabulary");
    return id;
  };
  bos_id_ = resolve("bos_token");
  eos_id_ = resolve("eos_token");
  chat_template_ = config_chat_template(config, file);
}

const std::string& HfTokenizer::token_text(int32_t id) const {
  if (auto it = added_by_id_.find(id); it != added_by_id_.end()) return added_[it->second].content;
  if (const std::string* text = model_->id_to_token(id)) return *text;
  fail("tokenizer: token id ", id, " is not in the vocabulary (size ", vocab_size_, ")");
}

// Normalizes text that holds no raw added token, then pre-tokenizes and runs the model.
void HfTokenizer::encode_plain(std::string_view text, bool at_input_start,
                               std::vector<int32_t>& ids) const {
  std::string normalized(text);
  if (normalizer_) normalizer_->normalize(normalized);
  std::vector<tok::Piece> pieces;
  for (const auto& seg : normalized_matcher_.split(normalized)) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
      continue;
    }
    pieces.clear();
    pieces.push_back(
        {normalized.substr(seg.begin, seg.end - seg.begin), at_input_start && seg.begin == 0});
    if (pre_tokenizer_) pre_tokenizer_->pre_tokenize(pieces);
    for (const tok::Piece& piece : pieces) model_->tokenize(piece.text, ids);
  }
}

std::vector<int32_t> HfTokenizer::encode(std::string_view text) const {
  if (size_t bad = unicode::find_invalid_utf8(text); bad != std::string_view::npos)
    fail("tokenizer: input text is not valid UTF-8 (at byte ", bad, ")");
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  for (const auto& seg : raw_matcher_.split(text)) {
    if (seg.id >= 0)
      ids.push_back(seg.id);
    else
      encode_plain(text.substr(seg.begin, seg.end - seg.begin), seg.begin == 0, ids);
  }
  return ids;
}

std::string HfTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) tokens.push_back(token_text(id));
  std::string out;
  if (!decoder_) {  // no decoder: tokens joined by spaces, as tokenizers does
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  decoder_->decode_chain(tokens);
  for (const std::string& t : tokens) out += t;
  return out;
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& dir) {
  const fs::path path = fs::path(dir) / "tokenizer.json";
  if (!fs::exists(path)) fail(path.string(), ": tokenizer file not found");
  const std::string text = read_file(path.string());
  std::optional<std::string> config;
  if (fs::path config_path = fs::path(dir) / "tokenizer_config.json"; fs::exists(config_path))
    config = read_file(config_path.string());
  auto tok = std::make_unique<HfTokenizer>(text, config, fs::path(dir));
  if (fs::path jinja = fs::path(dir) / "chat_template.jinja"; fs::exists(jinja))
    tok->set_chat_template(read_file(jinja.string()));
  return tok;
}

std::unique_ptr<Tokenizer> Tokenizer::from_json(std::string_view tokenizer_json,
                                                std::optional<std::string_view> config_json,
                                                const std::string& dir) {
  return std::make_unique<HfTokenizer>(tokenizer_json, config_json, fs::path(dir));
}

// The window always decodes to a prefix-stable string (decoding more ids only appends), so
// the new text is what lies beyond emitted_bytes_. The window is cut back to its last id
// whenever nothing is held back, which keeps each push O(1).
std::string StreamDecoder::push(int32_t id) {
  constexpr size_t kMaxWindow = 8;
  constexpr size_t kHardLimit = 64;  // ids that add no bytes cannot grow the window forever
  // A model's output head may have more rows than the tokenizer has tokens (Qwen3: 151936 rows,
  // 151669 tokens); such an id stands for no text, as transformers' decode treats it.
  if (id < 0 || id >= tok_.vocab_size()) return "";
  window_.push_back(id);
  std::string text = tok_.decode(window_);
  if (text.size() < emitted_bytes_) emitted_bytes_ = text.size();
  size_t complete = unicode::complete_prefix(text, emitted_bytes_);
  if (window_.size() >= kHardLimit) complete = text.size();
  // Only a forced emission (kHardLimit) can cut a character; what is emitted is always valid.
  std::string out = unicode::to_valid_utf8(std::string_view(text).substr(emitted_bytes_, complete - emitted_bytes_));
  emitted_bytes_ = complete;
  if (complete == text.size() && window_.size() >= kMaxWindow) {
    window_.erase(window_.begin(), window_.end() - 1);
    emitted_bytes_ = tok_.decode(window_).size();
  }
  return out;
}

std::string StreamDecoder::flush() {
  std::string text = tok_.decode(window_);
  // A reply cut inside a character (a token limit, a stop) ends in U+FFFD, as transformers
  // decodes it, never in bytes that are not UTF-8 (the next turn's prompt must encode).
  std::string out = text.size() > emitted_bytes_ ? unicode::to_valid_utf8(std::string_view(text).substr(emitted_bytes_)) : "";
  emitted_bytes_ = text.size();
  return out;
}

}  // namespace moestream
