#include "kiln/data/normalize.hpp"

#include <algorithm>
#include <cstdlib>

#include <utf8proc.h>

#include "kiln/core/error.hpp"
#include "utf8.hpp"

namespace kiln::data {

namespace {

// Appends the NFC form of valid UTF-8 (utf8proc's NFC is STABLE | COMPOSE).
void append_nfc(std::string_view valid, std::string& out) {
  utf8proc_uint8_t* result = nullptr;
  const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(valid.data()),
                              static_cast<utf8proc_ssize_t>(valid.size()), &result,
                              static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) KILN_THROW("NFC normalization (utf8proc): ", utf8proc_errmsg(n));
  out.append(reinterpret_cast<const char*>(result), static_cast<std::size_t>(n));
  std::free(result);
}

}  // namespace

std::string_view normalize(Normalization form, std::string_view text, std::string& buffer) {
  if (form == Normalization::none) return text;
  // Bytes below 0xCC lead only characters below U+0300, which are all NFC and compose with nothing
  // before them: most Latin text needs no work.
  if (std::none_of(text.begin(), text.end(), [](char b) { return static_cast<unsigned char>(b) >= 0xCC; })) return text;
  buffer.clear();
  char32_t c;
  for (std::size_t i = 0; i < text.size();) {
    std::size_t valid_end = i;
    for (std::size_t n; valid_end < text.size() && (n = detail::utf8_char_at(text, valid_end, c)) != 0;) valid_end += n;
    if (valid_end > i) append_nfc(text.substr(i, valid_end - i), buffer);
    std::size_t bad_end = valid_end;
    while (bad_end < text.size() && detail::utf8_char_at(text, bad_end, c) == 0) ++bad_end;
    buffer.append(text.substr(valid_end, bad_end - valid_end));
    i = bad_end;
  }
  return buffer;
}

}  // namespace kiln::data
