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

// Hugging Face's Digits pre-tokenizer, then ByteLevel's GPT-2 pattern on the text between the
// numbers (StarCoder2, SmolLM), as one pattern: each number character (\p{N}) a piece of its own,
// or each run of them with `individual_digits` false; the rest split as GPT-2 splits it, a number
// ending the text before it. `gpt2` false: ByteLevel without its pattern (the text between whole).
std::string digits_then_regex(bool individual_digits, bool gpt2);

// A pattern of Hugging Face's "Split" pre-tokenizer, which tokenizers compiles with Oniguruma (Ruby
// syntax, Unicode), rewritten for PCRE2 where the two differ: \s and \S as Unicode White_Space
// (written out as pretokenize_regex does), \h and \H as hexadecimal digits, \w, \W, \b, \B and
// [:alpha:] as Oniguruma's Unicode classes, \v as the vertical tab, \uHHHH as \x{HHHH}, the
// option m (dot matches newline) as PCRE2's s, and ^ and $ as line anchors. Llama 3's and Qwen2's
// patterns come out as cl100k's above. What PCRE2 cannot express (a class inside a class, &&
// intersections, \W or \H inside a class) is an error.
std::string pcre2_from_oniguruma(std::string_view pattern);

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
