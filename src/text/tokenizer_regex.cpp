#include "text/tokenizer_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cstdint>

#include "core/error.h"
#include "text/limits.h"
#include "text/unicode.h"

namespace moestream {

namespace {

// Unicode White_Space as the body of a character class.
constexpr std::string_view kWhiteSpaceRanges =
    "\\t-\\r \\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}"
    "\\x{3000}";

pcre2_code* as_code(void* p) {
  return static_cast<pcre2_code*>(p);
}

// Match data and a JIT stack per thread: pcre2_code is shared, these are not.
struct MatchScratch {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* jit_stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
  MatchScratch() {
    if (!data || !context || !jit_stack) fail("regex: out of memory creating match data");
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~MatchScratch() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

std::string error_text(int code) {
  PCRE2_UCHAR buf[256];
  int n = pcre2_get_error_message(code, buf, sizeof(buf));
  return n < 0 ? "unknown PCRE2 error " + std::to_string(code)
               : std::string(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
}

void* compile(std::string_view pattern, uint32_t options, std::string_view what) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   options | PCRE2_UTF, &err, &offset, nullptr);
  if (!code)
    fail(what, ": cannot compile pattern '", pattern, "' at offset ", offset, ": ",
         error_text(err));
  // Without JIT support PCRE2 falls back to its interpreter, which gives the same matches.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return code;
}

}  // namespace

std::string onig_to_pcre2(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char e = p[i + 1];
      ++i;
      if (e == 's') {
        out +=
            in_class ? std::string(kWhiteSpaceRanges) : "[" + std::string(kWhiteSpaceRanges) + "]";
      } else if (e == 'S' && !in_class) {
        out += "[^" + std::string(kWhiteSpaceRanges) + "]";
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

Regex Regex::pattern(std::string_view pattern, std::string_view what) {
  return Regex(compile(onig_to_pcre2(pattern), PCRE2_UCP, what));
}

Regex Regex::literal(std::string_view text, std::string_view what) {
  return Regex(compile(text, PCRE2_LITERAL, what));
}

Regex::Regex(Regex&& other) noexcept : code_(other.code_) {
  other.code_ = nullptr;
}

Regex& Regex::operator=(Regex&& other) noexcept {
  if (this != &other) {
    pcre2_code_free(as_code(code_));
    code_ = other.code_;
    other.code_ = nullptr;
  }
  return *this;
}

Regex::~Regex() {
  pcre2_code_free(as_code(code_));
}

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> matches;
  MatchScratch& s = scratch();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  uint32_t options = 0;  // the first call checks the UTF-8, later calls skip that
  size_t pos = 0;
  while (pos <= text.size()) {
    uint64_t limit = text_limits::kRegexBaseMatchLimit +
                     text_limits::kRegexMatchStepsPerByte * (text.size() - pos);
    pcre2_set_match_limit(s.context, uint32_t(std::min<uint64_t>(limit, UINT32_MAX)));
    int rc = pcre2_match(as_code(code_), subject, text.size(), pos, options, s.data, s.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) fail("regex match failed: ", error_text(rc));
    options = PCRE2_NO_UTF_CHECK;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.data);
    size_t begin = ov[0], end = ov[1];
    if (end <= begin) {  // empty match: step over one character and search again
      if (begin >= text.size()) break;
      size_t len = unicode::sequence_length(static_cast<unsigned char>(text[begin]));
      pos = begin + (len == 0 ? 1 : len);
      continue;
    }
    matches.emplace_back(begin, end);
    pos = end;
  }
  return matches;
}

std::string Regex::replace_all(std::string_view text, std::string_view content) const {
  std::string out;
  size_t last = 0;
  for (auto [begin, end] : find_all(text)) {
    out.append(text.substr(last, begin - last));
    out.append(content);
    last = end;
  }
  out.append(text.substr(last));
  return out;
}

}  // namespace moestream
