#include "text/unicode.h"

#include <utf8proc.h>

#include <cstdlib>

#include "core/error.h"

namespace moestream::unicode {

namespace {

bool is_continuation(unsigned char c) {
  return (c & 0xC0) == 0x80;
}

bool all_ascii(std::string_view text) {
  for (unsigned char c : text)
    if (c >= 0x80) return false;
  return true;
}

}  // namespace

size_t sequence_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

size_t find_invalid_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  size_t n = text.size(), i = 0;
  while (i < n) {
    unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = sequence_length(c);
    if (len == 0 || i + len > n) return i;
    for (size_t k = 1; k < len; ++k)
      if (!is_continuation(s[i + k])) return i;
    // The second byte's range rules out overlong forms, surrogates and values past U+10FFFF.
    unsigned char c1 = s[i + 1];
    if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 > 0x9F) || (c == 0xF0 && c1 < 0x90) ||
        (c == 0xF4 && c1 > 0x8F))
      return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string to_valid_utf8(std::string_view text) {
  size_t bad = find_invalid_utf8(text);
  if (bad == std::string_view::npos) return std::string(text);
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  std::string out(text.substr(0, bad));
  size_t i = bad;
  while (i < text.size()) {
    const size_t next_bad = find_invalid_utf8(text.substr(i));
    if (next_bad == std::string_view::npos) {
      out.append(text.substr(i));
      break;
    }
    out.append(text.substr(i, next_bad));
    i += next_bad;
    // The maximal subpart: a lead byte and the continuation bytes that could still have
    // completed it (the second byte's range depends on the lead), replaced by one U+FFFD.
    const unsigned char c = s[i];
    const size_t len = sequence_length(c);
    size_t k = 1;
    if (len > 1) {
      const unsigned char lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
      const unsigned char hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
      if (i + 1 < text.size() && s[i + 1] >= lo && s[i + 1] <= hi) {
        k = 2;
        while (k < len && i + k < text.size() && is_continuation(s[i + k])) ++k;
      }
    }
    out += "\xEF\xBF\xBD";
    i += k;
  }
  return out;
}

char32_t next_code_point(std::string_view text, size_t& pos) {
  auto c = static_cast<unsigned char>(text[pos]);
  size_t len = sequence_length(c);
  if (len <= 1 || len > text.size() - pos) {  // a truncated sequence: one byte, never past the end
    ++pos;
    return c;
  }
  char32_t cp = c & (0x7F >> len);
  for (size_t k = 1; k < len; ++k)
    cp = (cp << 6) | (static_cast<unsigned char>(text[pos + k]) & 0x3F);
  pos += len;
  return cp;
}

size_t complete_prefix(std::string_view text, size_t from) {
  size_t n = text.size();
  // A character is at most 4 bytes: look at the last 4 for the lead byte of the final one.
  for (size_t i = n, seen = 0; i > from && seen < 4; --i, ++seen) {
    auto c = static_cast<unsigned char>(text[i - 1]);
    if (is_continuation(c)) continue;
    size_t len = sequence_length(c);
    return (len > 1 && n - (i - 1) < len) ? i - 1 : n;
  }
  return n;
}

std::string normalize(std::string_view text, Form form) {
  if (all_ascii(text)) return std::string(text);  // ASCII is invariant under all four forms
  int options = UTF8PROC_STABLE;
  switch (form) {
    case Form::NFC:
      options |= UTF8PROC_COMPOSE;
      break;
    case Form::NFD:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case Form::NFKC:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case Form::NFKD:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* out = nullptr;
  utf8proc_ssize_t len = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                      static_cast<utf8proc_ssize_t>(text.size()), &out,
                                      static_cast<utf8proc_option_t>(options));
  if (len < 0) fail("unicode normalization failed: ", utf8proc_errmsg(len));
  std::string result(reinterpret_cast<const char*>(out), static_cast<size_t>(len));
  std::free(out);
  return result;
}

std::string lowercase(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    char32_t cp = next_code_point(text, pos);
    if (cp == 0x130) {  // the one unconditional multi-character lowercase mapping
      out += "i\xCC\x87";
      continue;
    }
    append_utf8(out, static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))));
  }
  return out;
}

bool is_white_space(char32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  switch (cp) {
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

bool is_word_char(char32_t cp) {
  if (cp < 0x80)
    return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') ||
           cp == '_';
  if (cp == 0x200C || cp == 0x200D) return true;  // join controls
  // Circled and squared Latin letters are alphabetic although their category is So.
  if ((cp >= 0x24B6 && cp <= 0x24E9) || (cp >= 0x1F130 && cp <= 0x1F189)) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

namespace {

// Bytes that are printable Latin-1 characters stand for themselves; the other 68 bytes are
// given the code points 256, 257, ... in byte order, so every byte becomes a visible character.
bool is_self_mapped(unsigned b) {
  return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

struct ByteAlphabet {
  std::array<std::string, 256> to_char;
  std::array<int16_t, 256 + 68> to_byte;
  ByteAlphabet() {
    to_byte.fill(-1);
    unsigned next = 256;
    for (unsigned b = 0; b < 256; ++b) {
      char32_t cp = is_self_mapped(b) ? b : next++;
      append_utf8(to_char[b], cp);
      to_byte[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

}  // namespace

const std::array<std::string, 256>& byte_to_char() {
  return alphabet().to_char;
}

int byte_of_char(char32_t cp) {
  const auto& table = alphabet().to_byte;
  return cp < table.size() ? table[cp] : -1;
}

}  // namespace moestream::unicode
