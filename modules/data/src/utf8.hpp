#pragma once
// UTF-8 decoding for the tokenizers' text handling (added tokens, normalization): text may hold any
// bytes, so every step says where valid UTF-8 stops.
#include <cstddef>
#include <string_view>

namespace kiln::data::detail {

// The character that starts at byte i: its code point in `c` and its length in bytes; 0 when the
// bytes there are not a valid UTF-8 character (overlong forms, surrogates and code points above
// U+10FFFF included, as Rust's str and PCRE2 reject them).
inline std::size_t utf8_char_at(std::string_view s, std::size_t i, char32_t& c) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char lead = b(i);
  std::size_t n;
  if (lead < 0x80) return c = lead, 1;
  if (lead >= 0xC2 && lead <= 0xDF) n = 2, c = lead & 0x1Fu;
  else if (lead >= 0xE0 && lead <= 0xEF) n = 3, c = lead & 0x0Fu;
  else if (lead >= 0xF0 && lead <= 0xF4) n = 4, c = lead & 0x07u;
  else return 0;
  if (i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return 0;
    c = (c << 6) | (b(i + k) & 0x3Fu);
  }
  if ((n == 3 && (c < 0x800 || (c >= 0xD800 && c <= 0xDFFF))) || (n == 4 && (c < 0x10000 || c > 0x10FFFF))) return 0;
  return n;
}

// The character that ends just before byte `end`: its start, or `end` when there is no valid one.
inline std::size_t utf8_char_before(std::string_view s, std::size_t end, char32_t& c) {
  for (std::size_t n = 1; n <= 4 && n <= end; ++n)
    if (utf8_char_at(s, end - n, c) == n) return end - n;
  return end;
}

// Writes the UTF-8 of a code point (at most U+10FFFF) to out[0..4); returns its length.
inline std::size_t utf8_encode(char32_t c, char* out) {
  if (c < 0x80) return out[0] = static_cast<char>(c), 1;
  if (c < 0x800) {
    out[0] = static_cast<char>(0xC0 | (c >> 6));
    out[1] = static_cast<char>(0x80 | (c & 0x3F));
    return 2;
  }
  if (c < 0x10000) {
    out[0] = static_cast<char>(0xE0 | (c >> 12));
    out[1] = static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out[2] = static_cast<char>(0x80 | (c & 0x3F));
    return 3;
  }
  out[0] = static_cast<char>(0xF0 | (c >> 18));
  out[1] = static_cast<char>(0x80 | ((c >> 12) & 0x3F));
  out[2] = static_cast<char>(0x80 | ((c >> 6) & 0x3F));
  out[3] = static_cast<char>(0x80 | (c & 0x3F));
  return 4;
}

// Unicode's White_Space property (PropList.txt, unchanged since Unicode 6.3): Rust's
// char::is_whitespace and regex \s, Python's str.isspace but for U+001C-U+001F.
inline bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

}  // namespace kiln::data::detail
