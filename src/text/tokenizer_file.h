// Reads tokenizer.json. A real one is mostly the model's vocab (150k entries) and merges
// (150k pairs); building a JSON DOM for those would cost more than the rest of loading, so a
// streaming parser puts them straight into vectors and builds a DOM only for everything else.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "text/tokenizer_components.h"

namespace moestream::tok {

struct TokenizerFile {
  nlohmann::json root;    // the whole file except model.vocab and model.merges
  VocabAndMerges tables;  // model.vocab and model.merges
};

// Parses the text of tokenizer.json. Errors (malformed JSON, a vocab id that is not an integer, a
// merge that is neither "a b" nor ["a", "b"]) name `path`.
TokenizerFile parse_tokenizer_file(std::string_view text, const std::string& path);

}  // namespace moestream::tok
