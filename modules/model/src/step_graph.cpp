#include "kiln/model/step_graph.hpp"

#include <iostream>

#include "kiln/core/error.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/model/config.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/train/train.hpp"

namespace kiln::model {

std::string StepGraph::refusal(World& w) {
  ops::Backend& be = w.resource<ops::ActiveBackend>().get();
  if (be.device() != Device::cuda) return "the CPU backend runs every op as it comes";
  if (!be.can_capture()) return "backend.profile times every op with events";
  if (w.resource<RankInfo>().world_size > 1) {
    const auto* launch = w.try_resource<parallel::LaunchContext>();
    if (!launch || !launch->nccl)
      return "ranks that are threads of one process exchange through host memory, which a graph cannot hold";
    if (w.resource<parallel::ParallelState>().pp_size() > 1)
      return "pipeline stages send and receive on a schedule the host runs";
  }
  if (w.resource<ModelConfig>().moe.enabled()) return "a mixture of experts' group sizes reach the host every step";
  if (w.resource<train::TrainState>().loss_mask)
    return "the data's loss masks change the loss's divisor every step (a kernel argument)";
  // A replay runs no system of these phases: one that cannot be replayed would silently not run.
  for (Phase phase : {Phase::forward, Phase::backward})
    if (const auto name = w.systems().not_replayable(phase))
      return cat("system '", *name, "' runs in the ", phase_name(phase), " phase and cannot be replayed");
  return "";
}

std::string StepGraph::optimizer_refusal(World& w) {
  for (Phase phase : {Phase::grad_sync, Phase::optimizer})
    if (const auto name = w.systems().not_replayable(phase))
      return cat("system '", *name, "' (", phase_name(phase), " phase) cannot be replayed");
  return "";
}

void StepGraph::install(World& w) {
  const std::string why = refusal(w);
  const std::string eager_optimizer = why.empty() ? optimizer_refusal(w) : "";
  if (w.resource<RankInfo>().rank == 0)
    std::cout << "backend.cuda_graph: "
              << (!why.empty() ? cat("every step eager: ", why)
                  : eager_optimizer.empty()
                      ? cat("each micro-batch's forward and backward captured at step ", kEagerSteps + 1,
                            ", the last with the gradient sync and optimizer, and replayed after it")
                      : cat("each micro-batch's forward and backward captured at step ", kEagerSteps + 1,
                            " and replayed after it; the gradient sync and optimizer run eagerly: ", eager_optimizer))
              << "\n";
  if (!why.empty()) return;
  auto& graph = w.emplace_resource<StepGraph>();
  graph.through_optimizer_ = eager_optimizer.empty();
  w.emplace_resource<PhaseHook>(PhaseHook{[&graph](World& world, Phase p) { return graph.before(world, p); },
                                          [&graph](World& world, Phase p) { graph.after(world, p); }});
}

int StepGraph::graphs() const {
  int n = 0;
  for (const auto& c : by_micro_batch_) n += c.work ? 1 : 0;
  return n;
}

bool StepGraph::holds_optimizer(World& w, int micro_batch) const {
  return through_optimizer_ && micro_batch == w.resource<RunControl>().micro_batches - 1;
}

bool StepGraph::before(World& w, Phase p) {
  if (p == Phase::step_begin) ++steps_;
  if (p == Phase::backward) return replayed_;
  // After the last micro-batch's backward: replayed with it where its graph holds them.
  if (p == Phase::grad_sync || p == Phase::optimizer) return replayed_ && through_optimizer_;
  if (p != Phase::forward) return false;
  replayed_ = false;
  if (steps_ <= kEagerSteps) return false;
  const auto& ctl = w.resource<RunControl>();
  by_micro_batch_.resize(static_cast<std::size_t>(ctl.micro_batches));
  Captured& c = by_micro_batch_[static_cast<std::size_t>(ctl.micro_batch)];
  if (c.work) {
    replay(w, c, ctl.micro_batch);
    replayed_ = true;
    return true;
  }
  ops::Backend& be = w.resource<ops::ActiveBackend>().get();
  auto& tracker = w.resource<rng::RngStatesTracker>();
  c.bases = be.alloc(static_cast<std::size_t>(tracker.num_states()) * sizeof(std::uint64_t));
  tracker.begin_graph_capture(static_cast<std::uint64_t*>(c.bases.data()));
  w.events().publish(nn::PassesGraphBegin{ctl.micro_batch, holds_optimizer(w, ctl.micro_batch)});
  be.begin_capture();
  capturing_ = ctl.micro_batch;
  return false;  // the systems run, their device work recorded
}

void StepGraph::after(World& w, Phase p) {
  if (capturing_ < 0) return;
  if (p == (holds_optimizer(w, capturing_) ? Phase::optimizer : Phase::backward)) end_capture(w);
}

void StepGraph::end_capture(World& w) {
  const int micro_batch = capturing_;
  Captured& c = by_micro_batch_[static_cast<std::size_t>(micro_batch)];
  w.events().publish(nn::PassesCaptureEnd{micro_batch, holds_optimizer(w, micro_batch)});
  capturing_ = -1;
  c.work = w.resource<ops::ActiveBackend>().get().end_capture();
  c.rng = w.resource<rng::RngStatesTracker>().end_graph_capture();
  launch(w, c, micro_batch, true);  // the captured step itself runs now
}

void StepGraph::replay(World& w, Captured& c, int micro_batch) {
  w.events().publish(nn::PassesGraphBegin{micro_batch, holds_optimizer(w, micro_batch)});
  launch(w, c, micro_batch, false);
}

void StepGraph::launch(World& w, Captured& c, int micro_batch, bool captured_now) {
  ops::Backend& be = w.resource<ops::ActiveBackend>().get();
  std::vector<std::uint64_t> bases = w.resource<rng::RngStatesTracker>().next_replay(c.rng);
  const auto bytes = static_cast<std::int64_t>(bases.size() * sizeof(std::uint64_t));
  be.copy(TensorView(c.bases.data(), {bytes}, DType::u8, Device::cuda),
          TensorView(bases.data(), {bytes}, DType::u8, Device::cpu));
  c.work->launch();
  w.events().publish(nn::PassesReplayed{micro_batch, holds_optimizer(w, micro_batch), captured_now});
}

}  // namespace kiln::model
