#pragma once
// Builds a World from pipeline text and --set overrides with kiln's modules, as the runner does.
#include <memory>
#include <string>
#include <vector>

#include "kiln/builtin.hpp"
#include "kiln/engine/config/pipeline.hpp"
#include "kiln/engine/runner.hpp"

namespace kiln::test {

struct Pipeline {
  ModuleRegistry registry;
  config::PipelineConfig config;
  std::unique_ptr<World> world;

  explicit Pipeline(const std::string& toml, const std::vector<std::string>& sets = {},
                    void (*extra)(ModuleRegistry&) = nullptr) {
    register_builtin_modules(registry);
    if (extra) extra(registry);
    auto doc = config::parse_toml_text(toml, "test.toml");
    config::apply_overrides(doc, sets);
    config = config::resolve(doc, "test.toml", registry);
    world = std::make_unique<World>();
    world->emplace_resource<RankInfo>(RankInfo{0, 1, 0, "test.toml"});
    install_pipeline(*world, config, registry);
  }
  void run() { run_pipeline(*world); }
};

}  // namespace kiln::test
