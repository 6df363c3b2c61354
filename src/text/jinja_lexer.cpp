// jinja2's lexer, as configured by transformers (trim_blocks, lstrip_blocks):
//  - newlines are normalised to \n and one trailing newline of the source is dropped;
//  - "{%-", "{{-", "{#-" strip all whitespace before the tag, "-%}", "-}}", "-#}" all after it;
//  - trim_blocks: one "\n" right after "%}" or "#}" is dropped ("+%}" keeps it);
//  - lstrip_blocks: spaces and tabs between the start of a line and "{%" or "{#" are dropped
//    ("{%+" keeps them); never before "{{".
#include "text/jinja_lexer.h"

#include <cctype>
#include <cstdint>
#include <cstring>

#include "text/jinja_value.h"

namespace moestream::jinja {

namespace {

[[noreturn]] void syntax_error(int line, const std::string& msg) {
  throw RenderError{"TemplateSyntaxError", msg, line};
}

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string normalize_source(std::string_view src) {
  std::string out;
  out.reserve(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] == '\r') {
      out += '\n';
      if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
    } else {
      out += src[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();  // keep_trailing_newline=False
  return out;
}

int count_newlines(std::string_view s, size_t from, size_t to) {
  int n = 0;
  for (size_t i = from; i < to; ++i) n += s[i] == '\n';
  return n;
}

// Python string-literal escapes (jinja2 decodes literals with "unicode-escape").
std::string decode_string(std::string_view body, int line) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    char c = body[i];
    if (c != '\\' || i + 1 >= body.size()) {
      out += c;
      continue;
    }
    char e = body[++i];
    auto hex = [&](size_t n) {
      if (i + n >= body.size()) syntax_error(line, "truncated \\x/\\u escape in string literal");
      char32_t v = 0;
      for (size_t k = 1; k <= n; ++k) {
        char h = body[i + k];
        int d = (h >= '0' && h <= '9') ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
        if (d < 0) syntax_error(line, "bad escape in string literal");
        v = v * 16 + char32_t(d);
      }
      i += n;
      if (v > 0x10FFFF) syntax_error(line, "illegal Unicode character in string literal");
      if (v >= 0xD800 && v <= 0xDFFF) syntax_error(line, "lone surrogate in string literal (not valid UTF-8)");
      append_cp(out, v);
    };
    switch (e) {
      case '\n': break;  // line continuation
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'v': out += '\v'; break;
      case 'x': hex(2); break;
      case 'u': hex(4); break;
      case 'U': hex(8); break;
      case '0': case '1': case '2': case '3': case '4': case '5': case '6': case '7': {
        char32_t v = char32_t(e - '0');
        for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k)
          v = v * 8 + char32_t(body[++i] - '0');
        append_cp(out, v);
        break;
      }
      default:  // unknown escapes stay as written
        out += '\\';
        out += e;
    }
  }
  return out;
}

const char* const kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "/", "*", "%", "~", "[", "]", "(", ")",
                            "{", "}", "<", ">", "=", ".", ":", "|", ",", ";"};

class Lexer {
 public:
  explicit Lexer(std::string_view src) : s_(normalize_source(src)) {}

  std::vector<Token> run() {
    bool line_starting = true;
    while (pos_ < s_.size()) {
      size_t start = find_tag(pos_);
      std::string_view text(s_.data() + pos_, (start == std::string::npos ? s_.size() : start) - pos_);
      if (start == std::string::npos) {
        emit(Token::Text, std::string(text));
        break;
      }
      char kind = s_[start + 1];  // '{', '%' or '#'
      char sign = start + 2 < s_.size() ? s_[start + 2] : 0;
      if (sign != '-' && sign != '+') sign = 0;
      size_t raw_end = kind == '%' ? match_raw_begin(start) : 0;
      // Whitespace control of the text before the tag.
      if (sign == '-') {
        size_t n = text.size();
        while (n > 0 && is_ws(text[n - 1])) --n;
        text = text.substr(0, n);
      } else if (sign != '+' && kind != '{') {
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string_view::npos ? 0 : l_pos + 1;
        if (l_pos > 0 || line_starting) {
          bool all_ws = l_pos < text.size();
          for (size_t i = l_pos; i < text.size(); ++i) all_ws = all_ws && is_ws(text[i]);
          if (all_ws) text = text.substr(0, l_pos);
        }
      }
      emit(Token::Text, std::string(text));
      line_ += count_newlines(s_, pos_, start);
      pos_ = start;
      if (raw_end) {
        lex_raw(raw_end);
      } else if (kind == '#') {
        lex_comment();
      } else {
        lex_tag(kind == '{');
      }
      line_starting = pos_ > 0 && s_[pos_ - 1] == '\n';
    }
    tokens_.push_back(Token{Token::End, "", line_});
    return std::move(tokens_);
  }

