#include "kiln/rng/module.hpp"

#include "kiln/parallel/module.hpp"
#include "kiln/train/train.hpp"

namespace kiln::rng {

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<RngConfig>("rng", "named, forkable Philox RNG states with rank-aware seeds",
                                      {"train", "parallel"}, [](World& w, const RngConfig& cfg) {
                                        const auto& c = w.resource<parallel::ParallelState>().coords;
                                        w.emplace_resource<RngStatesTracker>(
                                            make_tracker(cfg.seed_policy, cfg.layout_invariant,
                                                         w.resource<train::TrainConfig>().seed,
                                                         RankCoords{.tp = c.tp, .ep = c.ep, .pp = c.pp}));
                                      }));
}

}  // namespace kiln::rng
