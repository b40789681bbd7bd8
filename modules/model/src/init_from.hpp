#pragma once
// [model] init_from: the starting weights from Hugging Face files instead of random ones.
#include <string>

#include "kiln/engine/world.hpp"
#include "kiln/model/config.hpp"

namespace kiln::model {

// Reads `path` (a Hugging Face Llama or GPT-2 directory, or a GPT-2 .safetensors; classify_hf_path)
// and writes each parameter's part this rank holds into the master weights and their compute copy
// (a Llama's pieces are read from the mapped files, so no rank reads the whole model); publishes
// nn::ParamsLoaded. A FileError naming the file and tensor if it does not hold this model's tensors.
void load_initial_weights(World& w, const ModelConfig& cfg, const std::string& path);

}  // namespace kiln::model
