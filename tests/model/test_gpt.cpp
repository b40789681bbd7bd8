// The GPT model on the CPU backend: whole-model gradients, gradient accumulation, training, and
// the non-finite checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "kiln/data/tokenizer.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/model/gpt.hpp"
#include "kiln/model/step_graph.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"
#include "kiln_test.hpp"
#include "model_fixture.hpp"

using namespace kiln;

namespace {

const char* kTiny = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 2
[train]
steps = 1
seed = 7
batch_size = 2
seq_len = 8
[model]
n_layer = 2
n_head = 2
n_embd = 16
vocab_size = 40
max_seq_len = 8
[optim]
[data]
synthetic_vocab = 40
)";

std::vector<float> to_host(ops::Backend& be, const TensorView& v) {
  std::vector<float> h(static_cast<std::size_t>(v.numel()));
  be.copy(TensorView(h.data(), {v.numel()}, DType::f32, Device::cpu), v);
  return h;
}

}  // namespace

TEST_CASE("whole-model gradients match finite differences on a tiny model, with and without dropout") {
  for (float dropout : {0.0f, 0.2f}) test::check_finite_differences(kTiny, {"model.dropout=" + std::to_string(dropout)});
}

TEST_CASE("the LM head a chunk of rows at a time: the same losses, gradients and evaluations, and finite differences") {
  // kTiny's micro-batch is 16 tokens: one chunk of 16 is the whole-logits head's arithmetic, bit for
  // bit; chunks of 5 (the last of 1) sum the weight gradient in four parts.
  test::Pipeline whole(kTiny, {"model.dropout=0.1"}), one(kTiny, {"model.dropout=0.1", "model.head_chunk_rows=16"}),
      five(kTiny, {"model.dropout=0.1", "model.head_chunk_rows=5"});
  std::vector<std::vector<float>> grads;
  std::vector<double> losses, evals;
  for (auto* p : {&whole, &one, &five}) {
    World& w = *p->world;
    w.systems().run(Phase::setup, w);
    test::forward_backward_step(w);
    auto& model = w.resource<model::GptModel>();
    grads.push_back(to_host(w.resource<ops::ActiveBackend>().get(), w.resource<nn::ParamStore>().grads_flat()));
    losses.push_back(model.mean_loss(1));
    evals.push_back(model.evaluate({w.resource<train::Batch>()}));
  }
  CHECK(whole.world->resource<model::GptModel>().losses_after_backward() == false);
  CHECK(five.world->resource<model::GptModel>().losses_after_backward());
  CHECK(grads[1] == grads[0]);
  CHECK(losses[1] == losses[0]);
  CHECK(evals[1] == evals[0]);
  double num = 0, den = 0;
  for (std::size_t i = 0; i < grads[0].size(); ++i) {
    num += double(grads[2][i] - grads[0][i]) * (grads[2][i] - grads[0][i]);
    den += double(grads[0][i]) * grads[0][i];
  }
  CHECK(std::sqrt(num / den) < 1e-6);
  CHECK(losses[2] == doctest::Approx(losses[0]).epsilon(1e-6));
  CHECK(evals[2] == doctest::Approx(evals[0]).epsilon(1e-6));
  CHECK(evals[0] != losses[0]);  // the evaluation has no dropout

  // A training forward's losses come with its backward: reading them before is an error.
  World& w = *five.world;
  auto& model = w.resource<model::GptModel>();
  model.forward(w.resource<train::Batch>(), 0, true, &w.resource<rng::RngStatesTracker>());
  CHECK_THROWS_WITH_AS(model.mean_loss(1), doctest::Contains("read them after backward()"), Error);
  model.backward(w.resource<train::Batch>());
  CHECK(std::isfinite(model.mean_loss(1)));

  test::check_finite_differences(kTiny, {"model.dropout=0.2", "model.head_chunk_rows=5"});
  test::check_finite_differences(
      kTiny, {"model.arch=llama", "model.tie_embeddings=false", "model.n_kv_head=1", "model.head_chunk_rows=6"});
  CHECK_THROWS_WITH_AS(test::Pipeline(kTiny, {"model.head_chunk_rows=-1"}), doctest::Contains("head_chunk_rows"),
                       ConfigError);
}

