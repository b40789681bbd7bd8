#pragma once
// A Generator's weights read from a training World: each parameter's f32 master weight, copied to
// the host from whichever backend holds it (a sample during training, or after loading a checkpoint).
#include "kiln/engine/world.hpp"
#include "kiln/model/generator.hpp"

namespace kiln::model {

// Reads the World's nn::ParamStore by parameter name. The store must hold whole tensors: not
// sharded by FSDP, not split by tensor parallelism (an error names the parameter otherwise).
// The World must outlive the returned function.
WeightSource param_store_weights(World& world);

}  // namespace kiln::model
