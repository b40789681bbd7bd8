#include "kiln/data/pretokenize.hpp"

#include <algorithm>

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

std::string digits_then_regex(bool individual_digits, bool gpt2) {
  const std::string s = kSpace, number = individual_digits ? R"(\p{N})" : R"(\p{N}+)";
  if (!gpt2) return number + R"(|\P{N}+)";
  // GPT-2's pattern without " ?\p{N}+" (numbers are pieces apart, a space before one is not theirs),
  // and "\s+(?!\S)" taking white space up to a number as it would at the end of a text.
  return R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|)" + number + R"(| ?[^)" + s + R"(\p{L}\p{N}]+|[)" + s + "]+(?![^" + s +
         R"(\p{N}])|[)" + s + "]+";
}

std::string pcre2_from_oniguruma(std::string_view onig) {
  // Seen in tokenizers' Oniguruma (tests/data/fixtures/hf_tokenizer_reference.json, "probes"): \w
  // takes letters, marks, numbers and connector punctuation, but inside a class Alphabetic, marks,
  // decimal digits and connector punctuation (not ½ or ²); \b is a boundary of the first; [:alpha:]
  // is Alphabetic (with ⅷ and Arabic vowel marks, unlike PCRE2's \p{L}).
  const std::string space = kSpace, hex = "0-9a-fA-F";
  const std::string word = R"(\p{L}\p{M}\p{N}\p{Pc})", class_word = R"(\p{Alphabetic}\p{M}\p{Nd}\p{Pc})";
  const std::string w = "[" + word + "]";
  const std::string posix[][2] = {{"[:alpha:]", R"(\p{Alphabetic})"}, {"[:^alpha:]", R"(\P{Alphabetic})"},
                                  {"[:space:]", space}, {"[:^space:]", R"(\P{White_Space})"},
                                  {"[:digit:]", R"(\p{Nd})"}, {"[:^digit:]", R"(\P{Nd})"}};
  auto unsupported = [&](std::size_t at, const char* what) {
    KILN_THROW("the Oniguruma pattern has ", what, " at offset ", at, ", which kiln cannot write for PCRE2 (pattern: ",
               onig, ")");
  };
  auto hex4 = [&](std::size_t at) {
    auto is_hex = [](char h) { return (h >= '0' && h <= '9') || (h >= 'a' && h <= 'f') || (h >= 'A' && h <= 'F'); };
    return at + 4 <= onig.size() && std::all_of(onig.begin() + static_cast<std::ptrdiff_t>(at),
                                                onig.begin() + static_cast<std::ptrdiff_t>(at) + 4, is_hex);
  };
  std::string out;
  bool in_class = false, anchors = false;
  std::size_t class_body = 0;  // where the class's first member starts: a ']' there is a member
  for (std::size_t i = 0; i < onig.size(); ++i) {
    const char c = onig[i];
    if (c == '\\' && i + 1 < onig.size()) {
      const char e = onig[++i];
      switch (e) {
        case 's': out += in_class ? space : "[" + space + "]"; break;
        case 'S': out += in_class ? std::string(R"(\P{White_Space})") : "[^" + space + "]"; break;
        case 'h': out += in_class ? hex : "[" + hex + "]"; break;
        case 'w': out += in_class ? class_word : w; break;
        case 'H':
        case 'W':
          if (in_class) unsupported(i - 1, e == 'H' ? "\\H inside a class" : "\\W inside a class");
          out += "[^" + (e == 'H' ? hex : word) + "]";
          break;
        case 'b':
        case 'B':
          if (in_class) {
            out += c, out += e;  // a backspace in both
          } else {
            const std::string at = "(?<=" + w + ")(?!" + w + ")|(?<!" + w + ")(?=" + w + ")";
            const std::string within = "(?<=" + w + ")(?=" + w + ")|(?<!" + w + ")(?!" + w + ")";
            out += "(?:" + (e == 'b' ? at : within) + ")";
          }
          break;
        case 'v': out += R"(\x{0B})"; break;  // Ruby's \v is the vertical tab, PCRE2's all vertical space
        case 'u':
          if (hex4(i + 1)) {
            out += cat(R"(\x{)", onig.substr(i + 1, 4), "}");
            i += 4;
            break;
          }
          [[fallthrough]];
        default: out += c, out += e;  // the same in both (\p{L}, \d, \r, \n, \x{..}, \., ...)
      }
      continue;
    }
    if (in_class) {
      if (c == '[' && i + 1 < onig.size() && onig[i + 1] == ':') {
        const auto close = onig.find(":]", i + 2);
        if (close == std::string_view::npos) unsupported(i, "an unterminated [:class:]");
        const std::string_view name = onig.substr(i, close + 2 - i);
        std::string as = std::string(name);  // the others as PCRE2 has them
        for (const auto& [from, to] : posix)
          if (name == from) as = to;
        out += as;
        i = close + 1;
        continue;
      }
      if (c == '[') unsupported(i, "a class inside a class");
      if (c == '&' && i + 1 < onig.size() && onig[i + 1] == '&') unsupported(i, "a class intersection (&&)");
      if (c == '^' && i == class_body && onig[i - 1] == '[') class_body = i + 1;
      else if (c == ']' && i != class_body) in_class = false;
      out += c;
      continue;
    }
    if (c == '[') {
      in_class = true;
      class_body = i + 1;
    } else if (c == '^' || c == '$') {
      anchors = true;
    } else if (c == '(' && onig.substr(i, 2) == "(?") {
      // Inline options "(?imx-imx)" / "(?imx-imx:": Ruby's m is PCRE2's s.
      std::size_t k = i + 2;
      while (k < onig.size() && std::string_view("imx-").find(onig[k]) != std::string_view::npos) ++k;
      if (k > i + 2 && k < onig.size() && (onig[k] == ':' || onig[k] == ')')) {
        out += "(?";
        for (std::size_t j = i + 2; j < k; ++j) out += onig[j] == 'm' ? 's' : onig[j];
        i = k - 1;
        continue;
      }
    }
    out += c;
  }
  // Ruby's ^ and $ are always line anchors: PCRE2's multiline mode.
  return anchors ? "(?m)" + out : out;
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
