// The reader of Hugging Face tokenizer.json files and the tokenizer it makes, on text: the model,
// the pipeline steps, the rewriting of Oniguruma patterns for PCRE2, added tokens, NFC.
//
// Input: a tokenizer.json, a NUL, text.
// Promises checked: every id that encode and encode_with_special_tokens give is in the vocabulary
// and decodes; where the text is neither normalized nor stripped of white space by an added token
// (bpe.hpp), encode's ids decode back to the text.
#include <vector>

#include "fuzz_util.hpp"
#include "kiln/data/hf_tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kiln::data;
  static kiln::fuzz::MemFile file("fuzz-tokenizer.json");
  const std::string_view input = kiln::fuzz::as_text(data, size);
  const auto nul = input.find('\0');
  const std::string_view json = input.substr(0, nul);
  const std::string_view text = nul == std::string_view::npos ? std::string_view() : input.substr(nul + 1);

  std::unique_ptr<BpeTokenizer> tok;
  bool round_trips = false;
  try {
    BpeVocabulary v = read_hf_tokenizer_json(file.set(json));
    round_trips = v.normalization == Normalization::none;
    for (const auto& t : v.added_tokens) round_trips = round_trips && (t.special || !(t.lstrip || t.rstrip));
    tok = std::make_unique<BpeTokenizer>(std::move(v));
  } catch (const std::exception&) {
    return 0;
  }
  try {
    for (bool with_special : {false, true}) {
      const std::vector<std::uint32_t> ids = with_special ? tok->encode_with_special_tokens(text) : tok->encode(text);
      for (auto id : ids)
        if (id >= tok->vocab_size()) kiln::fuzz::fuzz_fail("encode gave an id outside the vocabulary");
      const std::string back = tok->decode(ids);
      if (!with_special && round_trips && back != text)
        kiln::fuzz::fuzz_fail("text does not round trip through encode and decode");
    }
  } catch (const std::exception& e) {
    kiln::fuzz::fuzz_fail(std::string("encoding or decoding text threw: ") + e.what());
  }
  return 0;
}
