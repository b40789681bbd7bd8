// Activation checkpointing on the CPU backend: which blocks recompute what; gradients bit-identical
// to the run without recompute, with dropout, for every mode, with and without tensor/sequence
// parallelism and distributed saved inputs, and with FP8; the RNG replay is what makes it so; the
// memory it saves.
#include <doctest/doctest.h>

#include <algorithm>
#include <mutex>

#include "../model/model_fixture.hpp"
#include "../model/parallel_fixture.hpp"
#include "kiln/recompute/module.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/fp8/module.hpp"
#include "kiln/model/gpt.hpp"
#include "kiln/nn/components.hpp"
#include "kiln_test.hpp"

using namespace kiln;

namespace {

const char* kModel = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 2
[train]
steps = 4
seed = 3
batch_size = 4
seq_len = 16
[model]
n_layer = 3
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

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

test::Trace run(int nproc, const std::vector<std::string>& sets) { return test::run_ranks(kModel, nproc, sets); }

const std::vector<std::vector<std::string>> kModes = {
    {"activation_checkpoint.mode=full"},
    {"activation_checkpoint.mode=selective", "activation_checkpoint.selective=attention"},
    {"activation_checkpoint.mode=selective", "activation_checkpoint.selective=mlp"},
    {"activation_checkpoint.mode=full", "activation_checkpoint.every=2"},
    {"activation_checkpoint.mode=full", "activation_checkpoint.first=1"},
};

// A module that marks every block for full recompute but does not replay the RNG states: what
// activation checkpointing without the tracker would do.
struct NoReplayConfig {
  bool on = true;
};
KILN_CONFIG(NoReplayConfig, (on, "mark every block for recompute without replaying the RNG"))
void register_no_replay(ModuleRegistry& r) {
  r.add(make_module<NoReplayConfig>("test_no_replay", "", {"model"}, [](World& w, const NoReplayConfig&) {
    for (Entity e : w.view<nn::Layer>())
      if (w.get<nn::Layer>(e).kind == nn::LayerKind::block) w.emplace<nn::ActivationRecompute>(e);
  }));
}

std::vector<int> recompute_units(World& w) {
  std::vector<int> units;
  for (Entity e : w.view<nn::Layer>())
    if (w.has<nn::ActivationRecompute>(e)) units.push_back(w.get<nn::Layer>(e).unit);
  std::sort(units.begin(), units.end());
  return units;
}

}  // namespace

TEST_CASE("mode, every and first choose the blocks, each gets its scope") {
  auto units = [](std::vector<std::string> sets) {
    test::Pipeline p(kModel, sets + std::vector<std::string>{"model.n_layer=6"});
    auto u = recompute_units(*p.world);
    if (!u.empty()) CHECK(p.world->resource<recompute::ActivationCheckpointState>().units == u);
    return u;
  };
  CHECK(units({}).empty());
  CHECK(units({"activation_checkpoint.mode=none"}).empty());
  CHECK(units({"activation_checkpoint.mode=full"}) == std::vector<int>{1, 2, 3, 4, 5, 6});
  CHECK(units({"activation_checkpoint.mode=full", "activation_checkpoint.every=2"}) == std::vector<int>{1, 3, 5});
  CHECK(units({"activation_checkpoint.mode=full", "activation_checkpoint.first=2"}) == std::vector<int>{1, 2});
  CHECK(units({"activation_checkpoint.mode=full", "activation_checkpoint.every=3", "activation_checkpoint.first=5"}) ==
        std::vector<int>{1, 4});
  test::Pipeline p(kModel, {"activation_checkpoint.mode=selective", "activation_checkpoint.selective=mlp"});
  for (Entity e : p.world->view<nn::ActivationRecompute>())
    CHECK(p.world->get<nn::ActivationRecompute>(e).scope == nn::RecomputeScope::mlp);
}

TEST_CASE("bad activation_checkpoint settings are config errors") {
  CHECK_THROWS_WITH_AS(test::Pipeline(kModel, {"activation_checkpoint.every=0"}),
                       doctest::Contains("activation_checkpoint.every"), ConfigError);
  CHECK_THROWS_WITH_AS(test::Pipeline(kModel, {"activation_checkpoint.mode=sometimes"}),
                       doctest::Contains("selective"), ConfigError);
  ModuleRegistry reg;
  register_builtin_modules(reg);
  auto doc = config::parse_toml_text(kModel, "t.toml");
  config::apply_overrides(doc, {"parallel.tp=2", "parallel.sequence_parallel=true", "activation_checkpoint.mode=full",
                                "activation_checkpoint.distribute_saved_activations=true"});
  auto outcomes = parallel::run_thread_ranks(2, config::resolve(doc, "t.toml", reg), reg);
  for (auto& o : outcomes) {
    CHECK_FALSE(o.ok);
    CHECK(o.config_error);  // the key, where it was set, and why
    CHECK(o.error.find("--set activation_checkpoint.distribute_saved_activations=true: "
                       "activation_checkpoint.distribute_saved_activations: true with parallel.sequence_parallel = "
                       "true") != std::string::npos);
  }
}

