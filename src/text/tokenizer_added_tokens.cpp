#include "text/tokenizer_added_tokens.h"

#include <algorithm>

#include "text/unicode.h"

namespace moestream::tok {

namespace {

// The code point that ends text[0, end) (end > 0, valid UTF-8).
char32_t code_point_before(std::string_view text, size_t end, size_t& begin) {
  begin = end - 1;
  while (begin > 0 && (static_cast<unsigned char>(text[begin]) & 0xC0) == 0x80) --begin;
  size_t pos = begin;
  return unicode::next_code_point(text, pos);
}

// Start of the run of white space that ends at `end`.
size_t white_space_run_before(std::string_view text, size_t end) {
  while (end > 0) {
    size_t begin;
    if (!unicode::is_white_space(code_point_before(text, end, begin))) break;
    end = begin;
  }
  return end;
}

// End of the run of white space that starts at `begin`.
size_t white_space_run_after(std::string_view text, size_t begin) {
  while (begin < text.size()) {
    size_t next = begin;
    if (!unicode::is_white_space(unicode::next_code_point(text, next))) break;
    begin = next;
  }
  return begin;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(const std::vector<std::string>& patterns,
                                     const std::vector<const AddedToken*>& tokens)
    : nodes_(1) {
  for (size_t i = 0; i < patterns.size(); ++i) {
    if (patterns[i].empty()) continue;
    int32_t node = 0;
    for (unsigned char c : patterns[i]) {
      auto& children = nodes_[node].children;
      auto it = std::find_if(children.begin(), children.end(),
                             [c](const auto& child) { return child.first == c; });
      if (it != children.end()) {
        node = it->second;
      } else {
        int32_t next = static_cast<int32_t>(nodes_.size());
        nodes_[node].children.emplace_back(c, next);
        nodes_.emplace_back();
        node = next;
      }
    }
    if (nodes_[node].token < 0) {  // the first token listed wins a tie on identical text
      nodes_[node].token = static_cast<int32_t>(tokens_.size());
      tokens_.push_back(tokens[i]);
    }
  }
}

int32_t AddedTokenMatcher::longest_match(std::string_view text, size_t pos, size_t& len) const {
  int32_t node = 0, found = -1;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto& children = nodes_[node].children;
    auto c = static_cast<unsigned char>(text[i]);
    auto it = std::find_if(children.begin(), children.end(),
                           [c](const auto& child) { return child.first == c; });
    if (it == children.end()) break;
    node = it->second;
    if (nodes_[node].token >= 0) {
      found = nodes_[node].token;
      len = i + 1 - pos;
    }
  }
  return found;
}

std::vector<AddedTokenMatcher::Segment> AddedTokenMatcher::split(std::string_view text) const {
  std::vector<Segment> out;
  if (text.empty()) return out;
  if (tokens_.empty()) {
    out.push_back({0, text.size(), -1});
    return out;
  }
  size_t done = 0;  // end of the last segment emitted
  for (size_t pos = 0; pos < text.size();) {
    size_t len = 0;
    int32_t index = longest_match(text, pos, len);
    if (index < 0) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + len;
    pos = stop;  // the search resumes after the match even when the match is rejected below
    const AddedToken& token = *tokens_[index];
    if (token.single_word) {
      size_t unused;
      bool word_before = start > 0 && unicode::is_word_char(code_point_before(text, start, unused));
      size_t after = stop;
      bool word_after =
          stop < text.size() && unicode::is_word_char(unicode::next_code_point(text, after));
      if (word_before || word_after) continue;
    }
    if (token.lstrip) start = std::max(white_space_run_before(text, start), done);
    if (token.rstrip) stop = white_space_run_after(text, stop);
    if (done < start) out.push_back({done, start, -1});
    out.push_back({start, stop, token.id});
    done = stop;
  }
  if (done < text.size()) out.push_back({done, text.size(), -1});
  return out;
}

}  // namespace moestream::tok
