#include "kiln/builtin.hpp"

#include "kiln/checkpoint/training_checkpoint.hpp"
#include "kiln/data/module.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/fp8/module.hpp"
#include "kiln/log/log.hpp"
#include "kiln/model/module.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/optim/optim.hpp"
#include "kiln/parallel/fsdp.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/recompute/module.hpp"
#include "kiln/recompute/offload.hpp"
#include "kiln/rng/module.hpp"
#include "kiln/train/train.hpp"

namespace kiln {

void register_builtin_modules(ModuleRegistry& registry) {
  register_engine_module(registry);
  ops::register_module(registry);
  parallel::register_module(registry);
  train::register_module(registry);
  rng::register_module(registry);
  data::register_module(registry);
  model::register_module(registry);
  optim::register_module(registry);
  log::register_module(registry);
  fp8::register_module(registry);
  recompute::register_module(registry);
  recompute::register_offload_module(registry);
  checkpoint::register_state_module(registry);
  parallel::register_fsdp_module(registry);
}

}  // namespace kiln
