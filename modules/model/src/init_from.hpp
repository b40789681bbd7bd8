#pragma once
// [model] init_from: the starting weights from a safetensors file instead of random ones.
#include <string>

#include "kiln/engine/world.hpp"
#include "kiln/model/config.hpp"

namespace kiln::model {

// Reads `path` (Hugging Face GPT-2 names and layouts) and writes each parameter's part this rank
// holds into the master weights and their compute copy; publishes nn::ParamsLoaded. A FileError
// naming the file and tensor if it does not hold this model's tensors.
void load_initial_weights(World& w, const ModelConfig& cfg, const std::string& path);

}  // namespace kiln::model