 private:
  std::string s_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;

  void emit(Token::Kind k, std::string text) {
    if (k == Token::Text && text.empty()) return;
    tokens_.push_back(Token{k, std::move(text), line_});
  }

  size_t find_tag(size_t from) const {
    for (size_t i = s_.find('{', from); i != std::string::npos; i = s_.find('{', i + 1)) {
      if (i + 1 < s_.size() && (s_[i + 1] == '{' || s_[i + 1] == '%' || s_[i + 1] == '#')) return i;
    }
    return std::string::npos;
  }

  // Position just after "{% raw %}" (with optional -/+ and whitespace) starting at `at`, else 0.
  size_t match_raw_begin(size_t at) const { return match_word_tag(at, "raw"); }

  size_t match_word_tag(size_t at, const char* word) const {
    size_t i = at + 2;
    if (i < s_.size() && (s_[i] == '-' || s_[i] == '+')) ++i;
    while (i < s_.size() && is_ws(s_[i])) ++i;
    size_t n = std::strlen(word);
    if (s_.compare(i, n, word) != 0) return 0;
    i += n;
    while (i < s_.size() && is_ws(s_[i])) ++i;
    if (i < s_.size() && (s_[i] == '-' || s_[i] == '+')) ++i;
    if (s_.compare(i, 2, "%}") != 0) return 0;
    return i + 2;
  }

  void skip_ws_after() {
    while (pos_ < s_.size() && is_ws(s_[pos_])) {
      if (s_[pos_] == '\n') ++line_;
      ++pos_;
    }
  }

  void lex_raw(size_t after_begin) {
    bool strip_after = s_[after_begin - 3] == '-';
    line_ += count_newlines(s_, pos_, after_begin);
    pos_ = after_begin;
    if (strip_after) skip_ws_after();
    size_t i = pos_;
    for (;; ++i) {
      i = s_.find("{%", i);
      if (i == std::string::npos) syntax_error(line_, "missing end of raw directive");
      if (match_word_tag(i, "endraw")) break;
    }
    size_t end_tag = match_word_tag(i, "endraw");
    std::string_view text(s_.data() + pos_, i - pos_);
    if (s_[i + 2] == '-') {
      size_t n = text.size();
      while (n > 0 && is_ws(text[n - 1])) --n;
      text = text.substr(0, n);
    } else if (s_[i + 2] != '+') {
      size_t l_pos = text.rfind('\n');
      if (l_pos != std::string_view::npos) {
        bool all_ws = l_pos + 1 < text.size();
        for (size_t k = l_pos + 1; k < text.size(); ++k) all_ws = all_ws && is_ws(text[k]);
        if (all_ws) text = text.substr(0, l_pos + 1);
      }
    }
    emit(Token::Text, std::string(text));
    line_ += count_newlines(s_, pos_, end_tag);
    pos_ = end_tag;
    char before = s_[end_tag - 3];
    if (before == '-') skip_ws_after();
    else if (before != '+' && pos_ < s_.size() && s_[pos_] == '\n') ++pos_, ++line_;
  }

  void lex_comment() {
    size_t e = s_.find("#}", pos_ + 2);
    if (e == std::string::npos) syntax_error(line_, "missing end of comment tag");
    char before = s_[e - 1];
    line_ += count_newlines(s_, pos_, e);
    pos_ = e + 2;
    if (before == '-') skip_ws_after();
    else if (before != '+' && pos_ < s_.size() && s_[pos_] == '\n') ++pos_, ++line_;
  }

