#pragma once
// The "rng" module: one RngStatesTracker per rank, seeded from train.seed by the seed policy.
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
             "draws are functions of the global element index, so TP/sharded runs draw what one rank would; "
             "false: per-rank streams as Megatron"))

// Builds a rank's tracker: the default state and the named states of kiln's parallel layout.
// With layout_invariant, the streams used on tensor-parallel shards are keyed as on TP rank 0 (the
// shards are decorrelated by their global element indices instead).
RngStatesTracker make_tracker(const RngConfig& cfg, std::uint64_t master_seed, const parallel::Coords& coords);

void register_module(ModuleRegistry& registry);

}  // namespace kiln::rng
