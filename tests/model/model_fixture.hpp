#pragma once
// Builds a World from pipeline text and --set overrides with kiln's modules, as the runner does.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kiln/builtin.hpp"
#include "kiln/data/tokenizer.hpp"
#include "kiln/engine/config/pipeline.hpp"
#include "kiln/engine/runner.hpp"
#include "kiln/model/gpt.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/train/train.hpp"
#include "host_floats.hpp"
#include "kiln_test.hpp"

namespace kiln::test {

// The small model the CUDA-vs-CPU training tests run (2 blocks, width 128, T = 96).
inline constexpr const char* kSmallGpuModel = R"(
[train]
steps = 6
seed = 11
batch_size = 4
seq_len = 96
[model]
n_layer = 2
n_head = 4
n_embd = 128
vocab_size = 300
max_seq_len = 96
[optim]
lr = 1e-3
[data]
synthetic_vocab = 300
)";

struct Pipeline {
  ModuleRegistry registry;
  config::PipelineConfig config;
  std::unique_ptr<World> world;

  explicit Pipeline(const std::string& toml, const std::vector<std::string>& sets = {},
                    void (*extra)(ModuleRegistry&) = nullptr) {
    register_builtin_modules(registry);
    if (extra) extra(registry);
    auto doc = config::parse_toml_text(toml, "test.toml");
    config::apply_overrides(doc, sets);
    config = config::resolve(doc, "test.toml", registry);
    world = std::make_unique<World>();
    world->emplace_resource<RankInfo>(RankInfo{0, 1, 0, "test.toml"});
    install_pipeline(*world, config, registry);
  }
  void run() { run_pipeline(*world); }
};

// A small, learnable byte-level corpus ("the cat sat on the mat." ...) tokenized into `dir`;
// returns the glob of its training shards.
inline std::string pattern_corpus(const TempDir& dir) {
  std::string text;
  const char* words[] = {"the cat", "a dog", "the bird", "my fish"};
  const char* verbs[] = {" sat on", " ran to", " looked at", " jumped over"};
  const char* things[] = {" the mat.\n", " a tree.\n", " the house.\n", " my hat.\n"};
  for (int i = 0; i < 4000; ++i) text += std::string(words[i % 4]) + verbs[(i / 4) % 4] + things[(i / 16) % 4];
  auto src = dir.file("corpus.txt", text);
  data::tokenize_files({src}, (dir.path() / "shards").string(), {.val_fraction = 0.1});
  return (dir.path() / "shards/train_*.bin").string();
}

// Runs the pipeline, returning each step's training loss.
inline std::vector<double> step_losses(Pipeline& p) {
  std::vector<double> losses;
  p.world->systems().add({"test.record", Phase::step_end,
                          [&losses](World& world) { losses.push_back(world.resource<train::TrainState>().loss); },
                          {"train.step_end"}});
  p.run();
  return losses;
}

// Trains a 2-layer byte-level GPT on `shards` on the CPU for `steps` steps; returns each step's loss.
inline std::vector<double> train_losses(const std::string& shards, int steps, std::vector<std::string> sets = {}) {
  sets.insert(sets.begin(), {"data.train_files=" + shards, "train.steps=" + std::to_string(steps)});
  Pipeline p(R"(
[engine]
device = "cpu"
[train]
batch_size = 8
seq_len = 32
[model]
n_layer = 2
n_head = 2
n_embd = 32
vocab_size = 256
max_seq_len = 32
[optim]
lr = 3e-3
warmup_steps = 10
[log]
every = 1000
)",
             sets);
  return step_losses(p);
}

// The flat gradient buffer copied to the host as floats (from whichever backend the World runs on;
// bf16 gradients widened).
inline std::vector<float> grads_of(World& w) {
  return host_floats(w.resource<ops::ActiveBackend>().get(), w.resource<nn::ParamStore>().grads_flat());
}

