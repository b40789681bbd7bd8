#include "kiln/model/module.hpp"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <iostream>

#include "kiln/engine/engine_module.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/rng/module.hpp"
#include "kiln/train/train.hpp"

namespace kiln::model {

namespace {

// Subscriptions live as long as the World.
struct ModelHooks {
  Subscription evaluate;
};

// [begin, end) element ranges of the flat gradient buffer that the step's zeroing covers: all but the
// parameters marked nn::GradWrittenFirst, adjacent ranges merged.
std::vector<std::pair<std::int64_t, std::int64_t>> zero_ranges(World& w, const ParamStore& store) {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  std::int64_t at = 0;
  auto add = [&](std::int64_t begin, std::int64_t end) {
    if (end <= begin) return;
    if (!out.empty() && out.back().second == begin)
      out.back().second = end;
    else
      out.emplace_back(begin, end);
  };
  for (Entity e : store.order) {
    const auto& p = w.get<nn::Param>(e);
    if (!w.has<nn::GradWrittenFirst>(e)) continue;
    add(at, p.offset);
    at = p.offset + p.numel;
  }
  add(at, store.total);
  return out;
}

void install(World& w, const ModelConfig& cfg) {
  const auto& par = w.resource<parallel::ParallelState>();
  const auto& tc = w.resource<train::TrainConfig>();
  auto& ts = w.resource<train::TrainState>();
  if (tc.seq_len > cfg.max_seq_len)
    throw config_error(w, "train.seq_len", cat(tc.seq_len, " exceeds model.max_seq_len = ", cfg.max_seq_len));
  // What the model splits over the tensor-parallel group, before any rank allocates anything.
  const int tp = par.tp_size();
  for (const auto& problem : parallel::check_splits(
           tp, GptModel::tensor_parallel_splits(cfg, ts.micro_batch_size * tc.seq_len, par.sequence_parallel && tp > 1,
                                                par.vocab_parallel && tp > 1)))
    throw config_error(w, problem.key, problem.message);
  auto& model = w.emplace_resource<GptModel>(w, cfg, ts.micro_batch_size, static_cast<int>(tc.seq_len),
                                             ts.micro_batches);
  model.set_loss_scale(1.0f / static_cast<float>(tc.batch_size * tc.seq_len));
  ts.flops_per_token = model.flops_per_token();
  ts.peak_flops = w.resource<ops::ActiveBackend>().get().peak_bf16_flops();

  auto& hooks = w.emplace_resource<ModelHooks>();
  hooks.evaluate = w.events().subscribe<train::EvaluationRequested>([&w](const train::EvaluationRequested&) {
    auto& val = w.resource<train::ValidationSet>();
    if (val.batches.empty())
      KILN_THROW("a validation loss was requested (log.val_every) but there is no validation data (data.val_files)");
    w.resource<train::TrainState>().val_loss = w.resource<GptModel>().evaluate(val.batches);
  });

  w.systems().add({"model.init", Phase::setup, [](World& world) {
                     auto& m = world.resource<GptModel>();
                     m.allocate_activations();  // after every module attached its components
                     world.emplace_resource<nn::BlockScratch>(m.block_scratch());
                     m.initialise(world.resource<rng::RngStatesTracker>());
                     if (world.resource<RankInfo>().rank == 0)
                       std::cout << "model: " << m.parameter_count() << " parameters on "
                                 << world.resource<ops::ActiveBackend>().get().name() << ", activation memory "
                                 << std::fixed << std::setprecision(3)
                                 << static_cast<double>(m.activation_bytes()) / (1 << 30) << " GiB\n"
                                 << std::defaultfloat;
                   }});
  // Every gradient but those their first micro-batch writes (the model marked them
  // nn::GradWrittenFirst as it made its parameters, above): the gaps between them.
  w.systems().add({"model.zero_grad", Phase::step_begin,
                   [ranges = zero_ranges(w, w.resource<ParamStore>())](World& world) {
                     auto& store = world.resource<ParamStore>();
                     auto& be = world.resource<ops::ActiveBackend>().get();
                     const TensorView flat = store.grads_flat();
                     for (auto [begin, end] : ranges)
                       be.zero(TensorView(flat.as<float>() + begin, {end - begin}, DType::f32, flat.device));
                   }});
  w.systems().add({"model.forward", Phase::forward, [](World& world) {
                     world.resource<GptModel>().forward(world.resource<train::Batch>(),
                                                        world.resource<RunControl>().micro_batch, true,
                                                        &world.resource<rng::RngStatesTracker>());
                   }});
  w.systems().add({"model.backward", Phase::backward, [](World& world) {
                     world.resource<GptModel>().backward(world.resource<train::Batch>());
                   }});
  // The loss is read (and checked) right after the backward pass, before the optimizer touches
  // the weights, so a non-finite loss is reported as such rather than as non-finite gradients.
  w.systems().add({"model.loss", Phase::grad_sync, [](World& world) {
                     auto& ts = world.resource<train::TrainState>();
                     ts.loss = world.resource<GptModel>().mean_loss(ts.micro_batches);
                     if (!std::isfinite(ts.loss))
                       KILN_THROW("step ", world.resource<RunControl>().step, ": the loss is ", ts.loss,
                                  " (non-finite); stopping");
                   }});
  // The step's device work (the optimizer) finishes before the step timer stops.
  w.systems().add({"model.sync", Phase::step_end,
                   [](World& world) {
                     auto& be = world.resource<ops::ActiveBackend>().get();
                     be.synchronize();
                     auto& ts = world.resource<train::TrainState>();
                     ts.peak_device_memory = std::max(ts.peak_device_memory, be.device_memory_in_use());
                   },
                   {},
                   {"train.step_end"}});
}

}  // namespace

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<ModelConfig>("model", "the GPT-2 transformer: entities, flat parameters, forward/backward",
                                        {"backend", "train", "rng", "parallel"}, install));
}

}  // namespace kiln::model
