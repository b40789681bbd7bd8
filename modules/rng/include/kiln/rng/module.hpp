#pragma once
// The "rng" module (engine glue of kiln::rng, library kiln::rng_module): one RngStatesTracker per
// rank, a World resource, seeded from train.seed by the seed policy at the rank's coordinates.
#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/module.hpp"
#include "kiln/rng/seed_policy.hpp"
#include "kiln/rng/tracker.hpp"

namespace kiln::rng {

struct RngConfig {
  SeedPolicy seed_policy = SeedPolicy::collision_free;
  bool layout_invariant = true;
};
KILN_CONFIG(RngConfig,
            (seed_policy, "how per-rank seeds derive from train.seed: collision_free or megatron"),
            (layout_invariant,
             "draws are functions of the global element index, so TP, sharded and pipeline-parallel runs draw what "
             "one rank would; false: per-rank streams as Megatron"))

void register_module(ModuleRegistry& registry);

}  // namespace kiln::rng
