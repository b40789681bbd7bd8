#pragma once
// What every rank must agree on before a checkpoint is made complete or loaded.
#include <cstdint>
#include <string>

#include "kiln/engine/world.hpp"

namespace kiln::checkpoint {

// Collective over all ranks: the ranks (global, comma-separated) for which `failed` is true; "" if none.
std::string failing_ranks(World& w, bool failed);
// Collective over all ranks: the sum of v.
std::int32_t sum_over_ranks(World& w, std::int32_t v);

}  // namespace kiln::checkpoint
