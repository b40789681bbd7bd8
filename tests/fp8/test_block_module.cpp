// fp8.recipe = "block" in whole runs on the CPU backend: which layers it takes, training that ends
// near fp32 and bf16 after 200 steps, recompute exact and micro-batches within FP8's rounding, tensor-parallel splits that
// would cut a block refused naming the keys, and a delayed-scaling checkpoint resumed under it.
#include <doctest/doctest.h>

#include <cmath>
#include <numeric>

#include "../model/model_fixture.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/fp8/module.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/ops/grouped_linear_impl.hpp"
#include "kiln/ops/linear_impl.hpp"
#include "kiln/parallel/thread_ranks.hpp"
#include "kiln_test.hpp"

using namespace kiln;

namespace {

const char* kBlockTiny = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 1
[train]
steps = 3
seed = 7
batch_size = 4
seq_len = 16
[model]
n_layer = 2
n_head = 2
n_embd = 32
vocab_size = 64
max_seq_len = 16
[optim]
[data]
synthetic_vocab = 64
[parallel]
timeout_s = 60
)";

}  // namespace

TEST_CASE("fp8.recipe=block gives the block linears block-scaled FP8 layers, with no scaling state") {
  test::Pipeline p(kBlockTiny, {"fp8.enabled=true", "fp8.recipe=block"});
  World& w = *p.world;
  p.run();
  CHECK(std::isfinite(w.resource<train::TrainState>().loss));
  auto& st = w.resource<fp8::Fp8State>();
  CHECK(st.block_linears.size() == 8);  // 4 per block, the LM head stays
  CHECK(!st.meta);
  int attached = 0;
  for (Entity e : w.view<nn::Linear>()) {
    CHECK(!w.has<fp8::Fp8Meta>(e));
    attached += w.has<ops::LinearImpl>(e) ? 1 : 0;
  }
  CHECK(attached == 8);
}

// 200 steps of the tiny model: FP8 ends below the bf16 run here (FP8's rounding noise helps this small
// model on this corpus), and where a 200-step run ends depends on the build's floating point (the
// sanitizer build's bf16 run ends 0.4% from the release build's, per-tensor current scaling 5% from
// its own) and on small changes of the rounding: block scaling ended 3.7% below bf16 and 1.8% below
// fp32 in the release build with the weights' codes made from their bf16 copies, 5.2% and 3.3% below
// with the codes made from the f32 masters (fp8.weights_in_compute_copy, the default since), the
// power-of-two scales 4.6% and 2.7%. The bounds leave room for that spread on the side FP8 lands on,
// and hold it to 2% on the other (no worse than bf16 by more than the issue's 2%).
TEST_CASE("block-scaled FP8 training on the CPU ends within 5% of fp32 and 7% of bf16 after 200 steps, no worse than "
          "bf16 by 2%") {
  test::TempDir dir("fp8-block-train");
  const std::string shards = test::pattern_corpus(dir);
  const std::string bf16 = "backend.cpu_round_bf16=true";
  const auto ref = test::train_losses(shards, 200, {bf16});
  const auto f32 = test::train_losses(shards, 200, {});
  const auto block = test::train_losses(shards, 200, {bf16, "fp8.enabled=true", "fp8.recipe=block"});
  const auto pow2 =
      test::train_losses(shards, 200, {bf16, "fp8.enabled=true", "fp8.recipe=block", "fp8.block_pow2_scales=true"});
  const auto two_d =
      test::train_losses(shards, 200, {bf16, "fp8.enabled=true", "fp8.recipe=block", "fp8.block_2d_wgrad_input=true"});
  REQUIRE(ref.size() == 200);
  const double r = test::tail_mean(ref, 10), f = test::tail_mean(f32, 10), b = test::tail_mean(block, 10),
               p = test::tail_mean(pow2, 10), d = test::tail_mean(two_d, 10);
  MESSAGE("final loss (mean of the last 10 of 200 steps): bf16 " << r << ", fp32 " << f << ", fp8 block " << b
                                                                  << ", with power-of-two scales " << p
                                                                  << ", with the weight gradient's input in 128x128 blocks "
                                                                  << d);
  CHECK(ref.back() < ref.front() - 2.0);
  CHECK(two_d != block);
  for (double v : {b, p, d}) {
    CHECK(std::fabs(v - f) / f < 0.05);
    CHECK(std::fabs(v - r) / r < 0.07);
    CHECK((v - r) / r < 0.02);
  }
  CHECK(block != ref);  // FP8 does change the numbers
  CHECK(block != pow2);
}

