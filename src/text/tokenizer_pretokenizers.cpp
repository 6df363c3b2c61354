// Pre-tokenizers: Split (regex or literal, five delimiter behaviors, invert), ByteLevel (GPT-2
// regex, prefix space, byte alphabet), Metaspace, Digits and Sequence.
#include <utf8proc.h>

#include <algorithm>

#include "text/tokenizer_components.h"
#include "text/tokenizer_json.h"
#include "text/unicode.h"

namespace moestream::tok {

namespace {

using Ranges = std::vector<std::pair<size_t, size_t>>;

// What happens to the delimiters (the matches) when a piece is split, as in `tokenizers`.
enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

Behavior parse_behavior(const std::string& name, const Where& where) {
  if (name == "Removed") return Behavior::Removed;
  if (name == "Isolated") return Behavior::Isolated;
  if (name == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::MergedWithNext;
  if (name == "Contiguous") return Behavior::Contiguous;
  fail(where.str(), ": unknown split behavior '", name, "'");
}

struct Span {
  size_t begin, end;
  bool is_match;
};

// The ranges of `len` bytes kept after splitting on `matches`: the text is first cut into
// alternating match / non-match spans, then the behavior decides what to merge or drop.
Ranges split_ranges(size_t len, const Ranges& matches, Behavior behavior, bool invert) {
  std::vector<Span> spans;
  size_t prev = 0;
  for (auto [begin, end] : matches) {
    if (prev != begin) spans.push_back({prev, begin, false});
    spans.push_back({begin, end, true});
    prev = end;
  }
  if (prev != len) spans.push_back({prev, len, false});
  if (invert)
    for (Span& s : spans) s.is_match = !s.is_match;

  Ranges out;
  bool previous_match = false;
  switch (behavior) {
    case Behavior::Isolated:
      for (const Span& s : spans) out.emplace_back(s.begin, s.end);
      break;
    case Behavior::Removed:
      for (const Span& s : spans)
        if (!s.is_match) out.emplace_back(s.begin, s.end);
      break;
    case Behavior::Contiguous:  // runs of matches, and runs of non-matches, become one piece
      for (const Span& s : spans) {
        if (s.is_match == previous_match && !out.empty())
          out.back().second = s.end;
        else
          out.emplace_back(s.begin, s.end);
        previous_match = s.is_match;
      }
      break;
    case Behavior::MergedWithPrevious:
      for (const Span& s : spans) {
        if (s.is_match && !previous_match && !out.empty())
          out.back().second = s.end;
        else
          out.emplace_back(s.begin, s.end);
        previous_match = s.is_match;
      }
      break;
    case Behavior::MergedWithNext:  // the mirror image: walk backwards, then restore order
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous_match && !out.empty())
          out.back().first = it->begin;
        else
          out.emplace_back(it->begin, it->end);
        previous_match = it->is_match;
      }
      std::reverse(out.begin(), out.end());
      break;
  }
  return out;
}

// Each character for which pred holds is its own match.
template <class Pred>
Ranges char_matches(std::string_view text, Pred pred) {
  Ranges out;
  for (size_t pos = 0; pos < text.size();) {
    size_t begin = pos;
    if (pred(unicode::next_code_point(text, pos))) out.emplace_back(begin, pos);
  }
  return out;
}

// Cuts every piece into the non-empty ranges chosen by ranges_of(piece text).
template <class RangesOf>
void split_pieces(std::vector<Piece>& pieces, RangesOf ranges_of) {
  std::vector<Piece> out;
  out.reserve(pieces.size());
  for (Piece& piece : pieces) {
    for (auto [begin, end] : ranges_of(piece.text)) {
      if (begin == end) continue;
      out.push_back({piece.text.substr(begin, end - begin), piece.at_input_start && begin == 0});
    }
  }
  pieces = std::move(out);
}

class Split final : public PreTokenizer {
 public:
  Split(Regex pattern, Behavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](const std::string& text) {
      return split_ranges(text.size(), pattern_.find_all(text), behavior_, invert_);
    });
  }

 private:
  Regex pattern_;
  Behavior behavior_;
  bool invert_;
};

// Optionally splits with GPT-2's pattern, then spells every byte with its alphabet character.
class ByteLevel final : public PreTokenizer {
 public:
  ByteLevel(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space), use_regex_(use_regex) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    if (add_prefix_space_)
      for (Piece& piece : pieces)
        if (piece.text.empty() || piece.text[0] != ' ') piece.text = " " + piece.text;
    if (use_regex_) {
      static const Regex gpt2 = Regex::pattern(
          R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
          "ByteLevel pre-tokenizer");
      split_pieces(pieces, [&](const std::string& text) {
        return split_ranges(text.size(), gpt2.find_all(text), Behavior::Isolated, false);
      });
    }
    const auto& alphabet = unicode::byte_to_char();
    for (Piece& piece : pieces) {
      std::string mapped;
      mapped.reserve(piece.text.size() * 2);
      for (unsigned char b : piece.text) mapped += alphabet[b];
      piece.text = std::move(mapped);
    }
  }

 private:
  bool add_prefix_space_, use_regex_;
};

