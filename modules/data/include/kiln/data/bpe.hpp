#pragma once
// Byte-level BPE as GPT-2, cl100k_base, Llama 3 and Qwen2 use it: text is normalized if the
// vocabulary says so (normalize.hpp), split into pieces by a regular expression (pretokenize.hpp),
// each piece starts as its bytes (every byte value is a token) and adjacent tokens are merged, the
// pair of lowest rank first (leftmost on ties), until no pair of the piece has a merge. Decoding
// concatenates the tokens' bytes, so any byte string round trips (without normalization).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/data/added_tokens.hpp"
#include "kiln/data/normalize.hpp"
#include "kiln/data/pretokenize.hpp"
#include "kiln/data/tokenizer.hpp"

namespace kiln::data {

struct BpeVocabulary {
  std::vector<std::string> tokens;  // the bytes of each id ("" for an id with no token)
  struct Merge {
    std::uint32_t left, right, result, rank;
  };
  std::vector<Merge> merges;
  PretokenizePattern pattern = PretokenizePattern::gpt2;
  std::string regex;  // a file's own PCRE2 pre-tokenization pattern; when set, used instead of `pattern`
  Normalization normalization = Normalization::none;
  // tiktoken's rule: a piece that is itself a token is that token, without merging.
  bool whole_piece_tokens = false;
  // Ids from here on are special tokens (names such as <|endoftext|>): never made by merging or
  // the whole-piece rule, only found as added tokens.
  std::uint32_t specials_from = 0xffffffffu;
  // Special tokens and added words, with their ids (which also have their content in `tokens`).
  std::vector<AddedToken> added_tokens;
  std::optional<std::uint32_t> document_separator;
  std::string description;
};

// GPT-2's files: encoder.json (token -> id, the token's bytes written with GPT-2's byte-to-character
// table) and vocab.bpe (one merge "left right" per line, in rank order, after a "#version" line).
// The document separator is <|endoftext|>.
BpeVocabulary read_gpt2_vocabulary(const std::string& encoder_json, const std::string& vocab_bpe);

// A tiktoken rank file: lines "BASE64_TOKEN RANK" (cl100k_base.tiktoken, Llama 3's tokenizer.model);
// a token's id is its rank and a pair merges when its concatenation is a token. Split with the
// cl100k / Llama 3 pattern. The special tokens of the two known files are added after the ranks:
// cl100k_base's (100256 ranks; <|endoftext|> = 100257 separates documents) and Llama 3's
// (128000 ranks; 256 specials, <|begin_of_text|> = 128000 starts documents, as in llm.c).
BpeVocabulary read_tiktoken_vocabulary(const std::string& path);

class BpeTokenizer final : public TextTokenizer {
 public:
  // Checks that every byte value has a token and that merges name existing tokens.
  explicit BpeTokenizer(BpeVocabulary vocabulary);
  ~BpeTokenizer() override;

  using TextTokenizer::encode;
  using TextTokenizer::encode_with_special_tokens;
  void encode(std::string_view text, std::vector<std::uint32_t>& out) override;
  void encode_with_special_tokens(std::string_view text, std::vector<std::uint32_t>& out) override;
  std::string decode(std::span<const std::uint32_t> ids) const override;
  std::uint32_t vocab_size() const override;
  std::optional<std::uint32_t> document_separator() const override;
  std::optional<std::uint32_t> token_id(std::string_view name) const override;
  std::string description() const override;
  // The bytes of one token; an id outside the vocabulary is an error.
  std::string_view token(std::uint32_t id) const;

  // The merges alone on one piece (no pre-tokenisation, no cache), by the method kiln picks for its
  // length, or forced: the quadratic scan (short pieces) or the heap (long ones). For tests.
  enum class MergeMethod { auto_, scan, heap };
  void encode_piece(std::string_view piece, std::vector<std::uint32_t>& out, MergeMethod method = MergeMethod::auto_) const;

 private:
  // Normalized text between added tokens: pre-tokenized and merged.
  void encode_ordinary(std::string_view text, std::vector<std::uint32_t>& out);
  // Added tokens found as HF finds them: in the text as given, then in each normalized stretch.
  void encode_around_added(std::string_view text, bool with_special, std::vector<std::uint32_t>& out);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::data
