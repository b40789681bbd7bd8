// optim.grads = "bf16": the parameters' gradients held in bf16 (nn::ParamStore::set_grad_dtype). Every
// op adds its f32 contribution to a gradient rounded once, so a step's gradients are the f32 run's
// within a few bf16 roundings, and training follows the f32 run closely; the buffer is half the bytes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kiln/nn/param_store.hpp"
#include "kiln_test.hpp"
#include "model_fixture.hpp"

using namespace kiln;

namespace {

const char* kTinyBf16Grads = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 2
[train]
steps = 8
seed = 3
batch_size = 4
seq_len = 32
[model]
n_layer = 2
n_head = 2
n_embd = 32
vocab_size = 64
max_seq_len = 32
[optim]
lr = 3e-3
warmup_steps = 2
[data]
synthetic_vocab = 64
)";

}  // namespace

TEST_CASE("optim.grads = bf16 holds the gradients in bf16 and trains within rounding of f32 gradients") {
  const std::vector<std::vector<std::string>> runs = {
      {},
      {"model.dropout=0.1", "train.micro_batch_size=2"},  // two micro-batches: the second adds to bf16
      {"model.arch=llama", "model.n_kv_head=1"},
      {"fp8.enabled=true"},  // the fused FP8 weight update reads the bf16 gradients
      {"fp8.enabled=true", "fp8.fuse_weight_update=false", "fp8.recipe=current"},
      {"fp8.enabled=true", "fp8.lm_head=true", "model.head_chunk_rows=64"},
      {"activation_checkpoint.mode=full", "model.head_chunk_rows=48"},
  };
  for (const auto& run : runs) {
    INFO(test::joined(run, "(defaults)"));
    auto sets = [&](const char* grads) {
      std::vector<std::string> s = run;
      s.push_back(std::string("optim.grads=") + grads);
      return s;
    };
    test::Pipeline half(kTinyBf16Grads, sets("bf16")), full(kTinyBf16Grads, sets("f32"));
    const test::RunRecord h = test::run_recording(half), f = test::run_recording(full);
    const auto& store = half.world->resource<nn::ParamStore>();
    CHECK(store.grad_dtype() == DType::bf16);
    CHECK(store.grads_flat().bytes() == static_cast<std::size_t>(store.held()) * 2);
    CHECK(full.world->resource<nn::ParamStore>().grads_flat().bytes() == static_cast<std::size_t>(store.held()) * 4);
    // The first step's gradients: element by element within a few bf16 roundings of f32's (an
    // element a few ops add to is rounded once by each), relative to the element or, where it nearly
    // cancels, to the buffer's largest.
    REQUIRE(h.step1_grads.size() == f.step1_grads.size());
    float largest = 0;
    for (float g : f.step1_grads) largest = std::max(largest, std::fabs(g));
    REQUIRE(largest > 0);
    std::size_t off = 0;
    for (std::size_t i = 0; i < f.step1_grads.size(); ++i)
      off += std::fabs(h.step1_grads[i] - f.step1_grads[i]) > 2e-2f * std::fabs(f.step1_grads[i]) + 2e-3f * largest;
    CHECK(off == 0);
    // Training: the losses within 1% of f32's, not the same bits.
    REQUIRE(h.losses.size() == 8);
    REQUIRE(f.losses.size() == 8);
    CHECK(h.losses != f.losses);
    for (std::size_t s = 0; s < h.losses.size(); ++s) CHECK(std::fabs(h.losses[s] - f.losses[s]) < 1e-2 * f.losses[s]);
  }
}

TEST_CASE("optim.grads = bf16 where a layer writes f32 gradients is a config error naming the key") {
  // fp8.recipe = "block" and a mixture of experts' grouped linears write f32 gradients: refused before
  // the first step.
  for (const auto& sets : {std::vector<std::string>{"optim.grads=bf16", "fp8.enabled=true", "fp8.recipe=block"},
                           std::vector<std::string>{"optim.grads=bf16", "model.arch=llama", "model.n_kv_head=1",
                                                    "model.moe.n_experts=4", "model.moe.top_k=2",
                                                    "model.moe.hidden=32"}}) {
    INFO(test::joined(sets));
    test::Pipeline p(kTinyBf16Grads, sets);
    CHECK_THROWS_WITH_AS(p.world->systems().run(Phase::setup, *p.world), doctest::Contains("optim.grads"), ConfigError);
  }
}
