// The whole training step on CUDA against the CPU reference backend (which emulates bf16 rounding):
// same seed, so bit-identical initial weights; then loss and gradients within bf16 tolerance, and
// a few optimizer steps whose losses track each other.
#include <doctest/doctest.h>

#include <cmath>

#include "kiln/engine/engine_module.hpp"
#include "kiln/model/gpt.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"
#include "kiln_test.hpp"
#include "model_fixture.hpp"

using namespace kiln;

namespace {
const char* const kModel = test::kSmallGpuModel;
}  // namespace

TEST_CASE("a CUDA training step matches the CPU reference step (GPT-2; Llama with grouped and multi-head attention)") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  const std::vector<std::vector<std::string>> archs = {
      {},
      {"model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=320", "model.tie_embeddings=false"},
      {"model.arch=llama", "model.n_kv_head=4", "model.rope_theta=500000"}};
  for (const auto& arch : archs)
  for (const char* dropout : {"0.0", "0.1"}) {
    auto sets = [&](std::vector<std::string> s) {
      s.insert(s.end(), arch.begin(), arch.end());
      s.push_back(std::string("model.dropout=") + dropout);
      return s;
    };
    test::Pipeline cpu(kModel, sets({"engine.device=cpu", "backend.cpu_round_bf16=true"}));
    test::Pipeline gpu(kModel, sets({"engine.device=cuda"}));
    std::string what;
    for (const auto& s : sets({})) what += s + " ";
    std::vector<double> losses[2];
    std::vector<float> grads[2];
    int i = 0;
    for (auto* p : {&cpu, &gpu}) {
      auto& w = *p->world;
      auto* out = &losses[i];
      auto* g = &grads[i];
      w.systems().add({"test.grads", Phase::grad_sync, [g](World& world) {
                         if (world.resource<RunControl>().step == 1) *g = test::grads_of(world);
                       },
                       {"model.loss"}});
      w.systems().add({"test.loss", Phase::step_end,
                       [out](World& world) { out->push_back(world.resource<train::TrainState>().loss); },
                       {"train.step_end"}});
      p->run();
      ++i;
    }
    // Initial weights are identical (init draws are bit-identical), so step 1's loss agrees closely.
    INFO(what << "losses cpu " << losses[0][0] << " gpu " << losses[1][0]);
    CHECK(losses[1][0] == doctest::Approx(losses[0][0]).epsilon(5e-3));
    double num = 0, den = 0;
    for (std::size_t k = 0; k < grads[0].size(); ++k) {
      num += double(grads[1][k] - grads[0][k]) * (grads[1][k] - grads[0][k]);
      den += double(grads[0][k]) * grads[0][k];
    }
    INFO(what << "gradient relative error " << std::sqrt(num / den));
    CHECK(std::sqrt(num / den) < 3e-2);  // bf16 activations, different summation orders
    for (std::size_t s = 0; s < losses[0].size(); ++s) CHECK(losses[1][s] == doctest::Approx(losses[0][s]).epsilon(2e-2));
  }
}

TEST_CASE("a CUDA mixture-of-experts training step matches the CPU reference step (GELU and SwiGLU experts)") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  // A few tokens may choose another expert on one backend (bf16 against f32 activations near a tie):
  // the gradients agree more loosely than a dense model's.
  const std::vector<std::vector<std::string>> configs = {
      {"model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.hidden=256", "model.moe.capacity_factor=1.5"},
      {"model.arch=llama", "model.n_kv_head=2", "model.tie_embeddings=false", "model.moe.n_experts=8",
       "model.moe.top_k=2", "model.moe.hidden=192", "model.moe.shared_experts=1", "model.moe.expert_dropout=0.1",
       "model.dropout=0.1"},
      {"model.arch=llama", "model.n_kv_head=4", "model.moe.n_experts=6", "model.moe.top_k=3", "model.moe.hidden=128",
       "model.moe.router=sigmoid", "model.moe.every=2"}};
  for (const auto& config : configs) {
    std::string what;
    for (const auto& s : config) what += s + " ";
    auto sets = [&](std::vector<std::string> s) {
      s.insert(s.end(), config.begin(), config.end());
      return s;
    };
    test::Pipeline cpu(kModel, sets({"engine.device=cpu", "backend.cpu_round_bf16=true"}));
    test::Pipeline gpu(kModel, sets({"engine.device=cuda"}));
    std::vector<double> losses[2];
    std::vector<float> grads[2];
    int i = 0;
    for (auto* p : {&cpu, &gpu}) {
      auto& w = *p->world;
      auto* out = &losses[i];
      auto* g = &grads[i];
      w.systems().add({"test.grads", Phase::grad_sync, [g](World& world) {
                         if (world.resource<RunControl>().step == 1) *g = test::grads_of(world);
                       },
                       {"model.loss"}});
      w.systems().add({"test.loss", Phase::step_end,
                       [out](World& world) { out->push_back(world.resource<train::TrainState>().loss); },
                       {"train.step_end"}});
      p->run();
      ++i;
    }
    INFO(what << "losses cpu " << losses[0][0] << " gpu " << losses[1][0]);
    CHECK(losses[1][0] == doctest::Approx(losses[0][0]).epsilon(5e-3));
    double num = 0, den = 0;
    for (std::size_t k = 0; k < grads[0].size(); ++k) {
      num += double(grads[1][k] - grads[0][k]) * (grads[1][k] - grads[0][k]);
      den += double(grads[0][k]) * grads[0][k];
    }
    MESSAGE(what << ": step-1 gradient relative error " << std::sqrt(num / den) << ", loss cpu " << losses[0][0]
                 << " gpu " << losses[1][0]);
    CHECK(std::sqrt(num / den) < 6e-2);
    for (std::size_t s = 0; s < losses[0].size(); ++s) CHECK(losses[1][s] == doctest::Approx(losses[0][s]).epsilon(2e-2));
  }
}

TEST_CASE("CUDA weight initialisation is bit-identical to the CPU's (GPT-2 and Llama)") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  auto master = [](World& w) {
    auto& be = w.resource<ops::ActiveBackend>().get();
    auto flat = w.resource<nn::ParamStore>().master_flat();
    std::vector<float> h(static_cast<std::size_t>(flat.numel()));
    be.copy(TensorView(h.data(), {flat.numel()}, DType::f32, Device::cpu), flat);
    return h;
  };
  for (const std::string arch : {"gpt2", "llama"}) {
    const std::string kv = arch == "llama" ? "model.n_kv_head=2" : "model.n_kv_head=0";
    test::Pipeline cpu(kModel, {"engine.device=cpu", "model.arch=" + arch, kv});
    test::Pipeline gpu(kModel, {"engine.device=cuda", "model.arch=" + arch, kv});
    for (auto* p : {&cpu, &gpu}) p->world->systems().run(Phase::setup, *p->world);
    CHECK(master(*cpu.world) == master(*gpu.world));
  }
}
