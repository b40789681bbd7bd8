// Activation checkpointing on CUDA: with dropout, every mode gives losses and gradients
// bit-identical to the run without recompute, in bf16 and in FP8 (delayed and current scaling); so do
// activations offloaded to host memory (activation_offload), eager and captured (backend.cuda_graph).
// Skipped without a GPU.
#include <doctest/doctest.h>

#include "../model/model_fixture.hpp"
#include "../model/parallel_fixture.hpp"
#include "kiln/recompute/module.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/ops/module.hpp"
#include "kiln_test.hpp"

using namespace kiln;
using test::operator+;

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

// Each of `modes` after `base` against `base` alone: bit-identical losses and gradients.
void compare_modes(const test::Sets& base, const std::vector<test::Sets>& modes) {
  const auto ref = trace(base);
  for (const auto& mode : modes) {
    const test::Sets sets = base + mode;
    std::string what;
    for (auto& s : sets) what += s + " ";
    test::compare_traces(trace(sets), ref, what, 0);
  }
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
           {"fp8.enabled=true", "fp8.recipe=current"}})
    compare_modes(base, modes);
}

TEST_CASE("CUDA: offloaded activations give bit-identical gradients, bf16 and FP8, GPT-2 and Llama blocks") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  // Blocks large enough that a block's copy over PCIe takes longer than its forward pass: a copy
  // the compute did not wait for would show as other gradients.
  const std::vector<std::string> size = {"model.n_embd=512", "model.n_head=8", "train.seq_len=256",
                                         "model.max_seq_len=256", "model.n_layer=4"};
  const std::vector<std::vector<std::string>> modes = {
      {"activation_offload.blocks=4", "activation_offload.every=1", "activation_offload.slots=1"},
      {"activation_offload.blocks=2", "activation_offload.every=2", "activation_offload.slots=2",
       "activation_checkpoint.mode=full"},
  };
  for (const std::vector<std::string>& base : std::vector<std::vector<std::string>>{
           {}, {"fp8.enabled=true", "fp8.recipe=delayed"}, {"model.arch=llama", "model.n_kv_head=2"}})
    compare_modes(size + base, modes);
}

TEST_CASE("CUDA: offloaded activations under backend.cuda_graph: captured and replayed steps give the eager "
          "steps' gradients bit for bit") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  // Steps 1-2 eager, 3 captured, 4-6 replayed (each micro-batch's passes one graph); the reference
  // keeps every block's activations and runs eagerly.
  const std::vector<std::string> size = {"model.n_embd=512", "model.n_head=8", "train.seq_len=256",
                                         "model.max_seq_len=256", "model.n_layer=4", "train.steps=6"};
  for (const std::vector<std::string>& base : std::vector<std::vector<std::string>>{
           {}, {"fp8.enabled=true", "fp8.recipe=delayed"}}) {
    const auto ref = trace(size + base);
    for (const std::vector<std::string>& mode : std::vector<std::vector<std::string>>{
             {"backend.cuda_graph=true"},
             {"backend.cuda_graph=true", "activation_offload.blocks=4", "activation_offload.every=1",
              "activation_offload.slots=1"},
             {"backend.cuda_graph=true", "activation_offload.blocks=2", "activation_offload.every=2",
              "activation_offload.slots=2", "activation_checkpoint.mode=full"}}) {
      const test::Sets sets = size + base + mode;
      std::string what;
      for (auto& s : sets) what += s + " ";
      test::compare_traces(trace(sets), ref, what, 0);
    }
  }
}
