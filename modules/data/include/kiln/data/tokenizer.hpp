#pragma once
// The byte-level tokenizer (vocabulary 256: token = byte value) and corpus preparation helpers.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::data {

std::vector<std::uint16_t> byte_encode(std::string_view text);
std::string byte_decode(const std::vector<std::uint16_t>& tokens);

// Turns part-of-speech tagged text ("The/at jury/nn said/vbd ./.") into plain text ("The jury
// said."): keeps each word before its last '/', turns `` and '' into ", and joins punctuation.
std::string strip_pos_tags(std::string_view tagged);

struct TokenizeOptions {
  double val_fraction = 0.1;        // the last fraction of the token stream goes to validation
  std::int64_t shard_tokens = 100'000'000;
  bool strip_pos_tags = false;
};
struct TokenizeResult {
  std::int64_t train_tokens = 0, val_tokens = 0;
  std::vector<std::string> files;
};
// Reads the text files (in the order given), tokenizes them byte-level, and writes
// DIR/train_NNNNNN.bin and DIR/val_NNNNNN.bin in llm.c format.
TokenizeResult tokenize_files(const std::vector<std::string>& inputs, const std::string& out_dir,
                              const TokenizeOptions& options);

}  // namespace kiln::data
