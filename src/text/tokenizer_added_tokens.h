// Added tokens (special tokens such as <|im_start|>, and plain added tokens such as <think>) are
// found in the text before any normalization or pre-tokenization and become ids directly.
// Matching follows `tokenizers`' AddedVocabulary: at each position the longest token wins, the
// leftmost match first; single_word tokens only match between non-word characters; lstrip and
// rstrip tokens absorb the white space beside them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moestream::tok {

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool special = false;  // rendered by decode; callers may hide it
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;  // matched against the normalized text instead of the raw input
};

class AddedTokenMatcher {
 public:
  // A byte range of the text: an added token (id >= 0) or plain text (id == -1).
  struct Segment {
    size_t begin, end;
    int32_t id;
  };

  AddedTokenMatcher() = default;
  // patterns[i] is the text that finds tokens[i] (its content, normalized for normalized ones).
  AddedTokenMatcher(const std::vector<std::string>& patterns,
                    const std::vector<const AddedToken*>& tokens);

  bool empty() const { return tokens_.empty(); }
  // Segments covering the text in order; an empty text gives no segments.
  std::vector<Segment> split(std::string_view text) const;

 private:
  // A byte trie over the patterns; token is the index into tokens_ of a pattern ending here.
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;
    int32_t token = -1;
  };
  int32_t longest_match(std::string_view text, size_t pos, size_t& len) const;

  std::vector<Node> nodes_;
  std::vector<const AddedToken*> tokens_;
};

}  // namespace moestream::tok