// SentencePiece style: spaces become the replacement character ("▁"), which may also be
// prepended, and each word starts at a replacement character.
class Metaspace final : public PreTokenizer {
 public:
  enum class Prepend { Always, Never, First };
  Metaspace(std::string replacement, Prepend prepend, bool split)
      : replacement_(std::move(replacement)), prepend_(prepend), split_(split) {
    size_t pos = 0;
    replacement_cp_ = unicode::next_code_point(replacement_, pos);
  }
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    for (Piece& piece : pieces) {
      std::string replaced;
      for (char c : piece.text) {
        if (c == ' ')
          replaced += replacement_;
        else
          replaced += c;
      }
      bool starts = replaced.compare(0, replacement_.size(), replacement_) == 0;
      bool prepend =
          prepend_ == Prepend::Always || (prepend_ == Prepend::First && piece.at_input_start);
      if (prepend && !starts) replaced.insert(0, replacement_);
      piece.text = std::move(replaced);
    }
    if (split_) {
      split_pieces(pieces, [&](const std::string& text) {
        auto matches = char_matches(text, [&](char32_t cp) { return cp == replacement_cp_; });
        return split_ranges(text.size(), matches, Behavior::MergedWithNext, false);
      });
    }
  }

 private:
  std::string replacement_;
  char32_t replacement_cp_ = 0;
  Prepend prepend_;
  bool split_;
};

// Separates numeric characters from the rest, one per piece or in runs.
class Digits final : public PreTokenizer {
 public:
  explicit Digits(bool individual) : individual_(individual) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](const std::string& text) {
      auto matches = char_matches(text, [](char32_t cp) {
        auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
        return cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL ||
               cat == UTF8PROC_CATEGORY_NO;
      });
      return split_ranges(text.size(), matches,
                          individual_ ? Behavior::Isolated : Behavior::Contiguous, false);
    });
  }

 private:
  bool individual_;
};

class Sequence final : public PreTokenizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    for (const auto& step : steps_) step->pre_tokenize(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

std::unique_ptr<PreTokenizer> make_metaspace(const json& spec, const Where& where) {
  std::string replacement = get_string(spec, "replacement", where, "\xE2\x96\x81");
  if (replacement.empty() || unicode::find_invalid_utf8(replacement) != std::string::npos)
    fail(where.str(), ": field 'replacement' must be one character");
  Metaspace::Prepend prepend = Metaspace::Prepend::Always;
  if (spec.contains("prepend_scheme")) {
    std::string scheme = get_string(spec, "prepend_scheme", where);
    if (scheme == "always")
      prepend = Metaspace::Prepend::Always;
    else if (scheme == "never")
      prepend = Metaspace::Prepend::Never;
    else if (scheme == "first")
      prepend = Metaspace::Prepend::First;
    else
      fail(where.str(), ": unknown prepend_scheme '", scheme, "'");
  } else if (!get_bool(spec, "add_prefix_space", where, true)) {  // files before prepend_scheme
    prepend = Metaspace::Prepend::Never;
  }
  return std::make_unique<Metaspace>(replacement, prepend, get_bool(spec, "split", where, true));
}

}  // namespace

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& spec, const std::string& file) {
  if (spec.is_null()) return nullptr;
  Where where{file, "pre_tokenizer"};
  std::string type = type_of(spec, where);
  where.component += " " + type;
  if (type == "Split")
    return std::make_unique<Split>(get_pattern(spec, "pattern", where),
                                   parse_behavior(get_string(spec, "behavior", where), where),
                                   get_bool(spec, "invert", where, false));
  if (type == "ByteLevel")
    return std::make_unique<ByteLevel>(get_bool(spec, "add_prefix_space", where, true),
                                       get_bool(spec, "use_regex", where, true));
  if (type == "Metaspace") return make_metaspace(spec, where);
  if (type == "Digits")
    return std::make_unique<Digits>(get_bool(spec, "individual_digits", where, false));
  if (type == "Sequence") {
    const json& list = require(spec, "pretokenizers", where);
    if (!list.is_array()) fail(where.str(), ": field 'pretokenizers' must be an array");
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (const json& item : list)
      if (auto step = make_pre_tokenizer(item, file)) steps.push_back(std::move(step));
    return std::make_unique<Sequence>(std::move(steps));
  }
  fail(file, ": unsupported pre_tokenizer type '", type, "'");
}

}  // namespace moestream::tok
