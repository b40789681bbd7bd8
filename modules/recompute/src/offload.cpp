// The activation_offload module's install: which blocks offload, taken out of activation checkpointing,
// and the runner wired to the layers' events.
#include "kiln/recompute/offload.hpp"

#include <algorithm>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "kiln/engine/engine_module.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/recompute/module.hpp"
#include "kiln/recompute/offload_runner.hpp"

namespace kiln::recompute {

namespace {

void install_offload(World& w, const ActivationOffloadConfig& cfg) {
  if (cfg.blocks == 0) return;
  const auto& par = w.resource<parallel::ParallelState>();
  if (par.pp_size() > 1)
    throw config_error(w, "activation_offload.blocks",
                       cat(cfg.blocks, " with parallel.pp = ", par.pp_size(),
                           ": a pipeline stage keeps several micro-batches' activations at once, which the offload "
                           "slots do not; set activation_offload.blocks = 0 or parallel.pp = 1"));
  std::vector<std::pair<int, Entity>> blocks;  // (block index, layer entity)
  for (Entity e : w.view<nn::Layer>()) {
    const auto& layer = w.get<nn::Layer>(e);
    if (layer.kind == nn::LayerKind::block) blocks.emplace_back(layer.block, e);
  }
  std::sort(blocks.begin(), blocks.end());
  const std::vector<int> chosen = cfg.chosen();
  if (chosen.back() >= static_cast<int>(blocks.size()))
    throw config_error(w, "activation_offload.blocks",
                       cat(cfg.blocks, " blocks every ", cfg.every, " need block ", chosen.back(), ", but the model has ",
                           blocks.size(), " (blocks 0 to ", blocks.size() - 1, "); lower activation_offload.blocks or "
                           "activation_offload.every"));

  auto& st = w.emplace_resource<ActivationOffloadState>();
  auto* recomputing = w.try_resource<ActivationCheckpointState>();
  int taken = 0;  // blocks taken out of activation checkpointing
  std::vector<int> units;  // the offloaded layer units, ascending
  for (std::size_t k = 0; k < chosen.size(); ++k) {
    const auto& [block, e] = blocks[static_cast<std::size_t>(chosen[k])];
    const int unit = w.get<nn::Layer>(e).unit;
    if (w.has<nn::ActivationRecompute>(e)) {
      w.remove<nn::ActivationRecompute>(e);
      if (recomputing) std::erase(recomputing->units, unit);
      ++taken;
    }
    w.emplace<nn::ActivationOffload>(e, nn::ActivationOffload{static_cast<int>(k) % cfg.slots, {}});
    units.push_back(unit);
  }
  st.runner = std::make_shared<OffloadRunner>(w.resource<ops::ActiveBackend>().get(), std::move(units), cfg.slots);

  w.systems().add({"activation_offload.setup", Phase::setup,
                   [taken](World& world) {
                     auto& s = world.resource<ActivationOffloadState>();
                     std::vector<TensorView> regions;
                     std::vector<int> indices;
                     for (Entity e : world.view<nn::ActivationOffload>()) {
                       regions.push_back(world.get<nn::ActivationOffload>(e).region);
                       indices.push_back(world.get<nn::Layer>(e).block);
                     }
                     KILN_CHECK(std::is_sorted(indices.begin(), indices.end()), "offloaded layers out of order");
                     s.runner->setup(regions);
                     if (world.resource<RankInfo>().rank != 0) return;
                     std::ostringstream os;
                     os << std::fixed << std::setprecision(1) << "activation offload: blocks ";
                     for (std::size_t i = 0; i < indices.size(); ++i) os << (i ? ", " : "") << indices[i];
                     os << " keep their saved activations in host memory (" << regions.front().bytes() / 1048576.0
                        << " MiB a block, " << s.runner->host_bytes() / 1073741824.0 << " GiB of host memory a rank, "
                        << s.runner->slots() << " device slots)";
                     if (taken > 0) os << "; " << taken << " of them taken out of activation checkpointing";
                     std::cout << os.str() << "\n";
                   },
                   {"model.init"}});
  auto& bus = w.events();
  OffloadRunner* run = st.runner.get();
  st.subscriptions.push_back(bus.subscribe<nn::LayerForwardBegin>([run](const auto& e) { run->forward_begin(e.unit, e.training); }));
  st.subscriptions.push_back(bus.subscribe<nn::LayerForwardEnd>([run](const auto& e) { run->forward_end(e.unit, e.training); }));
  st.subscriptions.push_back(bus.subscribe<nn::LayerBackwardBegin>([run](const auto& e) { run->backward_begin(e.unit); }));
  st.subscriptions.push_back(bus.subscribe<nn::LayerBackwardEnd>([run](const auto& e) { run->backward_end(e.unit); }));
  st.subscriptions.push_back(bus.subscribe<nn::PassesGraphBegin>([run](const auto&) { run->graph_begin(); }));
  st.subscriptions.push_back(bus.subscribe<nn::PassesCaptureEnd>([run](const auto&) { run->capture_end(); }));
  st.subscriptions.push_back(bus.subscribe<nn::PassesReplayed>([run](const auto&) { run->replayed(); }));
}

}  // namespace

void register_offload_module(ModuleRegistry& registry) {
  registry.add(make_module<ActivationOffloadConfig>(
      "activation_offload", "keep some blocks' saved activations in host memory (copied beside the compute)",
      {"model", "parallel", "activation_checkpoint"}, install_offload));
}

}  // namespace kiln::recompute