TEST_CASE("gradient accumulation over micro-batches equals one batch") {
  test::Pipeline one(kTiny, {"train.batch_size=4", "train.micro_batch_size=4"});
  test::Pipeline four(kTiny, {"train.batch_size=4", "train.micro_batch_size=1"});
  for (auto* p : {&one, &four}) {
    p->world->systems().run(Phase::setup, *p->world);
    test::forward_backward_step(*p->world);
  }
  CHECK(four.world->resource<RunControl>().micro_batches == 4);
  auto g1 = to_host(one.world->resource<ops::ActiveBackend>().get(),
                    one.world->resource<nn::ParamStore>().grads_flat());
  auto g4 = to_host(four.world->resource<ops::ActiveBackend>().get(),
                    four.world->resource<nn::ParamStore>().grads_flat());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < g1.size(); ++i) {
    num += double(g1[i] - g4[i]) * (g1[i] - g4[i]);
    den += double(g1[i]) * g1[i];
  }
  CHECK(std::sqrt(num / den) < 1e-5);
  CHECK(one.world->resource<model::GptModel>().mean_loss(1) ==
        doctest::Approx(four.world->resource<model::GptModel>().mean_loss(4)).epsilon(1e-5));
}

// backend.cuda_graph where capture cannot run (here: the CPU backend) leaves every step eager and
// says why once: nothing is hooked and the steps compute what they compute without it.
TEST_CASE("backend.cuda_graph on the CPU backend runs every step eagerly with the same losses") {
  const std::vector<std::string> sets = {"train.steps=4", "model.dropout=0.1"};
  auto with = sets;
  with.push_back("backend.cuda_graph=true");
  test::Pipeline graphed(kTiny, with), eager(kTiny, sets);
  const test::RunRecord g = test::run_recording(graphed), e = test::run_recording(eager);
  CHECK(graphed.world->try_resource<model::StepGraph>() == nullptr);
  CHECK(graphed.world->try_resource<PhaseHook>() == nullptr);
  REQUIRE(g.losses.size() == 4);
  CHECK(g.losses == e.losses);
  CHECK(model::StepGraph::refusal(*graphed.world).find("CPU") != std::string::npos);
}

// model.report_activations reads the table's saved rows: every block's, each with its own copy, or
// the one copy the recomputing blocks share under activation checkpointing.
TEST_CASE("the activation table lists each block's saved rows, own or shared under recompute") {
  for (const bool recompute : {false, true}) {
    test::Pipeline p(kTiny, recompute ? std::vector<std::string>{"activation_checkpoint.mode=full"}
                                      : std::vector<std::string>{});
    p.world->systems().run(Phase::setup, *p.world);
    const auto& rows = p.world->resource<model::GptModel>().activation_table().saved_rows();
    std::vector<std::string> keys0, keys1;
    for (const auto& r : rows) {
      if (r.block < 0) continue;  // the model's own (the final norm's)
      if (r.block == 0) keys0.push_back(r.key);
      if (r.block == 1) keys1.push_back(r.key);
      CHECK(r.shared == recompute);
    }
    CHECK(keys0 == keys1);
    CHECK(std::find(keys0.begin(), keys0.end(), "mlp.pre") != keys0.end());
    CHECK(std::find(keys0.begin(), keys0.end(), "attention.qkv") != keys0.end());
  }
}

TEST_CASE("recomputing LayerNorm and GELU outputs in the backward pass gives the same gradients") {
  test::Pipeline keep(kTiny, {"model.recompute_norm=false", "model.recompute_gelu=false", "model.dropout=0.1"});
  test::Pipeline recompute(kTiny, {"model.recompute_norm=true", "model.recompute_gelu=true", "model.dropout=0.1"});
  for (auto* p : {&keep, &recompute}) {
    p->world->systems().run(Phase::setup, *p->world);
    test::forward_backward_step(*p->world);
  }
  auto g1 = to_host(keep.world->resource<ops::ActiveBackend>().get(),
                    keep.world->resource<nn::ParamStore>().grads_flat());
  auto g2 = to_host(recompute.world->resource<ops::ActiveBackend>().get(),
                    recompute.world->resource<nn::ParamStore>().grads_flat());
  CHECK(g1 == g2);
}

