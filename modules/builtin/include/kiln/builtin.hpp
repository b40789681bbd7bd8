#pragma once
// Registers every module kiln ships (engine, backend, parallel, train, rng, data, model, optim, log).
#include "kiln/engine/module.hpp"

namespace kiln {
void register_builtin_modules(ModuleRegistry& registry);
}
