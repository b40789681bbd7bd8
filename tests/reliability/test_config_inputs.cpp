// Config inputs the fuzzer showed kiln must refuse or keep exactly (fuzz/fuzz_pipeline.cpp).
#include <doctest/doctest.h>

#include "kiln/builtin.hpp"
#include "kiln/core/error.hpp"
#include "kiln/engine/config/pipeline.hpp"

using namespace kiln;
using namespace kiln::config;

namespace {
std::string printed(const std::vector<std::string>& sets, const ModuleRegistry& reg) {
  Node doc = parse_toml_text("[data]\nsynthetic_vocab = 16\n", "p.toml");
  apply_overrides(doc, sets);
  return to_toml(resolve(doc, "p.toml", reg), reg);
}
}  // namespace

TEST_CASE("a --set string that is not UTF-8 is a config error naming the key, not a config that cannot be printed") {
  ModuleRegistry reg;
  register_builtin_modules(reg);
  CHECK_THROWS_WITH_AS(printed({"data.train_files=x\xff\xfe.bin"}, reg),
                       doctest::Contains("--set data.train_files=x\xff\xfe.bin: data.train_files: the value is not valid UTF-8"),
                       ConfigError);
  CHECK_THROWS_AS(printed({"data.val_files=\xc0\xaf"}, reg), ConfigError);        // an overlong '/'
  CHECK_THROWS_AS(printed({"data.val_files=\xed\xa0\x80"}, reg), ConfigError);    // a surrogate
  CHECK_THROWS_AS(printed({"data.val_files=\xf4\x90\x80\x80"}, reg), ConfigError);  // above U+10FFFF
  CHECK_THROWS_AS(printed({"data.val_files=abc\xe2\x82"}, reg), ConfigError);     // cut short
}

TEST_CASE("a --set string in UTF-8 prints as TOML that reads back to the same config") {
  ModuleRegistry reg;
  register_builtin_modules(reg);
  const std::string text = printed({"data.train_files=caf\xc3\xa9/\xf0\x9f\x98\x80_*.bin\x01\"q\""}, reg);
  CHECK(text.find("caf\xc3\xa9/\xf0\x9f\x98\x80_*.bin\\u0001\\\"q\\\"") != std::string::npos);
  Node back = parse_toml_text(text, "printed.toml");
  CHECK(to_toml(resolve(back, "printed.toml", reg), reg) == text);
}