TEST_CASE("every mode recomputes bit-identical losses and gradients with dropout (CPU)") {
  // Three model settings (LayerNorm/GELU outputs recomputed or kept; 2 micro-batches per step), each
  // against its own run without recompute.
  for (const auto& base : std::vector<std::vector<std::string>>{
           {}, {"model.recompute_norm=false", "model.recompute_gelu=false"}, {"train.micro_batch_size=2"}}) {
    const auto ref = run(1, base);
    for (const auto& mode : kModes)
      compare_traces(run(1, base + mode), ref, test::joined(base + mode, "(defaults)"), 0);
  }
}

TEST_CASE("the recompute draws from the replayed RNG states: without the replay the masks differ") {
  const auto ref = run(1, {});
  const auto wrong = test::run_ranks(kModel, 1, {"test_no_replay.on=true"}, register_no_replay);
  REQUIRE(wrong.loss.size() == ref.loss.size());
  CHECK(wrong.loss[0] == ref.loss[0]);  // the forward pass is the same
  std::size_t differing = 0;
  for (auto& [name, g] : ref.grads[0]) {
    const auto& h = wrong.grads[0].at(name);
    for (std::size_t i = 0; i < g.size(); ++i) differing += g[i] != h[i];
  }
  CHECK(differing > 0);  // the backward used other dropout masks
  // Without dropout there is nothing to replay and the same module is exact.
  compare_traces(test::run_ranks(kModel, 1, {"model.dropout=0", "test_no_replay.on=true"}, register_no_replay),
                 run(1, {"model.dropout=0"}), "no replay, no dropout", 0);
}

TEST_CASE("with tensor parallelism, recompute is bit-identical to the same layout without it") {
  // Distributed saved inputs: each TP rank keeps 1/tp of a block's input and all-gathers it.
  const std::vector<std::string> tp2 = {"parallel.tp=2"}, sp = {"parallel.tp=2", "parallel.sequence_parallel=true"};
  const std::vector<std::string> dist = {"activation_checkpoint.distribute_saved_activations=true"};
  const auto ref_tp2 = run(2, tp2);
  for (const auto& mode : kModes) {
    compare_traces(run(2, tp2 + mode), ref_tp2, test::joined(tp2 + mode, "(defaults)"), 0);
    compare_traces(run(2, tp2 + mode + dist), ref_tp2, test::joined(tp2 + mode + dist, "(defaults)"), 0);
  }
  const std::vector<std::string> tp4 = {"parallel.tp=4", "model.n_head=4"};
  compare_traces(run(4, tp4 + kModes[0] + dist), run(4, tp4), "tp=4, full, distributed", 0);
  compare_traces(run(4, tp2 + kModes[0] + dist), run(4, tp2), "tp=2 x dp=2, full, distributed", 0);
  const auto ref_sp = run(2, sp);
  compare_traces(run(2, sp + kModes[0]), ref_sp, "tp=2, sequence parallel, full", 0);
  compare_traces(run(2, sp + kModes[1]), ref_sp, "tp=2, sequence parallel, attention", 0);
  // And the layout-invariant masks make all of it match the single-rank run to fp32 rounding.
  compare_traces(run(2, tp2 + kModes[0] + dist), run(1, {}), "tp=2 full distributed vs tp=1", 1e-5);
}

