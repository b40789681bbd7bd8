#include "kiln/engine/engine_module.hpp"

namespace kiln {

void register_engine_module(ModuleRegistry& registry) {
  registry.add(make_module<EngineConfig>("engine", "the engine itself: backend choice and plugins", {},
                                         [](World&, const EngineConfig&) {}));
}

}  // namespace kiln
