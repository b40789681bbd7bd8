#pragma once
// A trained model for the tools that use one whole (kiln export, kiln generate): its [model]
// configuration and its weights by kiln parameter name, from a training-state checkpoint (its
// saved configuration; the pieces of every rank put together) or from a safetensors file with
// Hugging Face GPT-2 names (config.json beside it).
#include <string>

#include "kiln/model/config.hpp"
#include "kiln/model/generator.hpp"

namespace kiln::app {

struct ModelSource {
  model::ModelConfig config;
  model::WeightSource weights;  // kiln name -> the whole f32 tensor
  std::string description;      // what was opened, for messages
};

// `path`: a checkpoint directory (or a folder of them: its newest), or a .safetensors file.
ModelSource open_model(const std::string& path);

}  // namespace kiln::app
