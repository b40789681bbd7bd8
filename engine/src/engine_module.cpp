#include "kiln/engine/engine_module.hpp"

#include "kiln/engine/config/pipeline.hpp"

namespace kiln {

ConfigError config_error(World& world, std::string_view key, const std::string& message) {
  const config::Source at = [&] {
    if (const auto* s = world.try_resource<ConfigSources>()) return config::source_of(s->doc, s->file, key);
    const auto* r = world.try_resource<RankInfo>();
    return config::source_of(config::Node{}, r ? r->pipeline_file : std::string(), key);
  }();
  return ConfigError(cat(at.str(), ": ", key, ": ", message));
}

void register_engine_module(ModuleRegistry& registry) {
  registry.add(make_module<EngineConfig>("engine", "the engine itself: backend choice and plugins", {},
                                         [](World&, const EngineConfig&) {}));
}

}  // namespace kiln
