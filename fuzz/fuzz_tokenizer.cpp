// The BPE tokenizer-file readers (GPT-2's encoder.json + vocab.bpe, tiktoken rank files) and the
// tokenizer they make, on text.
//
// Input: byte 0 picks the format (even: GPT-2, odd: tiktoken); then GPT-2's encoder.json, a NUL,
// vocab.bpe, a NUL, text — or the tiktoken file, a NUL, text.
// Promise checked: any byte string encodes and decodes back to itself (bpe.hpp).
// (An id far beyond the file's number of tokens once made the readers allocate a table of that
// many strings, tens of GB from a file of a few bytes: now an error naming the file and line.)
#include <cctype>
#include <vector>

#include "fuzz_util.hpp"
#include "kiln/data/bpe.hpp"

namespace {

std::string_view next_part(std::string_view& rest) {
  const auto nul = rest.find('\0');
  const std::string_view part = rest.substr(0, nul);
  rest = nul == std::string_view::npos ? std::string_view() : rest.substr(nul + 1);
  return part;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kiln::data;
  if (size < 1) return 0;
  static kiln::fuzz::MemFile file_a("fuzz-encoder.json"), file_b("fuzz-vocab.bpe");
  const bool gpt2 = data[0] % 2 == 0;
  std::string_view rest = kiln::fuzz::as_text(data + 1, size - 1);
  const std::string_view a = next_part(rest);
  const std::string_view b = gpt2 ? next_part(rest) : std::string_view();
  const std::string_view text = rest;

  std::unique_ptr<BpeTokenizer> tok;
  try {
    tok = std::make_unique<BpeTokenizer>(gpt2 ? read_gpt2_vocabulary(file_a.set(a), file_b.set(b))
                                              : read_tiktoken_vocabulary(file_a.set(a)));
  } catch (const std::exception&) {
    return 0;
  }
  std::vector<std::uint32_t> ids;
  std::string back;
  try {
    tok->encode(text, ids);
    for (auto id : ids)
      if (id >= tok->vocab_size()) kiln::fuzz::fuzz_fail("encode gave an id outside the vocabulary");
    back = tok->decode(ids);
  } catch (const std::exception& e) {
    kiln::fuzz::fuzz_fail(std::string("encoding or decoding text threw: ") + e.what());
  }
  if (back != text) kiln::fuzz::fuzz_fail("text does not round trip through encode and decode");
  return 0;
}
