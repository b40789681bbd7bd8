#include "kiln/rng/module.hpp"

#include <algorithm>
#include <iostream>

#include "kiln/engine/engine_module.hpp"
#include "kiln/train/layout.hpp"
#include "kiln/train/state.hpp"
#include "kiln/train/train.hpp"

namespace kiln::rng {

namespace {

// The tracker's states in training-state checkpoints. A state is restored when the saved one is
// the same stream: same name and seed (the seed encodes the master seed, the policy and the rank's
// place: with layout_invariant every rank's streams are those of TP rank 0, so any layout restores
// them exactly). A stream without its saved state keeps its fresh seed, as Megatron re-seeds when
// the layout changed, with a warning.
void save_states(World& w, RngStatesTracker& tracker) {
  w.resource<train::TrainingState>().blobs.push_back(
      {"rng", [&tracker] { return tracker.get_states().serialize(); },
       [&w, &tracker](const train::SavedBlobs& saved) -> std::function<void()> {
         RngSnapshot now = tracker.get_states();
         std::vector<std::string> fresh;
         if (saved.all.empty()) {
           fresh.push_back("all");
         } else {
           RngSnapshot old;
           try {
             old = RngSnapshot::deserialize(saved.own ? *saved.own : saved.all.front());
           } catch (const Error& e) {
             KILN_FILE_ERROR("checkpoint ", saved.checkpoint, ": RNG states: ", e.what());
           }
           if (old.default_state.seed == now.default_state.seed) now.default_state = old.default_state;
           else fresh.push_back("default");
           for (auto& [name, state] : now.states) {
             const auto& key = name;  // clang 14 cannot capture a structured binding
             auto it = std::find_if(old.states.begin(), old.states.end(), [&](auto& s) { return s.first == key; });
             if (it != old.states.end() && it->second.seed == state.seed) state = it->second;
             else fresh.push_back(name);
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
       }});
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
