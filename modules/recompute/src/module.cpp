#include "kiln/recompute/module.hpp"

#include <algorithm>
#include <iostream>

#include "kiln/engine/engine_module.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/rng/tracker.hpp"
#include "kiln/train/train.hpp"

namespace kiln::recompute {

namespace {

nn::RecomputeScope scope_of(const ActivationCheckpointConfig& cfg) {
  if (cfg.mode == CheckpointMode::full) return nn::RecomputeScope::full;
  return cfg.selective == SelectiveScope::attention ? nn::RecomputeScope::attention : nn::RecomputeScope::mlp;
}

const char* name_of(nn::RecomputeScope s) {
  switch (s) {
    case nn::RecomputeScope::none: return "none";
    case nn::RecomputeScope::attention: return "attention";
    case nn::RecomputeScope::mlp: return "mlp";
    case nn::RecomputeScope::full: return "full";
  }
  return "?";
}

void install(World& w, const ActivationCheckpointConfig& cfg) {
  if (cfg.mode == CheckpointMode::none) return;
  const auto& par = w.resource<parallel::ParallelState>();
  if (cfg.distribute_saved_activations && par.sequence_parallel)
    throw config_error(w, "activation_checkpoint.distribute_saved_activations",
                       "true with parallel.sequence_parallel = true: the saved inputs are already split over the TP "
                       "group by sequence parallelism; set one of them to false");
  const nn::RecomputeScope scope = scope_of(cfg);
  const bool distribute = cfg.distribute_saved_activations && par.tp_size() > 1;
  if (distribute) {  // each TP rank keeps 1/tp of a saved input's token rows
    const auto& ts = w.resource<train::TrainState>();
    const std::int64_t tokens = ts.micro_batch_size * w.resource<train::TrainConfig>().seq_len;
    for (const auto& problem : parallel::check_splits(
             par.tp_size(), {{tokens, "activation_checkpoint.distribute_saved_activations",
                              "tokens of a micro-batch (train.micro_batch_size x train.seq_len)"}}))
      throw config_error(w, problem.key, problem.message);
  }

  auto& st = w.emplace_resource<ActivationCheckpointState>();
  int blocks = 0;
  for (Entity e : w.view<nn::Layer>()) {
    const auto& layer = w.get<nn::Layer>(e);
    if (layer.kind != nn::LayerKind::block) continue;
    ++blocks;
    if (!cfg.covers(layer.block)) continue;
    w.emplace<nn::ActivationRecompute>(e, nn::ActivationRecompute{scope, distribute});
    st.units.push_back(layer.unit);
  }
  if (blocks == 0)
    throw config_error(w, "activation_checkpoint.mode", "is on but the model has no transformer blocks");
  std::sort(st.units.begin(), st.units.end());

  // The RNG replay: capture when a chosen block's forward begins, replay around its recompute.
  st.rng = std::make_unique<RngReplay>(w.resource<rng::RngStatesTracker>());
  auto is_chosen = [&st](int unit) { return std::binary_search(st.units.begin(), st.units.end(), unit); };
  auto& bus = w.events();
  st.subscriptions.push_back(bus.subscribe<nn::LayerForwardBegin>([&st, is_chosen](const nn::LayerForwardBegin& e) {
    if (is_chosen(e.unit)) st.rng->capture(e.unit);
  }));
  st.subscriptions.push_back(bus.subscribe<nn::LayerRecomputeBegin>([&st](const nn::LayerRecomputeBegin& e) {
    st.rng->begin(e.unit);
    ++st.recomputes;
  }));
  st.subscriptions.push_back(
      bus.subscribe<nn::LayerRecomputeEnd>([&st](const nn::LayerRecomputeEnd& e) { st.rng->end(e.unit); }));

  w.systems().add({"activation_checkpoint.report", Phase::setup, [blocks, scope, distribute](World& world) {
                     if (world.resource<RankInfo>().rank != 0) return;
                     // Read now: the activation_offload module may have taken blocks out.
                     const auto chosen = world.resource<ActivationCheckpointState>().units.size();
                     std::cout << "activation checkpoint: " << name_of(scope) << " recompute in " << chosen << " of "
                               << blocks << " blocks" << (distribute ? ", saved inputs split over the TP group" : "")
                               << "\n";
                   }});
}

}  // namespace

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<ActivationCheckpointConfig>(
      "activation_checkpoint", "recompute activations in the backward pass (full or selective, per block)",
      {"model", "rng", "parallel"}, install));
}

}  // namespace kiln::recompute