TEST_CASE("block-scaled FP8 layers recompute exactly, split micro-batches as the whole batch, and an FP8 head "
          "takes chunks of rows") {
  const std::vector<std::string> block = {"fp8.enabled=true", "fp8.recipe=block", "model.dropout=0.1", "train.steps=4"};
  auto losses = [&](std::vector<std::string> more) {
    more.insert(more.begin(), block.begin(), block.end());
    test::Pipeline p(kBlockTiny, more);
    return test::step_losses(p);
  };
  const auto plain = losses({});
  CHECK(losses({"activation_checkpoint.mode=full"}) == plain);  // bit for bit: no state to replay wrongly
  // Micro-batches of 32 tokens: the weight gradient's 1x128 blocks along the tokens are each
  // micro-batch's (partial blocks of 32 here, 64 in the whole batch), so FP8's rounding differs.
  const auto micro = losses({"train.micro_batch_size=2"});
  REQUIRE(micro.size() == plain.size());
  for (std::size_t i = 0; i < plain.size(); ++i) CHECK(micro[i] == doctest::Approx(plain[i]).epsilon(1e-4));
  // The layers keeping their inputs' transposes (below): each micro-batch's backward reads its own
  // forward's, and a recompute's forward makes them again.
  const std::vector<std::string> stored = {"model.recompute_norm=false", "model.recompute_gelu=false"};
  auto with_stored = [&](std::vector<std::string> more) {
    more.insert(more.end(), stored.begin(), stored.end());
    return losses(more);
  };
  CHECK(with_stored({}) == plain);
  CHECK(with_stored({"activation_checkpoint.mode=full"}) == plain);
  CHECK(with_stored({"train.micro_batch_size=2"}) == micro);
  // A block-scaled LM head a chunk of rows at a time (model.head_chunk_rows): one chunk of the 64
  // tokens is the whole head; chunks of 48 (the last of 16) make the dlogits' 1x128 blocks along
  // the tokens of each chunk apart, so FP8's rounding differs.
  const auto head = losses({"fp8.lm_head=true"});
  CHECK(head != plain);
  CHECK(losses({"fp8.lm_head=true", "model.head_chunk_rows=64"}) == head);
  const auto chunks = losses({"fp8.lm_head=true", "model.head_chunk_rows=48"});
  REQUIRE(chunks.size() == head.size());
  for (std::size_t i = 0; i < head.size(); ++i) CHECK(chunks[i] == doctest::Approx(head[i]).epsilon(1e-3));
}

TEST_CASE("block-scaled FP8 layers keep their inputs' transposes in FP8 where the model would store the inputs in "
          "bf16: which layers, the same losses, less memory") {
  // With recompute_norm / recompute_gelu off the model would store the norms' and the activation's
  // outputs for QKV, FC1 and FC2; those layers keep the weight gradient's operand instead (x^T in
  // 1x128 blocks along the tokens, or 128x128 with fp8.block_2d_wgrad_input), made in the forward
  // from the values the backward would quantise: the same codes, so the same losses.
  const std::vector<std::string> stored = {"model.recompute_norm=false", "model.recompute_gelu=false"};
  for (const char* arch : {"gpt2", "llama"}) {
    for (const char* wgrad_2d : {"false", "true"}) {
      INFO(arch << ", fp8.block_2d_wgrad_input=" << wgrad_2d);
      std::vector<std::string> block = {"fp8.enabled=true", "fp8.recipe=block", std::string("model.arch=") + arch,
                                        std::string("fp8.block_2d_wgrad_input=") + wgrad_2d, "train.steps=4"};
      auto run = [&](bool store, std::size_t* kept, std::size_t* activations) {
        std::vector<std::string> more = block;
        if (store) more.insert(more.end(), stored.begin(), stored.end());
        test::Pipeline p(kBlockTiny, more);
        const std::vector<double> out = test::step_losses(p);
        World& w = *p.world;
        auto& st = w.resource<fp8::Fp8State>();
        *kept = 0;
        for (std::size_t i = 0; i < st.entities.size(); ++i) {
          const auto role = w.get<nn::Linear>(st.entities[i]).role;
          const bool keeps = w.get<ops::LinearImpl>(st.entities[i]).keeps_input;
          CHECK(keeps == st.block_linears[i]->keeps_input());
          // What the model would store: the norms' outputs (QKV, FC1) and the activation's (FC2).
          const bool stored_input = store && (role == nn::LinearRole::qkv || role == nn::LinearRole::mlp_in ||
                                              role == nn::LinearRole::mlp_out);
          CHECK(keeps == stored_input);
          *kept += st.block_linears[i]->kept_bytes();
        }
        *activations = w.resource<model::GptModel>().activation_bytes();
        return out;
      };
      std::size_t kept_none = 0, kept_fp8 = 0, act_recomputed = 0, act_kept = 0;
      const auto base = run(false, &kept_none, &act_recomputed);
      CHECK(kept_none == 0);
      CHECK(run(true, &kept_fp8, &act_kept) == base);
      CHECK(kept_fp8 > 0);
      // The model stores nothing more for those layers than when it recomputes their inputs.
      CHECK(act_kept <= act_recomputed);
    }
  }
}