// What a run recorded: each step's loss, and the gradients of its first step (before they are
// synchronised or used).
struct RunRecord {
  std::vector<double> losses;
  std::vector<float> step1_grads;
};
inline RunRecord run_recording(Pipeline& p) {
  RunRecord r;
  auto& w = *p.world;
  // Reads only in step 1 (eager): nothing for a captured step (backend.cuda_graph, from step 3) to
  // miss, so the graph may hold the gradient sync and optimizer.
  w.systems().add({.name = "test.grads",
                   .phase = Phase::grad_sync,
                   .run = [&r](World& world) {
                     if (world.resource<RunControl>().step == 1) r.step1_grads = grads_of(world);
                   },
                   .after = {"parallel.dp_grad_sync", "parallel.tp_grad_sync"},
                   .replayable = true});
  w.systems().add({"test.loss", Phase::step_end,
                   [&r](World& world) { r.losses.push_back(world.resource<train::TrainState>().loss); },
                   {"train.step_end"}});
  p.run();
  return r;
}

// Runs one step's phases up to and including the backward pass (no optimizer).
inline void forward_backward_step(World& w) {
  auto& ctl = w.resource<RunControl>();
  ++ctl.step;
  w.systems().run(Phase::step_begin, w);
  for (ctl.micro_batch = 0; ctl.micro_batch < ctl.micro_batches; ++ctl.micro_batch) {
    w.systems().run(Phase::data, w);
    w.systems().run(Phase::forward, w);
    w.systems().run(Phase::backward, w);
  }
}

// Every parameter's gradient (a sixth of its elements) of the pipeline's model against central
// differences (Richardson-extrapolated) of the loss in the f32 master weights (the CPU backend computes in f32), with the
// same dropout masks each time: each error relative to the parameter's largest gradient < 2e-2.
// `extra_loss` adds what else the model's gradient includes (a mixture of experts' router losses),
// read after each forward.
inline void check_finite_differences(const std::string& toml, const std::vector<std::string>& sets,
                                     const std::function<double(World&)>& extra_loss = {}) {
  Pipeline p(toml, sets);
  World& w = *p.world;
  w.systems().run(Phase::setup, w);
  auto& ctl = w.resource<RunControl>();
  ctl.step = 1;
  w.systems().run(Phase::data, w);
  auto& batch = w.resource<train::Batch>();
  auto& model = w.resource<model::GptModel>();
  auto& store = w.resource<nn::ParamStore>();
  auto& be = w.resource<ops::ActiveBackend>().get();
  auto& tracker = w.resource<rng::RngStatesTracker>();
  const auto snapshot = tracker.get_states();

  be.zero(store.grads_flat());
  model.forward(batch, 0, true, &tracker);
  model.backward(batch);
  const auto grads = grads_of(w);
  if (extra_loss) extra_loss(w);  // what the gradient's forward left to read

  float* master = store.master_flat().as<float>();
  auto loss = [&] {
    tracker.set_states(snapshot);  // the same dropout masks every time
    be.convert(store.compute_flat(), store.master_flat());
    model.forward(batch, 0, true, &tracker);
    if (model.losses_after_backward()) model.backward(batch);  // the gradients, already read, are not used
    return model.mean_loss(1) + (extra_loss ? extra_loss(w) : 0.0);
  };
  for (Entity e : store.order()) {
    const auto& prm = w.get<nn::Param>(e);
    double gmax = 1e-7;
    for (std::int64_t i = 0; i < prm.numel; ++i) gmax = std::max(gmax, std::fabs(double(grads[prm.offset + i])));
    double worst = 0;
    const std::int64_t step = std::max<std::int64_t>(1, prm.numel / 6);
    for (std::int64_t i = 0; i < prm.numel; i += step) {
      float& x = master[prm.offset + i];
      const float saved = x;
      auto central = [&](float h) {
        x = saved + h;
        const double lp = loss();
        x = saved - h;
        const double lm = loss();
        x = saved;
        return (lp - lm) / (2.0 * h);
      };
      // The loss is an f32 sum, so a small h drowns the difference in rounding; Richardson
      // extrapolation of central differences at h = 4e-2 and 2e-2 cancels their h^2 error instead
      // (SwiGLU makes the loss cubic in a norm's weight: a plain difference at 1e-2 missed by 3%).
      const double fd = (4.0 * central(2e-2f) - central(4e-2f)) / 3.0;
      worst = std::max(worst, std::fabs(fd - grads[prm.offset + i]) / gmax);
    }
    std::string what;
    for (const auto& s : sets) what += s + " ";
    INFO(what << "parameter " << prm.name << ": worst error / max|grad| = " << worst);
    CHECK(worst < 2e-2);
  }
}

}  // namespace kiln::test
