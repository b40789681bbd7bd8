// Llama blocks (model.arch = "llama": RMSNorm, rotary positions, SwiGLU, grouped-query attention,
// no biases, tied or untied LM head) on the CPU backend: whole-model gradients against finite
// differences, micro-batches, recompute, every parallel layout against one rank with dropout and
// activation recompute, training, FP8 emulation against bf16, and the configuration errors.
#include <doctest/doctest.h>

#include <numeric>

#include "kiln/model/gpt.hpp"
#include "kiln/nn/param_store.hpp"
#include "model_fixture.hpp"
#include "parallel_fixture.hpp"

using namespace kiln;
using test::operator+;

namespace {

const char* kTinyLlama = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 1
[train]
steps = 20
seed = 5
batch_size = 8
seq_len = 32
[model]
arch = "llama"
n_layer = 2
n_head = 4
n_kv_head = 2
n_embd = 32
ffn_hidden = 48
vocab_size = 96
max_seq_len = 32
tie_embeddings = false
[optim]
lr = 2e-3
warmup_steps = 3
[data]
synthetic_vocab = 96
[parallel]
timeout_s = 60
)";

// The byte-level Llama that test::train_losses trains (its GPT-2 shape, Llama's blocks).
const test::Sets kLlamaSets = {"model.arch=llama", "model.n_head=4", "model.n_kv_head=2", "model.ffn_hidden=96",
                               "model.tie_embeddings=false"};

}  // namespace

TEST_CASE("llama: whole-model gradients match finite differences (GQA, MQA, MHA, tied, dropout)") {
  // 64 tokens and weights drawn wider than training would (std 0.1): at 0.02 the MLP barely reaches
  // the loss at initialisation, and the norms' weights' gradients (~1e-4) sink into the f32 noise of the
  // differences (~7e-6).
  const test::Sets small = {"train.batch_size=4", "train.seq_len=16", "model.init_std=0.1"};
  test::check_finite_differences(kTinyLlama, small);
  test::check_finite_differences(kTinyLlama, small + test::Sets{"model.dropout=0.2"});
  test::check_finite_differences(kTinyLlama, small + test::Sets{"model.n_kv_head=1", "model.tie_embeddings=true"});
  test::check_finite_differences(kTinyLlama, small + test::Sets{"model.n_kv_head=4", "model.rope_theta=500000"});
  test::check_finite_differences(kTinyLlama, small + test::Sets{"model.rope_scaling.type=llama3", "model.rope_scaling.factor=8",
                                                                "model.rope_scaling.original_max_seq_len=16"});
}

TEST_CASE("llama: parameters are the architecture's, with no biases, no position table and an untied head") {
  test::Pipeline p(kTinyLlama);
  p.world->systems().run(Phase::setup, *p.world);
  std::map<std::string, Shape> shapes;
  auto& w = *p.world;
  for (Entity e : w.resource<nn::ParamStore>().order()) shapes[w.get<nn::Param>(e).name] = w.get<nn::Param>(e).global_shape;
  CHECK(shapes.size() == 3 + 6 * 2);  // wte, norm_f, lm_head; per block 2 norms and 4 matrices
  CHECK(shapes.count("wpe") == 0);
  CHECK(shapes.at("wte") == Shape{128, 32});  // 96 padded to 128
  CHECK(shapes.at("lm_head.weight") == Shape{128, 32});
  CHECK(shapes.at("blocks.0.attn.qkv.weight") == Shape{(4 + 2 * 2) * 8, 32});  // 4 query + 2 x 2 key/value heads of 8
  CHECK(shapes.at("blocks.0.mlp.fc.weight") == Shape{2 * 48, 32});              // [gate | up]
  CHECK(shapes.at("blocks.0.mlp.proj.weight") == Shape{32, 48});
  CHECK(shapes.at("blocks.1.norm_2.weight") == Shape{32});
  CHECK(shapes.at("norm_f.weight") == Shape{32});
  for (const auto& [name, shape] : shapes) CHECK(name.find("bias") == std::string::npos);
  auto& model = w.resource<model::GptModel>();
  // 6 x (blocks' matrices + head) + attention: the formula of docs/PERF.md with Llama's widths.
  const double block = 32.0 * 64 + 32 * 32 + 32 * 96 + 48 * 32;
  CHECK(model.flops_per_token() == doctest::Approx(6 * (2 * block + 128 * 32) + 12.0 * 2 * 32 * 32));
}

TEST_CASE("llama: micro-batches equal one batch, recomputing the norms and SwiGLU gives the same gradients") {
  test::Pipeline one(kTinyLlama, {"train.batch_size=4", "train.micro_batch_size=4", "model.dropout=0.1"});
  test::Pipeline four(kTinyLlama, {"train.batch_size=4", "train.micro_batch_size=1", "model.dropout=0.1"});
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

  test::Pipeline keep(kTinyLlama, {"model.recompute_norm=false", "model.recompute_gelu=false", "model.dropout=0.1"});
  test::Pipeline recompute(kTinyLlama, {"model.recompute_norm=true", "model.recompute_gelu=true", "model.dropout=0.1"});
  for (auto* p : {&keep, &recompute}) {
    p->world->systems().run(Phase::setup, *p->world);
    test::forward_backward_step(*p->world);
  }
  CHECK(test::grads_of(*keep.world) == test::grads_of(*recompute.world));
}

