#pragma once
#include "kiln/engine/module.hpp"
#include "kiln/model/config.hpp"
#include "kiln/model/gpt.hpp"

namespace kiln::model {
void register_module(ModuleRegistry& registry);
}
