#pragma once
// What the readers of tokenizer files share (bpe_files.cpp, hf_tokenizer.cpp): reading a file whole,
// places in it for messages, JSON parse errors as file:line:column, GPT-2's byte alphabet, and the
// bound on ids that keeps a tiny file from asking for a huge table.
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "kiln/core/error.hpp"

namespace kiln::data::detail {

inline std::string read_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) KILN_FILE_ERROR(path, ": cannot read ", what);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// "line:column" (1-based) of a byte offset.
inline std::string place(const std::string& text, std::size_t offset) {
  offset = std::min(offset, text.size());
  std::size_t line = 1, column = 1;
  for (std::size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') ++line, column = 0;
    ++column;
  }
  return cat(line, ":", column);
}

// The JSON document in `text` (read from `path`); a syntax error names path:line:column.
inline nlohmann::json parse_json(const std::string& path, const std::string& text) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    std::string why = e.what();
    if (auto at = why.find("column "); at != std::string::npos)
      if (auto colon = why.find(": ", at); colon != std::string::npos) why = why.substr(colon + 2);
    KILN_FILE_ERROR(path, ":", place(text, e.byte ? e.byte - 1 : 0), ": not valid JSON: ", why);
  }
}

// GPT-2 writes a token's bytes as printable characters: bytes that print as themselves in Latin-1
// stay, the others become U+0100 + n, in byte order. Hugging Face's ByteLevel uses the same table.
struct Gpt2ByteAlphabet {
  int byte_of[324];  // code point -> byte; -1: not in the alphabet
  Gpt2ByteAlphabet() {
    std::fill(std::begin(byte_of), std::end(byte_of), -1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      byte_of[printable ? b : 256 + n++] = b;
    }
  }
  // The bytes a token's text stands for; false if a character is outside the alphabet.
  bool decode(std::string_view utf8, std::string& out) const {
    out.clear();
    for (std::size_t i = 0; i < utf8.size();) {
      const auto c = static_cast<unsigned char>(utf8[i]);
      std::uint32_t cp;
      if (c < 0x80) {
        cp = c, i += 1;
      } else if ((c & 0xE0) == 0xC0 && i + 1 < utf8.size()) {
        cp = ((c & 0x1Fu) << 6) | (static_cast<unsigned char>(utf8[i + 1]) & 0x3Fu), i += 2;
      } else {
        return false;  // three-byte characters and beyond are all outside the alphabet
      }
      if (cp >= 324 || byte_of[cp] < 0) return false;
      out += static_cast<char>(byte_of[cp]);
    }
    return true;
  }
};

// The largest id (exclusive) a vocabulary file of `entries` tokens may give: real files number
// their tokens densely from 0; this leaves room for gaps (2^20 ids at least: a table of 32 MB of
// empty strings) but not for a table far larger than the file (2^30 strings from a 16-byte file).
inline std::int64_t dense_id_limit(std::size_t entries) {
  return std::max<std::int64_t>(std::int64_t{1} << 20, 2 * static_cast<std::int64_t>(entries));
}

}  // namespace kiln::data::detail
