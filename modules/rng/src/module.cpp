#include "kiln/rng/module.hpp"

#include <algorithm>
#include <iostream>

#include "kiln/engine/engine_module.hpp"
#include "kiln/train/layout.hpp"
#include "kiln/train/state.hpp"
#include "kiln/train/train.hpp"

namespace kiln::rng {

namespace {

// The tracker's states in training-state checkpoints, saved as the seed rules say (Megatron-Bridge's):
// sharded by (pp, tp, dp) under expert parallelism, by (pp, tp) otherwise, with the data-parallel
// ranks as replicas (they hold the same states: every rank draws every state's whole tensors).
// A state is restored from a saved one of the same stream: same name and seed (the seed encodes the
// master seed, the policy and the rank's place: with layout_invariant every rank's streams are those
// of TP and EP rank 0, so any layout restores them exactly), looked for in this rank's own save, then
// in every rank's. A stream without its saved state keeps its fresh seed, as Megatron re-seeds when
// the layout changed, with a warning.
void save_states(World& w, RngStatesTracker& tracker) {
  const auto* layout = w.try_resource<train::ParallelLayout>();
  const bool saved_here = !layout || layout->ep > 1 || layout->dp_rank == 0;
  w.resource<train::TrainingState>().blobs.push_back(
      {"rng", [&tracker] { return tracker.get_states().serialize(); },
       [&w, &tracker](const train::SavedBlobs& saved) -> std::function<void()> {
         RngSnapshot now = tracker.get_states();
         std::vector<std::string> fresh;
         std::vector<RngSnapshot> old;  // this rank's own save first
         try {
           if (saved.own) old.push_back(RngSnapshot::deserialize(*saved.own));
           for (const auto& bytes : saved.all) old.push_back(RngSnapshot::deserialize(bytes));
         } catch (const Error& e) {
           KILN_FILE_ERROR("checkpoint ", saved.checkpoint, ": RNG states: ", e.what());
         }
         if (old.empty()) fresh.push_back("all");
         auto restore = [&](RngState& state, const std::string& name, auto&& find) {
           for (const auto& o : old)
             if (const RngState* s = find(o); s && s->seed == state.seed) {
               state = *s;
               return;
             }
           fresh.push_back(name);
         };
         if (!old.empty()) {
           restore(now.default_state, "default", [](const RngSnapshot& o) { return &o.default_state; });
           for (auto& [name, state] : now.states) {
             const std::string key = name;  // clang 14 cannot capture a structured binding
             restore(state, key, [&key](const RngSnapshot& o) -> const RngState* {
               auto it = std::find_if(o.states.begin(), o.states.end(), [&](auto& s) { return s.first == key; });
               return it == o.states.end() ? nullptr : &it->second;
             });
           }
         }
         const bool rank0 = w.resource<RankInfo>().rank == 0;
         return [&tracker, now, fresh, rank0, where = saved.checkpoint] {
           tracker.set_states(now);
           if (fresh.empty() || !rank0) return;
           std::cout << "rng: warning: " << where << " holds no state of this run's RNG streams (";
           for (std::size_t i = 0; i < fresh.size(); ++i) std::cout << (i ? ", " : "") << fresh[i];
           std::cout << "): another layout, seed or seed policy; they start afresh from their seeds\n";
         };
       },
       [saved_here] { return saved_here; }});
}

}  // namespace

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<RngConfig>("rng", "named, forkable Philox RNG states with rank-aware seeds",
                                      {"train", "parallel"}, [](World& w, const RngConfig& cfg) {
                                        // This rank's coordinates (the parallel module's layout; one
                                        // rank's without it).
                                        const auto* l = w.try_resource<train::ParallelLayout>();
                                        const RankCoords at = l ? RankCoords{.tp = l->tp_rank, .ep = l->ep_rank,
                                                                             .pp = l->pp_rank}
                                                                : RankCoords{};
                                        auto& tracker = w.emplace_resource<RngStatesTracker>(
                                            make_tracker(cfg.seed_policy, cfg.layout_invariant,
                                                         w.resource<train::TrainConfig>().seed, at));
                                        save_states(w, tracker);
                                      }));
}

}  // namespace kiln::rng
