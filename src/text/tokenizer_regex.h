// A compiled PCRE2 pattern (UTF + Unicode properties, JIT) for the tokenizer's Split
// pre-tokenizer and Replace normalizer/decoder. Patterns in tokenizer.json are written for
// Oniguruma, which Hugging Face `tokenizers` uses; the one difference that matters for them,
// the set of characters \s matches, is bridged by rewriting \s to Unicode White_Space.
// Matching is const and safe from several threads at once.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moestream {

class Regex {
 public:
  // `what` names the pattern's owner in the error thrown when it does not compile.
  static Regex pattern(std::string_view pattern, std::string_view what);
  static Regex literal(std::string_view text, std::string_view what);

  Regex(Regex&& other) noexcept;
  Regex& operator=(Regex&& other) noexcept;
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex();

  // Non-overlapping, non-empty matches as [begin, end) byte offsets, left to right. The text
  // must be valid UTF-8.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

  // Replaces every match with `content` (taken literally).
  std::string replace_all(std::string_view text, std::string_view content) const;

 private:
  explicit Regex(void* code) : code_(code) {}
  void* code_ = nullptr;  // pcre2_code_8*
};

// Rewrites \s and \S to Oniguruma's meaning (the White_Space property) in PCRE2 syntax.
std::string onig_to_pcre2(std::string_view pattern);

}  // namespace moestream
