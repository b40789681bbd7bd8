// Activation checkpointing on CUDA: with dropout, every mode gives losses and gradients
// bit-identical to the run without recompute, in bf16 and in FP8 (delayed and current scaling).
// Skipped without a GPU.
#include <doctest/doctest.h>

#include "../model/model_fixture.hpp"
#include "../model/parallel_fixture.hpp"
#include "kiln/recompute/module.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/ops/module.hpp"
#include "kiln_test.hpp"

using namespace kiln;

namespace {

const char* kModel = R"(
[engine]
device = "cuda"
[train]
steps = 3
seed = 17
batch_size = 4
seq_len = 96
micro_batch_size = 2
[model]
n_layer = 3
n_head = 2
n_embd = 128
vocab_size = 300
max_seq_len = 96
dropout = 0.1
[optim]
lr = 1e-3
[data]
synthetic_vocab = 300
)";

test::Trace trace(const std::vector<std::string>& sets) {
  test::Pipeline p(kModel, sets);
  test::Trace t;
  p.world->systems().add({"test.grads", Phase::grad_sync, [&t](World& world) {
                            t.grads.push_back({{"all", test::grads_of(world)}});
                          }});
  p.world->systems().add({"test.loss", Phase::step_end,
                          [&t](World& world) { t.loss.push_back(world.resource<train::TrainState>().loss); },
                          {"model.loss"}});
  p.run();
  return t;
}

}  // namespace

TEST_CASE("CUDA: full and selective recompute give bit-identical gradients with dropout, bf16 and FP8") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  const std::vector<std::vector<std::string>> modes = {
      {"activation_checkpoint.mode=full"},
      {"activation_checkpoint.mode=selective", "activation_checkpoint.selective=attention"},
      {"activation_checkpoint.mode=selective", "activation_checkpoint.selective=mlp"},
  };
  for (const std::vector<std::string>& base : std::vector<std::vector<std::string>>{
           {}, {"model.recompute_gelu=false"}, {"fp8.enabled=true", "fp8.recipe=delayed"},
           {"fp8.enabled=true", "fp8.recipe=current"}}) {
    const auto ref = trace(base);
    for (const auto& mode : modes) {
      auto sets = base;
      sets.insert(sets.end(), mode.begin(), mode.end());
      std::string what;
      for (auto& s : sets) what += s + " ";
      test::compare_traces(trace(sets), ref, what, 0);
    }
  }
}
