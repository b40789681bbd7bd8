#include "kiln/parallel/module.hpp"

#include "kiln/engine/engine_module.hpp"

namespace kiln::parallel {

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<ParallelConfig>(
      "parallel", "topology: tensor, pipeline, context, expert and data parallel groups", {},
      [](World& w, const ParallelConfig& cfg) {
        const auto& r = w.resource<RankInfo>();
        Topology topo = [&] {
          try {
            return Topology(r.world_size, cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.dp);
          } catch (const Error& e) {
            throw ConfigError(cat(r.pipeline_file, ": [parallel] ", e.what()));
          }
        }();
        w.emplace_resource<ParallelState>(ParallelState{topo, r.rank, topo.coords(r.rank)});
      }));
}

}  // namespace kiln::parallel
