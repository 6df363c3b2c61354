// The four replaceable stages of a Hugging Face tokenizer.json pipeline, each built from its
// JSON object by a factory that knows the supported "type" values:
//   Normalizer   rewrites a text segment (NFC, Lowercase, Prepend, Replace, Sequence, ...)
//   PreTokenizer cuts segments into pieces (Split, ByteLevel, Metaspace, Digits, Sequence)
//   Model        turns one piece into token ids (BPE)
//   Decoder      turns token strings back into text (ByteLevel, Metaspace, ByteFallback, ...)
// A factory meeting an unknown type throws an Error naming the component, the type and the file.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moestream::tok {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(std::string& text) const = 0;
};

// A piece of text on its way to the model. at_input_start marks a piece that begins at the
// first byte of the encoded input (Metaspace's prepend_scheme "first" depends on it).
struct Piece {
  std::string text;
  bool at_input_start = false;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces each piece by the pieces it splits into; empty pieces are dropped.
  virtual void pre_tokenize(std::vector<Piece>& pieces) const = 0;
};

class Model {
 public:
  virtual ~Model() = default;
  // Appends the ids for one pre-tokenized piece. Safe to call from several threads.
  virtual void tokenize(std::string_view piece, std::vector<int32_t>& ids) const = 0;
  virtual std::optional<int32_t> token_to_id(std::string_view token) const = 0;
  virtual const std::string* id_to_token(int32_t id) const = 0;  // nullptr when unknown
  virtual int32_t max_id() const = 0;                            // -1 for an empty vocab
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  // Rewrites the list of token strings; the decoded text is their concatenation. Strings hold
  // bytes: a byte token that does not complete a character stays a raw byte.
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

// The model's "vocab" and "merges", kept out of the JSON DOM (see tokenizer_file.h).
struct VocabAndMerges {
  std::vector<std::pair<std::string, int32_t>> vocab;       // in file order
  std::vector<std::pair<std::string, std::string>> merges;  // by rank
  bool has_vocab = false, has_merges = false;
};

// `file` is only used in error messages. A JSON null gives nullptr (the stage is skipped).
std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& spec, const std::string& file);
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& spec,
                                                 const std::string& file);
std::unique_ptr<Model> make_model(const nlohmann::json& spec, VocabAndMerges tables,
                                  const std::string& file);
std::unique_ptr<Decoder> make_decoder(const nlohmann::json& spec, const std::string& file);

}  // namespace moestream::tok
