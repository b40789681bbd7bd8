// Mixture-of-experts MLPs ([model.moe]) on the CPU backend: whole-model gradients (router, experts,
// shared experts, the router's losses) against finite differences, micro-batches, recompute, the
// parallel layouts against one rank, the step's metrics, the balancing bias and the config errors.
#include <doctest/doctest.h>

#include <numeric>

#include "kiln/model/gpt.hpp"
#include "kiln/nn/param_store.hpp"
#include "model_fixture.hpp"
#include "parallel_fixture.hpp"

using namespace kiln;
using test::operator+;

namespace {

// A tiny Llama whose MLPs are 4 SwiGLU experts of width 24, two per token.
const char* kTinyMoe = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 1
[train]
steps = 20
seed = 5
batch_size = 8
seq_len = 16
[model]
arch = "llama"
n_layer = 2
n_head = 4
n_kv_head = 2
n_embd = 32
vocab_size = 96
max_seq_len = 16
tie_embeddings = false
[model.moe]
n_experts = 4
top_k = 2
hidden = 24
aux_loss_coeff = 0.05
z_loss_coeff = 0.01
[optim]
lr = 3e-3
warmup_steps = 3
[data]
synthetic_vocab = 96
[parallel]
timeout_s = 60
)";

// The router's losses of the last forward (what the model's gradient includes besides the
// cross-entropy), read from the step's metrics.
double router_losses(World& w) {
  double sum = 0;
  for (const auto& [name, v] : w.resource<model::GptModel>().step_metrics())
    if (name == "moe.aux_loss" || name == "moe.z_loss") sum += v;
  return sum;
}

double metric(const std::vector<std::pair<std::string, double>>& m, const std::string& name) {
  for (const auto& [n, v] : m)
    if (n == name) return v;
  FAIL("no metric " << name);
  return 0;
}

}  // namespace

TEST_CASE("moe: whole-model gradients match finite differences (SwiGLU and GELU experts, shared experts, both "
          "routers, capacity, expert dropout)") {
  // Every token takes every expert (top_k = n_experts): the gates are smooth in every weight, so no
  // difference step can change a choice; the capacity then drops by position alone.
  const test::Sets all = {"train.batch_size=2", "model.init_std=0.1", "model.moe.top_k=4"};
  test::check_finite_differences(kTinyMoe, all, router_losses);
  test::check_finite_differences(kTinyMoe, all + test::Sets{"model.moe.shared_experts=1", "model.dropout=0.1",
                                                            "model.moe.expert_dropout=0.2"},
                                 router_losses);
  test::check_finite_differences(kTinyMoe, all + test::Sets{"model.moe.router=sigmoid", "model.moe.capacity_factor=0.5"},
                                 router_losses);
  test::check_finite_differences(kTinyMoe, all + test::Sets{"model.arch=gpt2", "model.n_kv_head=0",
                                                            "model.tie_embeddings=true", "model.moe.every=2",
                                                            "model.moe.normalize_gates=false", "model.moe.expert_dropout=0.1"},
                                 router_losses);
}

TEST_CASE("moe: parameters, FLOPs and active parameters are the experts' and the router's") {
  test::Pipeline p(kTinyMoe, {"model.moe.shared_experts=1", "model.moe.every=2"});
  p.world->systems().run(Phase::setup, *p.world);
  auto& w = *p.world;
  std::map<std::string, Shape> shapes;
  for (Entity e : w.resource<nn::ParamStore>().order()) shapes[w.get<nn::Param>(e).name] = w.get<nn::Param>(e).global_shape;
  CHECK(shapes.at("blocks.0.mlp.router.weight") == Shape{4, 32});
  CHECK(shapes.at("blocks.0.mlp.experts.fc.weight") == Shape{4 * 2 * 24, 32});  // each expert [gate | up]
  CHECK(shapes.at("blocks.0.mlp.experts.proj.weight") == Shape{4 * 24, 32});    // each expert [in, out]
  CHECK(shapes.at("blocks.0.mlp.shared.fc.weight") == Shape{2 * 24, 32});
  CHECK(shapes.count("blocks.1.mlp.router.weight") == 0);  // every = 2: block 1 is dense
  CHECK(shapes.at("blocks.1.mlp.fc.weight") == Shape{2 * 256, 32});  // Llama's default width for n_embd 32
  auto& model = w.resource<model::GptModel>();
  const std::int64_t expert = 2 * 24 * 32 + 24 * 32;
  CHECK(model.parameter_count() - model.active_parameter_count() == 2 * expert);  // 4 experts, 2 per token
}

