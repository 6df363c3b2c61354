// UTF-8 and Unicode helpers for the tokenizer: validation, code point iteration, normalization
// forms (via utf8proc), the character classes Hugging Face `tokenizers` uses for added-token
// stripping, and the GPT-2 byte-to-character alphabet used by byte-level BPE.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/strings.h"

namespace moestream::unicode {

// Byte offset of the first invalid UTF-8 sequence (overlong forms, surrogates and code points
// above U+10FFFF are invalid, as in Rust's str), or npos when the whole text is valid.
size_t find_invalid_utf8(std::string_view text);

// Length of the sequence a lead byte starts: 1 for ASCII, 2..4 for a lead byte, 0 for a
// continuation byte or a byte that never starts a sequence.
size_t sequence_length(unsigned char lead);

// The text with each maximal invalid subsequence replaced by U+FFFD, as Python's
// bytes.decode("utf-8", errors="replace") (and so transformers' decode) does; valid text is
// returned unchanged.
std::string to_valid_utf8(std::string_view text);

// Decodes the code point starting at text[pos] and advances pos. Meant for valid UTF-8; a lead
// byte whose sequence the text cuts off comes back alone, so pos never passes the end.
char32_t next_code_point(std::string_view text, size_t& pos);
using ::moestream::append_utf8;  // core/strings.h

// Largest n <= text.size() such that text[0, n) does not end inside a multi-byte character
// whose lead byte lies at or after `from`. Bytes that can never complete (stray continuation
// bytes, invalid leads) are not held back.
size_t complete_prefix(std::string_view text, size_t from);

enum class Form { NFC, NFD, NFKC, NFKD };
std::string normalize(std::string_view text, Form form);
// Full lowercase mapping per code point (as Rust's char::to_lowercase).
std::string lowercase(std::string_view text);

bool is_white_space(char32_t cp);  // the Unicode White_Space property (regex \s)
bool is_word_char(char32_t cp);    // regex \w: alphabetic, marks, decimal digits, connectors

// GPT-2's reversible map from the 256 byte values to printable characters (as UTF-8 strings),
// and its inverse (-1 for code points outside the alphabet).
const std::array<std::string, 256>& byte_to_char();
int byte_of_char(char32_t cp);

}  // namespace moestream::unicode