TEST_CASE("llama: every parallel layout matches one rank over 20 steps, with dropout and activation recompute") {
  const test::Sets drop = {"model.dropout=0.1"};
  const test::Sets full = {"activation_checkpoint.mode=full"};
  const test::Sets attn = {"activation_checkpoint.mode=selective", "activation_checkpoint.selective=attention"};
  const test::Sets mlp = {"activation_checkpoint.mode=selective", "activation_checkpoint.selective=mlp"};
  const auto single = test::run_ranks(kTinyLlama, 1, drop);
  REQUIRE(single.loss.size() == 20);
  for (double l : single.loss) CHECK(std::isfinite(l));
  auto check = [&](int nproc, const test::Sets& sets, const char* what) {
    test::compare_traces(test::run_ranks(kTinyLlama, nproc, drop + sets), single, what, 1e-5);
  };
  check(2, test::Sets{"parallel.tp=2"} + full, "tp=2 (one key/value head per rank), full recompute");
  check(2, test::Sets{"parallel.tp=2", "parallel.sequence_parallel=true", "parallel.vocab_parallel=true"} + attn,
        "tp=2 with sequence and vocabulary parallelism, attention recompute");
  check(2, full, "dp=2, full recompute");
  check(2, test::Sets{"fsdp.strategy=full_shard"} + mlp, "fsdp full_shard over 2, MLP recompute");
  check(4, test::Sets{"parallel.tp=2", "train.micro_batch_size=2", "activation_checkpoint.distribute_saved_activations=true"} + full,
        "tp=2 x dp=2, 2 micro-batches, saved inputs split over TP");
  // The initial weights do not depend on the layout (drawn by global element index): one step at a
  // learning rate far below the weights' resolution leaves them as they were drawn.
  const test::Sets still = {"train.steps=1", "optim.lr=1e-30", "optim.warmup_steps=0"};
  const auto tp1 = test::run_ranks(kTinyLlama, 1, still);
  const auto tp2 = test::run_ranks(kTinyLlama, 2, still + test::Sets{"parallel.tp=2"});
  CHECK(tp1.weights == tp2.weights);
}

TEST_CASE("llama: a byte-level model learns, and FP8 (delayed and current) ends within 2% of bf16 over 200 steps") {
  test::TempDir dir("llama-train");
  const std::string shards = test::pattern_corpus(dir);
  const test::Sets bf16 = kLlamaSets + test::Sets{"backend.cpu_round_bf16=true"};
  const auto ref = test::train_losses(shards, 200, bf16);
  REQUIRE(ref.size() == 200);
  CHECK(ref.back() < ref.front() - 2.0);  // it learned
  const auto delayed = test::train_losses(shards, 200, bf16 + test::Sets{"fp8.enabled=true"});
  const auto current = test::train_losses(shards, 200, bf16 + test::Sets{"fp8.enabled=true", "fp8.recipe=current"});
  const double r = test::tail_mean(ref, 10), d = test::tail_mean(delayed, 10), c = test::tail_mean(current, 10);
  MESSAGE("llama final loss (mean of the last 10 of 200 steps): bf16 " << r << ", fp8 delayed " << d << ", fp8 current "
                                                                        << c << "; first " << ref.front());
  CHECK(std::fabs(d - r) / r < 0.02);
  CHECK(std::fabs(c - r) / r < 0.02);
  CHECK(delayed != ref);  // FP8 does change the numbers
}

TEST_CASE("llama: shapes that do not fit are configuration errors naming the key") {
  CHECK_THROWS_WITH(test::Pipeline(kTinyLlama, {"model.n_kv_head=3"}), doctest::Contains("n_kv_head"));
  CHECK_THROWS_WITH(test::Pipeline(kTinyLlama, {"model.n_embd=36", "model.n_head=12", "model.n_kv_head=4"}),
                    doctest::Contains("head dimension"));
  CHECK_THROWS_WITH(test::Pipeline(kTinyLlama, {"model.arch=gpt2"}), doctest::Contains("n_kv_head"));
  CHECK_THROWS_WITH(test::Pipeline(kTinyLlama, {"model.arch=gpt2", "model.n_kv_head=0"}),
                    doctest::Contains("tie_embeddings"));
  CHECK_THROWS_WITH(test::Pipeline(kTinyLlama, {"model.arch=falcon"}), doctest::Contains("arch"));
  CHECK_THROWS_WITH(test::Pipeline(kTinyLlama, {"model.init_from=x.safetensors"}), doctest::Contains("model.init_from"));
  std::string failures;
  test::run_ranks(kTinyLlama, 4, {"parallel.tp=4"}, nullptr, &failures);  // 2 key/value heads over 4 ranks
  CHECK(failures.find("model.n_kv_head") != std::string::npos);
  test::run_ranks(kTinyLlama, 4, {"parallel.tp=4", "model.n_kv_head=4", "model.ffn_hidden=50"}, nullptr, &failures);
  CHECK(failures.find("model.ffn_hidden") != std::string::npos);
}
