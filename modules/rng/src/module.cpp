#include "kiln/rng/module.hpp"

#include "kiln/parallel/module.hpp"
#include "kiln/train/train.hpp"

namespace kiln::rng {

RngStatesTracker make_tracker(const RngConfig& cfg, std::uint64_t master_seed, const parallel::Coords& coords) {
  parallel::Coords sharded = coords;
  if (cfg.layout_invariant) sharded.tp = 0;
  RngStatesTracker t(stream_seed(cfg.seed_policy, master_seed, StreamKind::default_, coords));
  t.add(kModelParallelRng, stream_seed(cfg.seed_policy, master_seed, StreamKind::model_parallel, sharded));
  t.add(kDataParallelRng, stream_seed(cfg.seed_policy, master_seed, StreamKind::data_parallel, coords));
  t.add(kExpertParallelRng, stream_seed(cfg.seed_policy, master_seed, StreamKind::expert_parallel, sharded));
  return t;
}

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<RngConfig>("rng", "named, forkable Philox RNG states with rank-aware seeds",
                                      {"train", "parallel"}, [](World& w, const RngConfig& cfg) {
                                        const auto& par = w.resource<parallel::ParallelState>();
                                        w.emplace_resource<RngStatesTracker>(
                                            make_tracker(cfg, w.resource<train::TrainConfig>().seed, par.coords));
                                      }));
}

}  // namespace kiln::rng
