// Tokenizer loaded from a Hugging Face tokenizer.json (+ tokenizer_config.json).
//
// Pipeline for encode: added/special tokens are matched first and split the text into segments;
// each remaining segment goes through the declared normalizer (NFC, ...), the declared
// pre-tokenizer (Sequence of Split regexes via PCRE2, ByteLevel with or without its GPT-2 regex,
// ...), and the model (byte-level BPE by merge rank). decode concatenates token pieces and runs
// the declared decoder (ByteLevel maps its 256 printable stand-ins back to bytes), so the exact
// input text comes back. Unsupported components are an Error naming the component, never a guess.
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
  virtual ~Tokenizer() = default;

  // No special tokens are added (no BOS); special tokens written in the text are recognized.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Special tokens are rendered as their text. Invalid UTF-8 produced by byte tokens is kept
  // as raw bytes (callers that print may replace it).
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;

  virtual int32_t vocab_size() const = 0;  // 1 + the largest id (model vocab and added tokens)
  virtual std::optional<int32_t> token_id(std::string_view token) const = 0;  // exact piece
  virtual std::string piece(int32_t id) const = 0;  // raw vocab string of a token
  virtual bool is_special(int32_t id) const = 0;

  // From tokenizer_config.json: whether to prepend BOS, and the bos/eos token strings.
  virtual bool add_bos() const = 0;
  virtual std::optional<int32_t> bos_id() const = 0;
  virtual std::optional<int32_t> eos_id() const = 0;
  // The chat template string from tokenizer_config.json or chat_template.jinja ("" if none).
  virtual const std::string& chat_template() const = 0;
};

// Turns a stream of token ids into text pieces that are always whole UTF-8 characters: bytes of
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
