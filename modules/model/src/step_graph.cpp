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
  // A replay runs no system of these phases: another module's would silently not run.
  for (const auto& [phase, ours] : {std::pair{Phase::forward, "model.forward"}, std::pair{Phase::backward, "model.backward"}})
    for (const std::string& name : w.systems().order(phase))
      if (name != ours) return cat("system '", name, "' runs in the ", phase_name(phase), " phase (a replay would skip it)");
  return "";
}

void StepGraph::install(World& w) {
  const std::string why = refusal(w);
  if (w.resource<RankInfo>().rank == 0)
    std::cout << "backend.cuda_graph: "
              << (why.empty() ? cat("each micro-batch's forward and backward captured at step ", kEagerSteps + 1,
                                    " and replayed after it; the optimizer runs eagerly")
                              : cat("every step eager: ", why))
              << "\n";
  if (!why.empty()) return;
  auto& graph = w.emplace_resource<StepGraph>();
  w.emplace_resource<PhaseHook>(PhaseHook{[&graph](World& world, Phase p) { return graph.before(world, p); },
                                          [&graph](World& world, Phase p) { graph.after(world, p); }});
}

int StepGraph::graphs() const {
  int n = 0;
  for (const auto& c : by_micro_batch_) n += c.work ? 1 : 0;
  return n;
}

bool StepGraph::before(World& w, Phase p) {
  if (p == Phase::step_begin) ++steps_;
  if (p == Phase::backward) return replayed_;
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
  w.events().publish(nn::PassesGraphBegin{ctl.micro_batch});
  be.begin_capture();
  capturing_ = ctl.micro_batch;
  return false;  // the systems run, their device work recorded
}

void StepGraph::after(World& w, Phase p) {
  if (p != Phase::backward || capturing_ < 0) return;
  const int micro_batch = capturing_;
  Captured& c = by_micro_batch_[static_cast<std::size_t>(micro_batch)];
  w.events().publish(nn::PassesCaptureEnd{micro_batch});
  capturing_ = -1;
  c.work = w.resource<ops::ActiveBackend>().get().end_capture();
  c.rng = w.resource<rng::RngStatesTracker>().end_graph_capture();
  launch(w, c, micro_batch);  // the captured step itself runs now
}

void StepGraph::replay(World& w, Captured& c, int micro_batch) {
  w.events().publish(nn::PassesGraphBegin{micro_batch});
  launch(w, c, micro_batch);
}

void StepGraph::launch(World& w, Captured& c, int micro_batch) {
  ops::Backend& be = w.resource<ops::ActiveBackend>().get();
  std::vector<std::uint64_t> bases = w.resource<rng::RngStatesTracker>().next_replay(c.rng);
  const auto bytes = static_cast<std::int64_t>(bases.size() * sizeof(std::uint64_t));
  be.copy(TensorView(c.bases.data(), {bytes}, DType::u8, Device::cuda),
          TensorView(bases.data(), {bytes}, DType::u8, Device::cpu));
  c.work->launch();
  w.events().publish(nn::PassesReplayed{micro_batch});
}

}  // namespace kiln::model
