#pragma once
// Added tokens: special tokens (<|endoftext|>, <|eot_id|>, <|im_start|>) and words added to a
// vocabulary after training (Qwen2's <tool_call>), which text names by their content. Found in text
// the way Hugging Face tokenizers' AddedVocabulary finds them, so that ids match its encode().
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::data {

// One token with Hugging Face's flags (tokenizer.json's "added_tokens").
struct AddedToken {
  std::string content;
  std::uint32_t id = 0;
  bool special = false;      // a control token: TextTokenizer::encode leaves its content as text
  bool normalized = false;   // matched in the normalized text (else in the text as given)
  bool lstrip = false;       // takes the white space before it
  bool rstrip = false;       // takes the white space after it
  bool single_word = false;  // matched only where no word character touches it
};

// Finds added tokens in text: leftmost first, the longest at one place, without overlaps (HF's
// Aho-Corasick LeftmostLongest), then each match's single_word, lstrip and rstrip as HF applies
// them (white space = Unicode White_Space; a word character = Rust's Unicode \w). The tokens are
// matched by their content as given: the caller normalizes the content of normalized ones.
class AddedTokenFinder {
 public:
  struct Match {
    std::size_t begin, end;  // the bytes the token takes, stripped white space included
    std::uint32_t id;
  };
  AddedTokenFinder();
  explicit AddedTokenFinder(const std::vector<AddedToken>& tokens);
  AddedTokenFinder(AddedTokenFinder&&) noexcept;
  AddedTokenFinder& operator=(AddedTokenFinder&&) noexcept;
  ~AddedTokenFinder();

  bool empty() const;
  // The tokens of `text` in order. `with_special` false: where a special token matches, the match
  // is passed over and its content stays text, as HF does with encode_special_tokens = True.
  void find(std::string_view text, bool with_special, std::vector<Match>& out) const;

  // Calls text_part(std::string_view) for each non-empty stretch of text between tokens and
  // token(std::uint32_t id) for each token, in order.
  template <class T, class K>
  void split(std::string_view text, bool with_special, T&& text_part, K&& token) const {
    std::vector<Match> matches;
    find(text, with_special, matches);
    std::size_t at = 0;
    for (const Match& m : matches) {
      if (m.begin > at) text_part(text.substr(at, m.begin - at));
      token(m.id);
      at = m.end;
    }
    if (at < text.size()) text_part(text.substr(at));
  }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::data
