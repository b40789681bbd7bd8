#pragma once
// Pre-tokenisation: the split of text into pieces that byte-level BPE then encodes one by one, by
// the regular expressions of GPT-2 and of cl100k_base / Llama 3, matched with PCRE2 (UTF + Unicode
// properties, JIT-compiled).
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::data {

enum class PretokenizePattern {
  gpt2,    // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  cl100k,  // tiktoken's cl100k_base and Llama 3 (also: case-insensitive contractions, digits by three)
};

// The pattern as kiln compiles it. `\s` is written out as Unicode's White_Space set, which is what
// OpenAI's encoder.py (Python's regex module), tiktoken and Hugging Face's tokenizers match; PCRE2's
// own \s also takes U+180E, and JavaScript's (the npm gpt-3-encoder) takes U+FEFF but not U+0085.
std::string pretokenize_regex(PretokenizePattern pattern);

// Not thread-safe (it owns PCRE2's match data): one per thread.
class Pretokenizer {
 public:
  explicit Pretokenizer(PretokenizePattern pattern);
  // Any PCRE2 pattern (UTF, UCP); a bad pattern is an error naming its offset.
  explicit Pretokenizer(const std::string& pattern);
  Pretokenizer(Pretokenizer&&) noexcept;
  Pretokenizer& operator=(Pretokenizer&&) noexcept;
  ~Pretokenizer();

  // Calls piece(std::string_view) for each piece of `text` in order; together the pieces are the
  // text, byte for byte. Bytes that are not valid UTF-8 match nothing in a pattern: each run of them
  // between matches is a piece of its own.
  template <class F>
  void split(std::string_view text, F&& piece) {
    std::size_t pos = 0, begin = 0, end = 0;
    while (pos < text.size()) {
      if (!find(text, pos, begin, end)) begin = end = text.size();
      if (begin > pos) piece(text.substr(pos, begin - pos));
      if (end > begin) piece(text.substr(begin, end - begin));
      pos = end;
    }
  }
  std::vector<std::string> split(std::string_view text);

 private:
  // The first match at or after `from` as [begin, end); false when there is none. An empty match
  // is widened to one character so that splitting always advances.
  bool find(std::string_view text, std::size_t from, std::size_t& begin, std::size_t& end);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::data
