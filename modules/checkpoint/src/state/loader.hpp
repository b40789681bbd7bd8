#pragma once
// Resuming from a training-state checkpoint, on every rank.
#include <cstdint>
#include <string>

#include "kiln/engine/world.hpp"

namespace kiln::checkpoint {

// Collective. Loads checkpoint directory `dir` into this rank's state (held buffers, counters,
// blobs, the step) and publishes nn::ParamsLoaded. Everything is read and checked before any
// state changes; a problem on one rank is an error on every rank (that rank's names the file,
// tensor and rank; the others name that rank). Returns the checkpoint's step.
std::int64_t load_checkpoint(World& w, const std::string& dir);

}  // namespace kiln::checkpoint