  void lex_tag(bool variable) {
    emit(variable ? Token::VarBegin : Token::BlockBegin, "");
    pos_ += 2;
    if (pos_ < s_.size() && (s_[pos_] == '-' || s_[pos_] == '+')) ++pos_;
    const char close = variable ? '}' : '%';
    int depth = 0;
    for (;;) {
      while (pos_ < s_.size() && is_ws(s_[pos_])) {
        if (s_[pos_] == '\n') ++line_;
        ++pos_;
      }
      if (pos_ >= s_.size()) syntax_error(line_, variable ? "unexpected end of template, expected '}}'" : "unexpected end of template, expected '%}'");
      if (depth == 0) {
        // End of tag: "-%}" / "+%}" / "%}" (or the same with "}}").
        char c = s_[pos_];
        if ((c == '-' || c == '+') && pos_ + 2 < s_.size() && s_[pos_ + 1] == close && s_[pos_ + 2] == '}' &&
            !(variable && c == '+')) {
          emit(variable ? Token::VarEnd : Token::BlockEnd, "");
          pos_ += 3;
          if (c == '-') skip_ws_after();
          return;
        }
        if (c == close && pos_ + 1 < s_.size() && s_[pos_ + 1] == '}') {
          emit(variable ? Token::VarEnd : Token::BlockEnd, "");
          pos_ += 2;
          if (!variable && pos_ < s_.size() && s_[pos_] == '\n') ++pos_, ++line_;  // trim_blocks
          return;
        }
      }
      char c = s_[pos_];
      if (c == '\'' || c == '"') {
        size_t i = pos_ + 1;
        while (i < s_.size() && s_[i] != c) i += s_[i] == '\\' ? 2 : 1;
        if (i >= s_.size()) syntax_error(line_, "unexpected end of string literal");
        int start_line = line_;
        std::string v = decode_string(std::string_view(s_).substr(pos_ + 1, i - pos_ - 1), line_);
        line_ += count_newlines(s_, pos_, i);
        tokens_.push_back(Token{Token::String, std::move(v), start_line});
        pos_ = i + 1;
        continue;
      }
      if (c >= '0' && c <= '9') {
        lex_number();
        continue;
      }
      if (c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (static_cast<unsigned char>(c) >= 0x80)) {
        size_t i = pos_;
        while (i < s_.size() && (s_[i] == '_' || std::isalnum(static_cast<unsigned char>(s_[i])) ||
                                 static_cast<unsigned char>(s_[i]) >= 0x80))
          ++i;
        emit(Token::Name, s_.substr(pos_, i - pos_));
        pos_ = i;
        continue;
      }
      bool found = false;
      for (const char* op : kOps) {
        size_t n = std::strlen(op);
        if (s_.compare(pos_, n, op) == 0) {
          if (op[0] == '(' || op[0] == '[' || op[0] == '{') ++depth;
          if (n == 1 && (op[0] == ')' || op[0] == ']' || op[0] == '}')) {
            if (depth == 0) syntax_error(line_, std::string("unexpected '") + op + "'");
            --depth;
          }
          emit(Token::Op, op);
          pos_ += n;
          found = true;
          break;
        }
      }
      if (!found) syntax_error(line_, std::string("unexpected char '") + c + "'");
    }
  }

  void lex_number() {
    size_t i = pos_;
    auto digits = [&] {
      while (i < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[i])) || s_[i] == '_')) ++i;
    };
    if (s_[i] == '0' && i + 1 < s_.size() && std::strchr("xXoObB", s_[i + 1])) {
      int base = std::strchr("xX", s_[i + 1]) ? 16 : std::strchr("oO", s_[i + 1]) ? 8 : 2;
      i += 2;
      size_t b = i;
      while (i < s_.size() && (std::isxdigit(static_cast<unsigned char>(s_[i])) || s_[i] == '_')) ++i;
      // Python: at least one digit, each below the base; jinja2 has arbitrary-size ints, we int64.
      uint64_t v = 0;
      bool any = false;
      for (size_t k = b; k < i; ++k) {
        if (s_[k] == '_') continue;
        int d = std::isdigit(static_cast<unsigned char>(s_[k])) ? s_[k] - '0' : std::tolower(s_[k]) - 'a' + 10;
        if (d >= base) syntax_error(line_, "invalid digit '" + std::string(1, s_[k]) + "' in integer literal");
        if (v > (uint64_t(INT64_MAX) - uint64_t(d)) / uint64_t(base))
          syntax_error(line_, "integer literal " + std::string(s_.substr(pos_, i - pos_)) +
                                  " is too large (the limit is 9223372036854775807)");
        v = v * uint64_t(base) + uint64_t(d);
        any = true;
      }
      if (!any) syntax_error(line_, "invalid integer literal '" + std::string(s_.substr(pos_, i - pos_)) + "'");
      emit(Token::Integer, std::to_string(v));
      pos_ = i;
      return;
    }
    digits();
    bool is_float = false;
    if (i + 1 < s_.size() && s_[i] == '.' && std::isdigit(static_cast<unsigned char>(s_[i + 1]))) {
      ++i;
      digits();
      is_float = true;
    }
    if (i < s_.size() && (s_[i] == 'e' || s_[i] == 'E')) {
      size_t j = i + 1;
      if (j < s_.size() && (s_[j] == '+' || s_[j] == '-')) ++j;
      if (j < s_.size() && std::isdigit(static_cast<unsigned char>(s_[j]))) {
        i = j;
        digits();
        is_float = true;
      }
    }
    std::string t;
    for (size_t k = pos_; k < i; ++k)
      if (s_[k] != '_') t += s_[k];
    emit(is_float ? Token::Float : Token::Integer, t);
    pos_ = i;
  }
};

}  // namespace

std::vector<Token> tokenize(std::string_view source) { return Lexer(source).run(); }

}  // namespace moestream::jinja
