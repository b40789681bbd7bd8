// The checkpoint manifest reader (Manifest::parse). The input is manifest.json's text.
// Promise checked: a manifest that parses writes (to_json) a text that parses to the same manifest.
#include "fuzz_util.hpp"
#include "kiln/checkpoint/manifest.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using kiln::checkpoint::Manifest;
  const std::string text(kiln::fuzz::as_text(data, size));
  Manifest m;
  try {
    m = Manifest::parse(text, "fuzz/manifest.json");
    for (auto& t : m.tensors) (void)m.tensor(t.name);
    for (auto& r : m.ranks) (void)m.rank(r.rank);
  } catch (const std::exception&) {
    return 0;
  }
  std::string json;
  try {
    json = m.to_json();
  } catch (const std::exception& e) {
    // nlohmann refuses to write strings that are not UTF-8; the parser accepted them from JSON
    // escapes, so this would be a manifest kiln reads but cannot write back.
    kiln::fuzz::fuzz_fail(std::string("to_json of a parsed manifest throws: ") + e.what());
  }
  try {
    if (Manifest::parse(json, "fuzz/written.json").to_json() != json)
      kiln::fuzz::fuzz_fail("a written manifest reads back differently:\n" + json);
  } catch (const std::exception& e) {
    kiln::fuzz::fuzz_fail(std::string("a written manifest does not read back: ") + e.what() + "\n" + json);
  }
  return 0;
}
