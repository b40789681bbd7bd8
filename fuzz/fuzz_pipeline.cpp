// The pipeline loader: TOML text plus `--set` overrides, resolved against every module kiln ships,
// then printed as `kiln config` does and read back.
//
// Input: the TOML text; if it holds a line "#--set", every line after that one is a --set argument
// (section.key=value). Plugins named in [engine] are not loaded (no dlopen of fuzzed paths), and
// no module is installed (a fuzzed model size would only measure the allocator).
// Promise checked: a config that resolves prints as TOML that resolves to the same printed text.
#include <any>
#include <string>
#include <vector>

#include "fuzz_util.hpp"
#include "kiln/builtin.hpp"
#include "kiln/engine/config/pipeline.hpp"
#include "kiln/engine/engine_module.hpp"

namespace {

const kiln::ModuleRegistry& registry() {
  static const kiln::ModuleRegistry* r = [] {
    auto* reg = new kiln::ModuleRegistry;
    kiln::register_builtin_modules(*reg);
    return reg;
  }();
  return *r;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kiln::config;
  const std::string_view in = kiln::fuzz::as_text(data, size);
  std::string_view toml = in;
  std::vector<std::string> sets;
  constexpr std::string_view kMark = "#--set\n";
  std::size_t mark = in.rfind(kMark, 0) == 0 ? 0 : in.find("\n#--set\n");
  if (mark != std::string_view::npos) {
    if (mark != 0) ++mark;  // keep the newline before the marker with the TOML text
    toml = in.substr(0, mark);
    std::string_view rest = in.substr(mark + kMark.size());
    while (!rest.empty()) {
      const auto nl = rest.find('\n');
      sets.emplace_back(rest.substr(0, nl));
      rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
    }
  }

  const auto& reg = registry();
  std::string printed;
  try {
    Node doc = parse_toml_text(toml, "fuzz.toml");
    apply_overrides(doc, sets);
    (void)std::any_cast<kiln::EngineConfig>(read_engine_section(doc, reg));
    PipelineConfig cfg = resolve(doc, "fuzz.toml", reg);
    printed = to_toml(cfg, reg);
    for (auto& m : cfg.modules) (void)source_of(doc, "fuzz.toml", m + ".x.y");
  } catch (const std::exception&) {
    return 0;  // rejected, with a message: fine
  }

  // `kiln config` output must read back to itself.
  std::string again;
  try {
    Node doc = parse_toml_text(printed, "printed.toml");
    again = to_toml(resolve(doc, "printed.toml", reg), reg);
  } catch (const std::exception& e) {
    kiln::fuzz::fuzz_fail(std::string("the printed config does not read back: ") + e.what() + "\n" + printed);
  }
  if (again != printed)
    kiln::fuzz::fuzz_fail("the printed config reads back to another config:\n" + printed + "\n---\n" + again);
  return 0;
}