TEST_CASE("moe: micro-batches equal one batch; recompute gives the same gradients bit for bit") {
  const test::Sets drop = {"model.dropout=0.1", "model.moe.expert_dropout=0.1", "model.moe.capacity_factor=1.5"};
  test::Pipeline one(kTinyMoe, drop + test::Sets{"train.batch_size=4", "train.micro_batch_size=4"});
  test::Pipeline four(kTinyMoe, drop + test::Sets{"train.batch_size=4", "train.micro_batch_size=1"});
  for (auto* p : {&one, &four}) {
    p->world->systems().run(Phase::setup, *p->world);
    test::forward_backward_step(*p->world);
  }
  const auto g1 = test::grads_of(*one.world), g4 = test::grads_of(*four.world);
  double num = 0, den = 0;
  for (std::size_t i = 0; i < g1.size(); ++i) {
    num += double(g1[i] - g4[i]) * (g1[i] - g4[i]);
    den += double(g1[i]) * g1[i];
  }
  CHECK(std::sqrt(num / den) < 1e-5);

  test::Pipeline keep(kTinyMoe, drop + test::Sets{"model.recompute_norm=false", "model.recompute_gelu=false"});
  test::Pipeline refill(kTinyMoe, drop + test::Sets{"model.recompute_norm=true", "model.recompute_gelu=true"});
  test::Pipeline full(kTinyMoe, drop + test::Sets{"activation_checkpoint.mode=full"});
  test::Pipeline mlp(kTinyMoe, drop + test::Sets{"activation_checkpoint.mode=selective",
                                                 "activation_checkpoint.selective=mlp"});
  for (auto* p : {&keep, &refill, &full, &mlp}) {
    p->world->systems().run(Phase::setup, *p->world);
    test::forward_backward_step(*p->world);
  }
  const auto ref = test::grads_of(*keep.world);
  CHECK(test::grads_of(*refill.world) == ref);
  CHECK(test::grads_of(*full.world) == ref);
  CHECK(test::grads_of(*mlp.world) == ref);
}

TEST_CASE("moe: tensor, sequence and data parallelism and FSDP match one rank over 20 steps, with dropout and "
          "recompute") {
  const test::Sets drop = {"model.dropout=0.1", "model.moe.expert_dropout=0.1", "model.moe.shared_experts=1"};
  const test::Sets full = {"activation_checkpoint.mode=full"};
  const auto single = test::run_ranks(kTinyMoe, 1, drop);
  REQUIRE(single.loss.size() == 20);
  auto check = [&](int nproc, const test::Sets& sets, const char* what) {
    test::compare_traces(test::run_ranks(kTinyMoe, nproc, drop + sets), single, what, 1e-5);
  };
  check(2, test::Sets{"parallel.tp=2"} + full, "tp=2 (each expert's hidden features split), full recompute");
  check(2, test::Sets{"parallel.tp=2", "parallel.sequence_parallel=true"},
        "tp=2 with sequence parallelism");
  check(2, full, "dp=2, full recompute");
  check(2, test::Sets{"fsdp.strategy=full_shard"}, "fsdp full_shard over 2");
  check(4, test::Sets{"parallel.tp=2", "train.micro_batch_size=2"} + full, "tp=2 x dp=2, 2 micro-batches");
}