TEST_CASE("training on the CPU lowers the loss by more than 2 nats in 80 steps") {
  test::TempDir dir("train");
  const auto losses = test::train_losses(test::pattern_corpus(dir), 80);
  REQUIRE(losses.size() == 80);
  INFO("first loss " << losses.front() << ", last loss " << losses.back());
  CHECK(losses.front() > 5.0);  // about ln(256) = 5.55 at initialisation
  CHECK(losses.back() < losses.front() - 2.0);
}

namespace poison {
struct PoisonConfig {
  std::int64_t at_step = 2;
  bool gradient = false;
};
KILN_CONFIG(PoisonConfig, (at_step, "step to poison"), (gradient, "poison a gradient instead of a weight"))

void add(ModuleRegistry& reg) {
  reg.add(make_module<PoisonConfig>("poison", "writes a NaN into the model", {"model"},
                                    [](World& w, const PoisonConfig& cfg) {
                                      auto find = [&w](const std::string& name) {
                                        for (Entity e : w.view<nn::Param>())
                                          if (w.get<nn::Param>(e).name == name) return e;
                                        KILN_THROW("no parameter ", name);
                                      };
                                      auto poison_param = [cfg, find](World& world) {
                                        if (world.resource<RunControl>().step != cfg.at_step) return;
                                        auto& store = world.resource<nn::ParamStore>();
                                        auto& prm = world.get<nn::Param>(find("blocks.1.mlp.fc.bias"));
                                        TensorView v = cfg.gradient ? store.grad_view(prm) : store.compute_view(prm);
                                        v.as<float>()[3] = cfg.gradient ? INFINITY : NAN;
                                      };
                                      if (cfg.gradient)
                                        w.systems().add({"poison.grad", Phase::backward, poison_param, {"model.backward"}});
                                      else
                                        w.systems().add({"poison.weight", Phase::forward, poison_param, {}, {"model.forward"}});
                                    }));
}
}  // namespace poison

TEST_CASE("a non-finite loss stops the run naming the step") {
  test::Pipeline p(kTiny, {"train.steps=5", "poison.at_step=3"}, poison::add);
  CHECK_THROWS_WITH_AS(p.run(), doctest::Contains("step 3: the loss is nan"), Error);
  CHECK(p.world->resource<RunControl>().step == 3);
}

TEST_CASE("a non-finite gradient stops the run naming the tensor") {
  test::Pipeline p(kTiny, {"train.steps=5", "poison.at_step=2", "poison.gradient=true"}, poison::add);
  CHECK_THROWS_WITH_AS(p.run(), doctest::Contains("step 2: non-finite gradient in 'blocks.1.mlp.fc.bias'"), Error);
}

TEST_CASE("parameters are entities with layout, decay and unit components") {
  test::Pipeline p(kTiny);
  auto& w = *p.world;
  auto& store = w.resource<nn::ParamStore>();
  store.lay_out(w);  // what "params.allocate" does first in Phase::setup
  std::int64_t prev_end = 0;
  int linears = 0;
  for (Entity e : store.order()) {
    const auto& prm = w.get<nn::Param>(e);
    CHECK(prm.offset % nn::kParamAlign == 0);
    CHECK(prm.offset >= prev_end);
    prev_end = prm.offset + prm.numel;
    const bool is_matrix = prm.shape.ndim == 2;
    CHECK(prm.weight_decay == is_matrix);
  }
  CHECK(prev_end <= store.total());
  for (Entity e : w.view<nn::Linear>()) {
    (void)e;
    ++linears;
  }
  CHECK(linears == 2 * 4 + 1);
  CHECK(w.view<nn::Layer>().size() == 4);  // embeddings, 2 blocks, final norm
  // Padded vocabulary: 40 -> 128.
  CHECK(w.get<nn::Param>(store.order()[0]).shape == Shape{128, 16});
}