TEST_CASE("activation memory: full < selective < none, distributed inputs keep 1/tp") {
  auto bytes = [](std::vector<std::string> sets) {
    test::Pipeline p(kModel, sets + std::vector<std::string>{"model.n_layer=8", "model.n_embd=64",
                                                             "train.batch_size=8", "train.seq_len=16"});
    auto& m = p.world->resource<model::GptModel>();
    m.allocate_activations();
    return static_cast<double>(m.activation_bytes());
  };
  const double none = bytes({}), full = bytes(kModes[0]), attn = bytes(kModes[1]), mlp = bytes(kModes[2]);
  const double half = bytes(kModes[3]);
  MESSAGE("activation bytes: none " << none << ", selective attention " << attn << ", selective mlp " << mlp
                                    << ", full every 2nd block " << half << ", full " << full);
  CHECK(full < attn);
  CHECK(full < mlp);
  CHECK(attn < none);
  CHECK(mlp < none);
  CHECK(full < half);
  CHECK(half < none);
  // Per block and token, without recompute a block keeps its input, qkv (3C), the attention output,
  // res2 and FC1's pre-activation (4C): 10C values, plus LayerNorm statistics and lse. Full recompute
  // keeps only the input, and one block's worth of shared rows; these hold both norms' outputs (the
  // recompute's, read by the backward instead of computed a third time), where without recompute the
  // norms share one scratch tensor: one C more.
  const double C = 64, N = 8 * 16, L = 8, bf = 4;  // the CPU backend keeps f32 activations
  const double saved_per_block = N * 9 * C * bf;
  CHECK(none - full >= (L - 1) * saved_per_block - N * C * bf);
  CHECK(none - full <= (L - 1) * (saved_per_block + N * 4 * 4 + 2 * N * 8 + 8 * 256));

  // Distributed saved inputs on 2 TP ranks: each keeps N/2 rows of every block's input, plus two
  // full-width inputs to recompute from.
  std::mutex m;
  std::vector<double> per_rank[2];
  for (int d = 0; d < 2; ++d) {
    ModuleRegistry reg;
    register_builtin_modules(reg);
    auto doc = config::parse_toml_text(kModel, "t.toml");
    config::apply_overrides(doc, {"parallel.tp=2", "activation_checkpoint.mode=full", "model.n_layer=8", "train.steps=1",
                                  d ? "activation_checkpoint.distribute_saved_activations=true"
                                    : "activation_checkpoint.distribute_saved_activations=false"});
    auto outcomes = parallel::run_thread_ranks(2, config::resolve(doc, "t.toml", reg), reg, [&, d](World& w) {
      w.systems().add({"test.bytes", Phase::step_end, [&, d](World& world) {
                         std::lock_guard lk(m);
                         per_rank[d].push_back(static_cast<double>(world.resource<model::GptModel>().activation_bytes()));
                       }});
    });
    for (auto& o : outcomes) REQUIRE(o.ok);
  }
  REQUIRE(per_rank[0].size() == 2);
  REQUIRE(per_rank[1].size() == 2);
  const double n = 4 * 16, saved = 8 * n * 32 * 4, split = 8 * (n / 2) * 32 * 4, pingpong = 2 * n * 32 * 4;
  MESSAGE("tp=2 full recompute, activation bytes per rank: " << per_rank[0][0] << " kept whole, " << per_rank[1][0]
                                                              << " distributed");
  CHECK(per_rank[0][0] - per_rank[1][0] == doctest::Approx(saved - split - pingpong).epsilon(0.02));
}

TEST_CASE("FP8 recompute reuses the forward's scales: bit-identical gradients and FP8 meta (CPU emulation)") {
  for (const char* recipe : {"delayed", "current"}) {
    const std::vector<std::string> fp8 = {"fp8.enabled=true", std::string("fp8.recipe=") + recipe,
                                          "fp8.amax_history_len=4", "train.micro_batch_size=2"};
    std::vector<std::vector<float>> meta[2];
    test::Trace traces[2];
    for (int k = 0; k < 2; ++k) {
      auto sets = k ? fp8 + kModes[0] : fp8;
      test::Pipeline p(kModel, sets);
      auto& w = *p.world;
      auto* out = &meta[k];
      auto* trace = &traces[k];
      w.systems().add({"test.meta", Phase::step_end, [out](World& world) {
                         const auto v = world.resource<fp8::Fp8State>().meta->state();
                         out->emplace_back(v.as<float>(), v.as<float>() + v.numel());
                       }});
      w.systems().add({"test.grads", Phase::grad_sync, [trace](World& world) {
                         trace->grads.push_back({{"all", test::grads_of(world)}});
                       }});
      w.systems().add({"test.loss", Phase::step_end,
                       [trace](World& world) { trace->loss.push_back(world.resource<train::TrainState>().loss); },
                       {"model.loss"}});
      p.run();
      if (k) CHECK(w.resource<recompute::ActivationCheckpointState>().recomputes == 4 * 2 * 3);
    }
    compare_traces(traces[1], traces[0], std::string("fp8 ") + recipe + ", full recompute", 0);
    REQUIRE(meta[0].size() == 4);
    for (int s = 0; s < 4; ++s) CHECK(meta[1][s] == meta[0][s]);
  }
}
