// Tokenizer loaded from a Hugging Face tokenizer.json (+ tokenizer_config.json), giving the same
// ids as the `tokenizers` library.
//
// Pipeline for encode: added/special tokens are matched first and split the text into segments;
// each remaining segment goes through the declared normalizer (NFC, NFD, NFKC, NFKD, Lowercase,
// Strip, Prepend, Replace, Sequence), the declared pre-tokenizer (Split by PCRE2 regex or literal,
// ByteLevel with or without its GPT-2 regex, Metaspace, Digits, Sequence) and the model (BPE by
// merge rank, with byte_fallback / unk_token / ignore_merges). decode maps ids to token strings
// and runs the declared decoder (ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace,
// Sequence). Unsupported components are an Error naming the component and the file, never a guess.
// The pieces live in tokenizer_components.h and the files it lists.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moestream {

class Tokenizer {
 public:
  // dir must contain tokenizer.json; tokenizer_config.json is read when present.
  static std::unique_ptr<Tokenizer> load(const std::string& dir);
  // The same from the files' contents (config_json: nullopt when there is no
  // tokenizer_config.json). `dir` only names the files in errors. No file is read, so there is no
  // chat_template.jinja either: the fuzz target builds thousands of tokenizers a second this way.
  static std::unique_ptr<Tokenizer> from_json(std::string_view tokenizer_json,
                                              std::optional<std::string_view> config_json,
                                              const std::string& dir);
  virtual ~Tokenizer() = default;

  // No special tokens are added (no BOS); special tokens written in the text are recognized.
  // The text must be valid UTF-8 (an Error otherwise). Safe to call from several threads.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Special tokens are rendered as their text. Invalid UTF-8 produced by byte tokens is kept
  // as raw bytes where `tokenizers` would write U+FFFD (callers that print may replace it).
  // An id outside the vocabulary is an Error.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;

  virtual int32_t vocab_size() const = 0;  // 1 + the largest id (model vocab and added tokens)
  virtual std::optional<int32_t> token_id(std::string_view token) const = 0;  // exact piece
  virtual std::string piece(int32_t id) const = 0;  // raw vocab string of a token (or Error)
  virtual bool is_special(int32_t id) const = 0;

  // From tokenizer_config.json: whether to prepend BOS (false when not stated), and the ids of
  // its bos_token / eos_token (nullopt when not stated).
  virtual bool add_bos() const = 0;
  virtual std::optional<int32_t> bos_id() const = 0;
  virtual std::optional<int32_t> eos_id() const = 0;
  // The chat template string from tokenizer_config.json or chat_template.jinja ("" if none).
  virtual const std::string& chat_template() const = 0;
};

// Turns a stream of token ids into text pieces that are always whole UTF-8 characters (ids the
// tokenizer does not have give no text, as in transformers): bytes of
// a character split across tokens are held back until the character is complete. Each push
// decodes only a short window of recent ids, so the cost per token does not grow with length.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(tok) {}
  std::string push(int32_t id);  // the newly completed text (may be empty)
  std::string flush();           // whatever is held back, at the end of generation

 private:
  const Tokenizer& tok_;
  std::vector<int32_t> window_;  // the most recent ids; earlier ones are fully emitted
  size_t emitted_bytes_ = 0;     // bytes of decode(window_) already returned
};

}  // namespace moestream
