#include "kiln/data/added_tokens.hpp"

#include <algorithm>
#include <cstring>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "kiln/core/error.hpp"
#include "utf8.hpp"

namespace kiln::data {

namespace {

// Rust's regex \w with Unicode, which HF's single_word test uses (^\w, \w$).
constexpr const char* kWordChar = R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])";

}  // namespace

struct AddedTokenFinder::Impl {
  std::vector<AddedToken> tokens;
  // Per first byte, the tokens starting with it, longest first: the first whose content is at a
  // position is the longest match there.
  std::vector<std::uint32_t> by_first[256];
  pcre2_code* word = nullptr;  // only when a token is single_word
  pcre2_match_data* match = nullptr;
  ~Impl() {
    pcre2_match_data_free(match);
    pcre2_code_free(word);
  }
  bool is_word(char32_t c) const {
    char utf8[4];
    const std::size_t n = detail::utf8_encode(c, utf8);
    return pcre2_match(word, reinterpret_cast<PCRE2_SPTR>(utf8), n, 0, PCRE2_ANCHORED, match, nullptr) >= 0;
  }
};

AddedTokenFinder::AddedTokenFinder() : impl_(std::make_unique<Impl>()) {}

AddedTokenFinder::AddedTokenFinder(const std::vector<AddedToken>& tokens) : AddedTokenFinder() {
  Impl& m = *impl_;
  for (const auto& t : tokens)
    if (!t.content.empty()) m.tokens.push_back(t);  // HF ignores empty contents too
  for (std::uint32_t i = 0; i < m.tokens.size(); ++i)
    m.by_first[static_cast<unsigned char>(m.tokens[i].content[0])].push_back(i);
  for (auto& list : m.by_first)
    std::stable_sort(list.begin(), list.end(),
                     [&](auto a, auto b) { return m.tokens[a].content.size() > m.tokens[b].content.size(); });
  if (std::any_of(m.tokens.begin(), m.tokens.end(), [](const AddedToken& t) { return t.single_word; })) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    m.word = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kWordChar), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err,
                           &offset, nullptr);
    if (!m.word) KILN_THROW("added tokens: PCRE2 cannot compile the word-character class (error ", err, ")");
    m.match = pcre2_match_data_create_from_pattern(m.word, nullptr);
  }
}

AddedTokenFinder::AddedTokenFinder(AddedTokenFinder&&) noexcept = default;
AddedTokenFinder& AddedTokenFinder::operator=(AddedTokenFinder&&) noexcept = default;
AddedTokenFinder::~AddedTokenFinder() = default;

bool AddedTokenFinder::empty() const { return impl_->tokens.empty(); }

void AddedTokenFinder::find(std::string_view text, bool with_special, std::vector<Match>& out) const {
  const Impl& m = *impl_;
  out.clear();
  if (m.tokens.empty()) return;
  std::size_t taken = 0;  // end of the last token kept: HF's start_offset
  for (std::size_t pos = 0; pos < text.size();) {
    const AddedToken* hit = nullptr;
    for (auto i : m.by_first[static_cast<unsigned char>(text[pos])]) {
      const std::string& c = m.tokens[i].content;
      if (c.size() <= text.size() - pos && std::memcmp(text.data() + pos, c.data(), c.size()) == 0) {
        hit = &m.tokens[i];
        break;
      }
    }
    if (!hit) {
      ++pos;
      continue;
    }
    std::size_t begin = pos, end = pos + hit->content.size();
    pos = end;  // the matcher goes on after the match, whether it is kept or not
    if (hit->special && !with_special) continue;
    char32_t c;
    if (hit->single_word) {
      const std::size_t before = detail::utf8_char_before(text, begin, c);
      const bool word_before = before < begin && m.is_word(c);
      const bool word_after = end < text.size() && detail::utf8_char_at(text, end, c) && m.is_word(c);
      if (word_before || word_after) continue;
    }
    if (hit->lstrip) {
      std::size_t b = begin;
      for (std::size_t p; (p = detail::utf8_char_before(text, b, c)) < b && detail::is_white_space(c);) b = p;
      begin = std::max(b, taken);  // white space an earlier token took stays with it
    }
    if (hit->rstrip) {
      for (std::size_t n; end < text.size() && (n = detail::utf8_char_at(text, end, c)) && detail::is_white_space(c);)
        end += n;
      // (HF goes on matching right after the content; the next match would then overlap the
      // stripped white space only for a token whose content starts with white space.)
      pos = end;
    }
    out.push_back({begin, end, hit->id});
    taken = end;
  }
}

}  // namespace kiln::data
