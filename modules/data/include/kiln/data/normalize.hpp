#pragma once
// Unicode normalization of text before it is split and encoded, as a Hugging Face tokenizer.json's
// "normalizer" asks for it (Qwen2's: NFC).
#include <string>
#include <string_view>

namespace kiln::data {

enum class Normalization {
  none,
  nfc,  // canonical composition: "e" + U+0301 becomes "é"
};

// `text` in the given form, through utf8proc. Bytes that are not valid UTF-8 stay as they are, and
// each run of valid text between them is normalized alone (Hugging Face only ever sees valid text).
// Returns `text` itself when it is already in that form (text below U+0300 always is), else a view
// of `buffer`, which it overwrites.
std::string_view normalize(Normalization form, std::string_view text, std::string& buffer);

}  // namespace kiln::data
