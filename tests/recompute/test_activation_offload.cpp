// The activation_offload module on the CPU backend: which blocks offload and into which slots, taken
// out of activation checkpointing; losses and gradients bit-identical to the run that keeps every
// activation on the device (the slots are shared, so a block whose rows did not come back would read
// another block's), dense and mixture-of-experts blocks; the copies each step makes; the device memory it saves; bad settings refused.
#include <doctest/doctest.h>

#include <algorithm>

#include "../model/model_fixture.hpp"
#include "../model/parallel_fixture.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/model/gpt.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/recompute/module.hpp"
#include "kiln/recompute/offload.hpp"
#include "kiln/recompute/offload_runner.hpp"
#include "kiln_test.hpp"

using namespace kiln;
using test::operator+;

namespace {

const char* kModel = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 2
[train]
steps = 3
seed = 5
batch_size = 4
seq_len = 16
[model]
n_layer = 4
n_head = 2
n_embd = 32
vocab_size = 64
max_seq_len = 16
dropout = 0.1
[optim]
lr = 1e-3
[data]
synthetic_vocab = 64
[parallel]
timeout_s = 60
)";

// (unit, slot) of every offloaded layer, and the units activation checkpointing recomputes.
std::pair<std::vector<std::pair<int, int>>, std::vector<int>> placement(const test::Sets& sets) {
  test::Pipeline p(kModel, sets);
  World& w = *p.world;
  std::vector<std::pair<int, int>> offloaded;
  std::vector<int> recomputed;
  for (Entity e : w.view<nn::Layer>()) {
    const int unit = w.get<nn::Layer>(e).unit;
    if (const auto* o = w.try_get<nn::ActivationOffload>(e)) offloaded.emplace_back(unit, o->slot);
    if (w.has<nn::ActivationRecompute>(e)) recomputed.push_back(unit);
  }
  if (const auto* st = w.try_resource<recompute::ActivationCheckpointState>()) CHECK(st->units == recomputed);
  return {offloaded, recomputed};
}

}  // namespace

TEST_CASE("activation_offload picks blocks 0, every, ... into slots in turn, out of activation checkpointing") {
  using Placed = std::vector<std::pair<int, int>>;
  CHECK(placement({}).first.empty());
  CHECK(placement({"activation_offload.blocks=0"}).first.empty());
  CHECK(placement({"activation_offload.blocks=2"}).first == Placed{{1, 0}, {3, 1}});
  CHECK(placement({"activation_offload.blocks=3", "activation_offload.every=1", "activation_offload.slots=2"}).first ==
        Placed{{1, 0}, {2, 1}, {3, 0}});
  const auto both = placement({"activation_offload.blocks=2", "activation_checkpoint.mode=full"});
  CHECK(both.first == Placed{{1, 0}, {3, 1}});
  CHECK(both.second == std::vector<int>{2, 4});  // blocks 1 and 3 (units 2 and 4) still recompute
}

TEST_CASE("bad activation_offload settings are config errors naming the key") {
  CHECK_THROWS_WITH_AS(test::Pipeline(kModel, {"activation_offload.every=0"}),
                       doctest::Contains("activation_offload.every"), ConfigError);
  CHECK_THROWS_WITH_AS(test::Pipeline(kModel, {"activation_offload.slots=0"}),
                       doctest::Contains("activation_offload.slots"), ConfigError);
  // Three blocks every two need block 4 of a four-block model.
  CHECK_THROWS_WITH_AS(test::Pipeline(kModel, {"activation_offload.blocks=3"}),
                       doctest::Contains("activation_offload.blocks: 3 blocks every 2 need block 4, but the model has 4"),
                       ConfigError);
  // Captured steps take it (test_gpu_recompute runs it on a GPU; the CPU backend's steps stay eager).
  CHECK_NOTHROW(test::Pipeline(kModel, {"activation_offload.blocks=1", "backend.cuda_graph=true"}));
  // Pipeline stages (two thread ranks).
  ModuleRegistry reg;
  register_builtin_modules(reg);
  auto doc = config::parse_toml_text(kModel, "t.toml");
  config::apply_overrides(doc, {"parallel.pp=2", "activation_offload.blocks=1"});
  for (auto& o : parallel::run_thread_ranks(2, config::resolve(doc, "t.toml", reg), reg)) {
    CHECK_FALSE(o.ok);
    CHECK(o.config_error);
    CHECK(o.error.find("activation_offload.blocks: 1 with parallel.pp = 2") != std::string::npos);
  }
}

