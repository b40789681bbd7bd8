#include "kiln/data/pretokenize.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "kiln/core/error.hpp"

namespace kiln::data {

namespace {

// Unicode's White_Space property (PropList.txt, unchanged since Unicode 6.3).
constexpr const char* kSpace = R"(\t-\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

}  // namespace

std::string pretokenize_regex(PretokenizePattern pattern) {
  const std::string s = kSpace;
  switch (pattern) {
    case PretokenizePattern::gpt2:
      return R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^)" + s + R"(\p{L}\p{N}]+|[)" + s + "]+(?![^" + s +
             "])|[" + s + "]+";
    case PretokenizePattern::cl100k:
      return R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^)" + s +
             R"(\p{L}\p{N}]+[\r\n]*|[)" + s + R"(]*[\r\n]+|[)" + s + "]+(?![^" + s + "])|[" + s + "]+";
  }
  KILN_THROW("unknown pre-tokenization pattern");
}

struct Pretokenizer::Impl {
  pcre2_code* code = nullptr;
  pcre2_match_data* match = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  bool jit = false;
  ~Impl() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(match);
    pcre2_code_free(code);
  }
};

Pretokenizer::Pretokenizer(PretokenizePattern pattern) : Pretokenizer(pretokenize_regex(pattern)) {}

Pretokenizer::Pretokenizer(const std::string& pattern) : impl_(std::make_unique<Impl>()) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  // MATCH_INVALID_UTF: text need not be valid UTF-8; invalid bytes simply match nothing.
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &offset, nullptr);
  if (!impl_->code)
    KILN_THROW("pre-tokenization pattern, offset ", offset, ": ", pcre2_message(err), " (pattern: ", pattern, ")");
  impl_->match = pcre2_match_data_create_from_pattern(impl_->code, nullptr);
  // Without JIT (a platform PCRE2 cannot JIT for) the interpreter gives the same matches, slower.
  impl_->jit = pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE) == 0;
  if (impl_->jit) {
    // Long whitespace runs backtrack through `\s+(?!\S)`; the default 32 KiB JIT stack is small.
    impl_->stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    impl_->context = pcre2_match_context_create(nullptr);
    pcre2_jit_stack_assign(impl_->context, nullptr, impl_->stack);
  }
}

Pretokenizer::Pretokenizer(Pretokenizer&&) noexcept = default;
Pretokenizer& Pretokenizer::operator=(Pretokenizer&&) noexcept = default;
Pretokenizer::~Pretokenizer() = default;

bool Pretokenizer::find(std::string_view text, std::size_t from, std::size_t& begin, std::size_t& end) {
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const int rc = impl_->jit ? pcre2_jit_match(impl_->code, subject, text.size(), from, 0, impl_->match, impl_->context)
                            : pcre2_match(impl_->code, subject, text.size(), from, 0, impl_->match, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) KILN_THROW("pre-tokenization: PCRE2 matching failed at byte ", from, ": ", pcre2_message(rc));
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(impl_->match);
  begin = ov[0];
  end = ov[1];
  if (end == begin) {  // an empty match: take the character there
    if (begin >= text.size()) return false;
    end = begin + 1;
    while (end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) ++end;
  }
  return true;
}

std::vector<std::string> Pretokenizer::split(std::string_view text) {
  std::vector<std::string> out;
  split(text, [&](std::string_view p) { out.emplace_back(p); });
  return out;
}

}  // namespace kiln::data
