#include <doctest/doctest.h>

#include "kiln/engine/config/pipeline.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/engine/plugin.hpp"
#include "kiln/engine/runner.hpp"

TEST_CASE("a plugin library registers modules that a pipeline can use") {
  kiln::ModuleRegistry reg;
  kiln::register_engine_module(reg);
  kiln::PluginLoader plugins;
  plugins.load(KILN_TEST_PLUGIN, reg);
  REQUIRE(reg.find("greeter") != nullptr);
  auto doc = kiln::config::parse_toml_text("[greeter]\ngreeting = \"hi\"\nrepeat = 2\n", "p.toml");
  auto cfg = kiln::config::resolve(doc, "p.toml", reg);
  kiln::World w;
  kiln::install_pipeline(w, cfg, reg);
  w.resource<kiln::RunControl>().request_stop("no steps");
  kiln::run_pipeline(w);
  CHECK(w.systems().order(kiln::Phase::setup) == std::vector<std::string>{"greeter.say"});
}

TEST_CASE("a library that is not a plugin is an error naming it") {
  kiln::ModuleRegistry reg;
  kiln::PluginLoader plugins;
  CHECK_THROWS_WITH_AS(plugins.load("/no/such/libplugin.so", reg), doctest::Contains("/no/such/libplugin.so"), kiln::Error);
}