TEST_CASE("offloaded activations give bit-identical losses and gradients, with dropout (CPU)") {
  // Every block offloaded through one slot: each backward reads rows that came back from the host.
  const test::Sets all_one = {"activation_offload.blocks=4", "activation_offload.every=1", "activation_offload.slots=1"};
  const test::Sets two = {"activation_offload.blocks=2", "activation_offload.every=2", "activation_offload.slots=1"};
  for (const auto& base : std::vector<test::Sets>{{}, {"train.micro_batch_size=2"}}) {
    const auto ref = test::run_ranks(kModel, 1, base);
    test::compare_traces(test::run_ranks(kModel, 1, base + all_one), ref, "every block, one slot", 0);
    test::compare_traces(test::run_ranks(kModel, 1, base + two + std::vector<std::string>{"activation_checkpoint.mode=full"}),
                         ref, "two blocks offloaded, the others recomputed", 0);
  }
  // Tensor and sequence parallelism: each rank offloads its own rows.
  const test::Sets sp = {"parallel.tp=2", "parallel.sequence_parallel=true"};
  test::compare_traces(test::run_ranks(kModel, 2, sp + all_one), test::run_ranks(kModel, 2, sp), "tp=2 + SP", 0);
  // Mixtures of experts in blocks 0 and 2, dense MLPs in 1 and 3 (a slot holds either's rows), on one
  // rank and with the experts split over two.
  const test::Sets moe = {"model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.hidden=48", "model.moe.every=2"};
  test::compare_traces(test::run_ranks(kModel, 1, moe + all_one), test::run_ranks(kModel, 1, moe), "MoE", 0);
  const test::Sets ep = moe + test::Sets{"parallel.ep=2"};
  test::compare_traces(test::run_ranks(kModel, 2, ep + all_one), test::run_ranks(kModel, 2, ep), "MoE, ep=2", 0);
}

TEST_CASE("the copies a step makes, and the device memory offloading saves") {
  // Four blocks over two slots: blocks 0 and 1 go out and come back; 2 and 3 stay in their slots.
  test::Pipeline p(kModel, {"activation_offload.blocks=4", "activation_offload.every=1", "activation_offload.slots=2",
                            "train.micro_batch_size=2"});
  p.run();
  const auto& run = *p.world->resource<recompute::ActivationOffloadState>().runner;
  CHECK(run.copies_out() == 3 * 2 * 2);  // steps x micro-batches x blocks 0 and 1
  CHECK(run.copies_in() == 3 * 2 * 2);
  CHECK(run.slots() == 2);

  auto bytes = [](const test::Sets& sets) {
    test::Pipeline q(kModel, sets);
    auto& m = q.world->resource<model::GptModel>();
    m.allocate_activations();
    return static_cast<double>(m.activation_bytes());
  };
  const double none = bytes({}), one_slot = bytes({"activation_offload.blocks=4", "activation_offload.every=1",
                                                   "activation_offload.slots=1"});
  const double two_slots = bytes({"activation_offload.blocks=4", "activation_offload.every=1"});
  MESSAGE("activation bytes: none " << none << ", 4 blocks offloaded over 2 slots " << two_slots << ", over 1 "
                                    << one_slot);
  // A slot holds one block's saved rows: each slot fewer keeps one block's rows fewer on the device.
  const double per_block = two_slots - one_slot;
  CHECK(per_block > 0);
  CHECK(none - one_slot == doctest::Approx(3 * per_block).epsilon(0.01));
}

TEST_CASE("OffloadRunner on its own: each block's rows come back before its backward pass, a validation pass copies nothing") {
  auto be = ops::make_cpu_backend();
  // Three blocks (units 2, 4, 6) over two slots of 8 floats.
  Buffer slot_memory[2] = {be->alloc(8 * sizeof(float)), be->alloc(8 * sizeof(float))};
  std::vector<TensorView> regions;
  for (int k = 0; k < 3; ++k) regions.push_back(slot_memory[k % 2].view(DType::u8, {8 * sizeof(float)}));
  recompute::OffloadRunner run(*be, {2, 4, 6}, 2);
  run.setup(regions);
  CHECK(run.host_bytes() == 8 * sizeof(float));  // block 0 alone leaves the device
  auto values = [&](int k) { return slot_memory[k % 2].view(DType::f32, {8}).as<float>(); };
  for (int step = 0; step < 2; ++step) {
    for (int k = 0; k < 3; ++k) {  // a block's forward pass writes its rows into its slot
      run.forward_begin(2 + 2 * k, true);
      std::fill_n(values(k), 8, static_cast<float>(10 * step + k + 1));
      run.forward_end(2 + 2 * k, true);
    }
    for (int k = 2; k >= 0; --k) {  // its backward pass reads them
      run.backward_begin(2 + 2 * k);
      CHECK(std::all_of(values(k), values(k) + 8, [&](float v) { return v == static_cast<float>(10 * step + k + 1); }));
      std::fill_n(values(k), 8, -1.0f);  // a backward pass may write over what it read
      run.backward_end(2 + 2 * k);
    }
  }
  CHECK(run.copies_out() == 2);
  CHECK(run.copies_in() == 2);
  for (int k = 0; k < 3; ++k) {  // validation: the forward passes alone
    run.forward_begin(2 + 2 * k, false);
    run.forward_end(2 + 2 * k, false);
  }
  run.forward_begin(3, true);  // not an offloaded unit
  CHECK(run.copies_out() == 2);
}
