// Plugins that fail: while registering, or in their module's install.
#include <doctest/doctest.h>

#include "kiln/engine/config/pipeline.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/engine/plugin.hpp"
#include "kiln/engine/runner.hpp"

namespace {
kiln::config::PipelineConfig fault_pipeline(kiln::ModuleRegistry& reg, const std::string& fault_section) {
  auto doc = kiln::config::parse_toml_text("[fault]\n" + fault_section, "p.toml");
  return kiln::config::resolve(doc, "p.toml", reg);
}
}  // namespace

TEST_CASE("a plugin whose registration throws a non-kiln exception is an error naming the library") {
  kiln::ModuleRegistry reg;
  kiln::PluginLoader plugins;
  CHECK_THROWS_WITH_AS(plugins.load(KILN_THROWING_PLUGIN, reg),
                       doctest::Contains((std::string("plugin '") + KILN_THROWING_PLUGIN +
                                          "': the plugin's registration failed on purpose")
                                             .c_str()),
                       kiln::Error);
  CHECK(reg.find("fault") == nullptr);
}

TEST_CASE("a module whose install throws std::runtime_error stops the pipeline with an error naming the module") {
  kiln::ModuleRegistry reg;
  kiln::register_engine_module(reg);
  kiln::PluginLoader plugins;
  plugins.load(KILN_FAULT_PLUGIN, reg);
  auto cfg = fault_pipeline(reg, "throw_at_install = \"disk on fire\"\n");
  kiln::World w;
  CHECK_THROWS_WITH_AS(kiln::install_pipeline(w, cfg, reg),
                       doctest::Contains("installing module 'fault': disk on fire"), kiln::Error);
}

TEST_CASE("a module whose install throws a kiln error is named the same way") {
  kiln::ModuleRegistry reg;
  kiln::register_engine_module(reg);
  kiln::PluginLoader plugins;
  plugins.load(KILN_FAULT_PLUGIN, reg);
  auto cfg = fault_pipeline(reg, "kiln_error_at_install = \"no more tokens\"\n");
  kiln::World w;
  CHECK_THROWS_WITH_AS(kiln::install_pipeline(w, cfg, reg),
                       doctest::Contains("installing module 'fault': no more tokens"), kiln::Error);
}