TEST_CASE("fp8.recipe=block refuses a tensor-parallel split that cuts 128-wide blocks, naming the keys") {
  ModuleRegistry reg;
  register_builtin_modules(reg);
  auto run = [&](const std::vector<std::string>& sets) {
    auto doc = config::parse_toml_text(kBlockTiny, "tiny.toml");
    std::vector<std::string> all = {"parallel.tp=2", "fp8.enabled=true", "fp8.recipe=block"};
    all.insert(all.end(), sets.begin(), sets.end());
    config::apply_overrides(doc, all);
    return parallel::run_thread_ranks(2, config::resolve(doc, "tiny.toml", reg), reg);
  };
  const auto small = run({});  // d 32: every split part is 16 or 48 wide
  REQUIRE(small.size() == 2);
  CHECK(!small[0].ok);
  CHECK(small[0].config_error);
  CHECK(small[0].error.find("parallel.tp") != std::string::npos);
  CHECK(small[0].error.find("fp8.recipe") != std::string::npos);
  CHECK(small[0].error.find("multiple of 128") != std::string::npos);
  // d 256, 4 heads: q/k/v parts of 384, attention inputs of 128, MLP parts of 512.
  const auto wide = run({"model.n_embd=256", "model.n_head=4", "train.steps=1"});
  INFO(parallel::describe_failures(wide));
  for (const auto& o : wide) CHECK(o.ok);
  // A mixture of experts of width 64 split over two ranks: parts of 32.
  const auto experts = run({"model.n_embd=256", "model.n_head=4", "model.moe.n_experts=4", "model.moe.top_k=2",
                            "model.moe.hidden=64"});
  REQUIRE(experts.size() == 2);
  CHECK(experts[0].config_error);
  CHECK(experts[0].error.find("model.moe.hidden") != std::string::npos);
  CHECK(experts[0].error.find("multiple of 128") != std::string::npos);
}

TEST_CASE("fp8.recipe=block gives a mixture of experts' grouped linears block-scaled FP8 layers") {
  test::Pipeline p(kBlockTiny, {"fp8.enabled=true", "fp8.recipe=block", "model.arch=llama", "model.n_kv_head=1",
                           "model.tie_embeddings=false", "model.moe.n_experts=4", "model.moe.top_k=2",
                           "model.moe.hidden=24"});
  World& w = *p.world;
  p.run();
  CHECK(std::isfinite(w.resource<train::TrainState>().loss));
  auto& st = w.resource<fp8::Fp8State>();
  CHECK(st.block_grouped.size() == 4);  // FC1 and FC2 of each block's experts
  CHECK(st.grouped.empty());
  int attached = 0;
  for (Entity e : w.view<nn::GroupedLinear>()) {
    attached += w.has<ops::GroupedLinearImpl>(e) ? 1 : 0;
    // FC1 keeps its input's transposes in FP8 (the model stores no input rows for it); FC2's input
    // (the SwiGLU's output) is recomputed for the backward (model.recompute_gelu), so nothing is kept.
    CHECK(w.get<ops::GroupedLinearImpl>(e).keeps_input == (w.get<nn::GroupedLinear>(e).role == nn::LinearRole::mlp_in));
  }
  CHECK(attached == 4);
}

TEST_CASE("block-scaled FP8 layers computing their operands on load, writing their weights' codes into the compute "
          "copies and from the optimizer's step train bit for bit as without") {
  // The layers take the LayerNorm and GELU (SwiGLU) outputs and the dGELU (dSwiGLU) as prologues (the
  // model then stores or recomputes none of them), sum the bias gradient while quantising the output
  // gradient, and run the optimizer's step of their weights fused with the weights' quantisation: on
  // the CPU every value is the one the unfused path computes, so the losses are the same bits.
  test::TempDir dir("fp8-block-fused");
  const std::string shards = test::pattern_corpus(dir);
  const int steps = test::equivalence_step_count(12);
  for (const char* arch : {"gpt2", "llama"}) {
    INFO(arch);
    auto with = [&](std::vector<std::string> sets) {
      sets.insert(sets.end(), {"fp8.enabled=true", "fp8.recipe=block", "backend.cpu_round_bf16=true",
                               std::string("model.arch=") + arch});
      return test::train_losses(shards, steps, sets);
    };
    const auto base = with({});
    REQUIRE(base.size() == static_cast<std::size_t>(steps));
    CHECK(base == with({"model.recompute_norm=false", "model.recompute_gelu=false"}));
    CHECK(base == with({"fp8.fuse_weight_update=false"}));
    CHECK(base == with({"activation_checkpoint.mode=full"}));
  }
  // The codes made from the f32 master in the compute copy's memory, or from the compute copy in
  // buffers of their own: the same values where the compute copy is the master (no bf16 rounding).
  const std::vector<std::string> block = {"fp8.enabled=true", "fp8.recipe=block"};
  auto more = block;
  more.push_back("fp8.weights_in_compute_copy=false");
  CHECK(test::train_losses(shards, steps, block) == test::train_losses(shards, steps, more));
}