TEST_CASE("moe: each step reports the router's losses and every layer's expert load; the capacity's drops") {
  test::Pipeline p(kTinyMoe, {"model.moe.capacity_factor=0.5", "train.steps=1"});
  p.world->systems().run(Phase::setup, *p.world);
  test::forward_backward_step(*p.world);
  const auto m = p.world->resource<model::GptModel>().step_metrics();
  // 8 sequences x 16 tokens x 2 choices; each of 4 experts takes at most ceil(0.5 x 16 x 2 / 4) = 4
  // of a sequence's 32 choices: at least half are dropped.
  for (const char* layer : {"blocks.0.mlp", "blocks.1.mlp"}) {
    const std::string l = layer;
    const double lo = metric(m, l + ".tokens_min"), hi = metric(m, l + ".tokens_max");
    CHECK(lo >= 0);
    CHECK(hi <= 8 * 4);
    CHECK(metric(m, l + ".dropped") >= 8 * 16);
    CHECK(metric(m, l + ".aux_loss") > 0);
    CHECK(metric(m, l + ".z_loss") > 0);
  }
  CHECK(metric(m, "moe.aux_loss") == doctest::Approx(metric(m, "blocks.0.mlp.aux_loss") + metric(m, "blocks.1.mlp.aux_loss")));
  CHECK(metric(m, "moe.dropped") == metric(m, "blocks.0.mlp.dropped") + metric(m, "blocks.1.mlp.dropped"));
  // A balanced router's aux loss is its coefficient: E sum_e f_e P_e = 1 (at initialisation the
  // scores are nearly uniform).
  CHECK(metric(m, "blocks.0.mlp.aux_loss") == doctest::Approx(0.05).epsilon(0.1));
}

TEST_CASE("moe: the sigmoid router's balancing bias moves towards balance, and a checkpoint restores it") {
  test::TempDir dir("moe-bias");
  // A constant learning rate: the first run's schedule must not depend on its shorter length.
  const test::Sets router = {"model.moe.router=sigmoid", "model.moe.bias_update_rate=0.01",
                             "model.moe.aux_loss_coeff=0", "optim.schedule=constant"};
  const test::Sets sig = router + test::Sets{"checkpoint.dir=" + dir.path().string(), "checkpoint.every=5", "train.steps=5"};
  test::Pipeline a(kTinyMoe, sig);
  a.run();
  const auto state = a.world->resource<model::GptModel>().part_state();
  REQUIRE(state.size() == 2 * 4);  // two layers of 4 experts
  int moved = 0;
  for (float b : state) moved += b != 0.0f;
  CHECK(moved > 0);
  // Resumed for 5 more steps against one run of 10: bit-identical (the bias included).
  test::Pipeline b(kTinyMoe, sig + test::Sets{"train.steps=10"});
  b.run();
  test::Pipeline ref(kTinyMoe, router + test::Sets{"train.steps=10"});
  ref.run();
  CHECK(b.world->resource<model::GptModel>().part_state() == ref.world->resource<model::GptModel>().part_state());
  CHECK(b.world->resource<train::TrainState>().loss == ref.world->resource<train::TrainState>().loss);
}

TEST_CASE("moe: shapes that do not fit are configuration errors naming the key") {
  CHECK_THROWS_WITH(test::Pipeline(kTinyMoe, {"model.moe.top_k=5"}), doctest::Contains("model.moe.top_k"));
  CHECK_THROWS_WITH(test::Pipeline(kTinyMoe, {"model.moe.capacity_factor=-1"}),
                    doctest::Contains("model.moe.capacity_factor"));
  CHECK_THROWS_WITH(test::Pipeline(kTinyMoe, {"model.moe.router=topk"}), doctest::Contains("router"));
  std::string failures;
  test::run_ranks(kTinyMoe, 2, {"parallel.tp=2", "model.moe.hidden=25"}, nullptr, &failures);
  CHECK(failures.find("model.moe.hidden") != std::string::npos);
}
