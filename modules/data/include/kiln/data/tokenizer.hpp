#pragma once
// Tokenizers behind one interface (bytes: token = byte value, vocabulary 256; byte-level BPE in
// bpe.hpp), the choice of one by name, and corpus preparation into llm.c shards.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::data {

std::vector<std::uint16_t> byte_encode(std::string_view text);
std::string byte_decode(const std::vector<std::uint16_t>& tokens);

// Text to token ids and back. Not thread-safe (BPE keeps a cache of pieces): one per thread.
class TextTokenizer {
 public:
  virtual ~TextTokenizer() = default;
  // Appends the ids of `text`, any bytes (not only valid UTF-8), normalized first where the
  // tokenizer says so (Qwen2: NFC). Special tokens' names
  // ("<|endoftext|>") are ordinary text here, as in GPT-2's encoder and tiktoken's encode_ordinary
  // (Hugging Face: encode_special_tokens = True); added tokens that are not special (Qwen2's
  // <tool_call>) are still found, as Hugging Face always finds them.
  virtual void encode(std::string_view text, std::vector<std::uint32_t>& out) = 0;
  std::vector<std::uint32_t> encode(std::string_view text) {
    std::vector<std::uint32_t> out;
    encode(text, out);
    return out;
  }
  // As encode, but a special token's name in `text` ("<|eot_id|>", "<|im_start|>") is that token,
  // as in Hugging Face's tokenizer.encode(text, add_special_tokens=False) and tiktoken's
  // encode(text, allowed_special="all"). For chat templates, not for raw corpora, where such a name
  // is text that happens to look like one. Default: encode (a tokenizer without special tokens).
  virtual void encode_with_special_tokens(std::string_view text, std::vector<std::uint32_t>& out) { encode(text, out); }
  std::vector<std::uint32_t> encode_with_special_tokens(std::string_view text) {
    std::vector<std::uint32_t> out;
    encode_with_special_tokens(text, out);
    return out;
  }
  // The id of a special or added token by its name ("<|start_header_id|>"); none when the
  // tokenizer has no such token.
  virtual std::optional<std::uint32_t> token_id(std::string_view /*name*/) const { return std::nullopt; }
  // The tokens' bytes, concatenated: decode(encode(t)) == t for every byte string t, but for
  // tokenizers that normalize text (Qwen2's NFC: then t normalized) or whose added tokens take the
  // white space beside them (lstrip, rstrip). An id outside the vocabulary is an error.
  virtual std::string decode(std::span<const std::uint32_t> ids) const = 0;
  virtual std::uint32_t vocab_size() const = 0;
  // The token put before each document when documents are tokenized into one stream, as llm.c's
  // data scripts do (GPT-2, Qwen2: <|endoftext|>; Llama 3: <|begin_of_text|>); none for bytes.
  virtual std::optional<std::uint32_t> document_separator() const { return std::nullopt; }
  // What it is, for messages: "GPT-2 BPE (DIR/encoder.json + vocab.bpe, 50257 tokens)".
  virtual std::string description() const = 0;
};

class ByteTokenizer final : public TextTokenizer {
 public:
  using TextTokenizer::encode;
  void encode(std::string_view text, std::vector<std::uint32_t>& out) override;
  std::string decode(std::span<const std::uint32_t> ids) const override;
  std::uint32_t vocab_size() const override { return 256; }
  std::string description() const override { return "bytes (256 tokens)"; }
};

// The directory of GPT-2's files (encoder.json + vocab.bpe) among `dirs`: the first holding both.
std::optional<std::string> find_gpt2_files(const std::vector<std::string>& dirs);

// A tokenizer by name: "bytes"; "gpt2" (GPT-2's encoder.json + vocab.bpe from the first of
// `gpt2_dirs` that has them); a Hugging Face tokenizer.json (a file named *.json, or a directory
// holding tokenizer.json: a model's directory); a directory holding encoder.json + vocab.bpe; or a
// tiktoken rank file (cl100k_base.tiktoken, Llama 3's tokenizer.model). Errors name what was looked
// for and where.
std::unique_ptr<TextTokenizer> open_tokenizer(const std::string& spec, const std::vector<std::string>& gpt2_dirs);

// Turns part-of-speech tagged text ("The/at jury/nn said/vbd ./.") into plain text ("The jury
// said."): keeps each word before its last '/', turns `` and '' into ", and joins punctuation.
std::string strip_pos_tags(std::string_view tagged);

struct TokenizeOptions {
  double val_fraction = 0.1;        // the last fraction of the token stream goes to validation
  std::int64_t shard_tokens = 100'000'000;
  bool strip_pos_tags = false;
  // nullptr: bytes. A tokenizer with a document separator gets it before each file (llm.c's
  // fineweb.py puts <|endoftext|> before each document); without one, files are joined by a newline.
  TextTokenizer* tokenizer = nullptr;
};
struct TokenizeResult {
  std::int64_t train_tokens = 0, val_tokens = 0;
  std::vector<std::string> files;
  std::int64_t text_bytes = 0;   // what was encoded (after stripping tags)
  double encode_seconds = 0;     // encoding alone (no reading or writing)
  int token_bytes = 2;           // 2: llm.c's GPT-2 shards; 4: its Llama 3 shards (ids above 65535)
};
// Reads the text files (in the order given), tokenizes them, and writes DIR/train_NNNNNN.bin and
// DIR/val_NNNNNN.bin as llm.c shards: uint16 tokens when the vocabulary fits, else uint32.
TokenizeResult tokenize_files(const std::vector<std::string>& inputs, const std::string& out_dir,
                              const TokenizeOptions& options);

}  // namespace kiln::data
