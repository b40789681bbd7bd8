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

TEST_CASE("a CUDA training step matches the CPU reference step") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  for (const char* dropout : {"0.0", "0.1"}) {
    test::Pipeline cpu(kModel, {"engine.device=cpu", "backend.cpu_round_bf16=true", std::string("model.dropout=") + dropout});
    test::Pipeline gpu(kModel, {"engine.device=cuda", std::string("model.dropout=") + dropout});
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
    INFO("dropout " << dropout << " losses cpu " << losses[0][0] << " gpu " << losses[1][0]);
    CHECK(losses[1][0] == doctest::Approx(losses[0][0]).epsilon(5e-3));
    double num = 0, den = 0;
    for (std::size_t k = 0; k < grads[0].size(); ++k) {
      num += double(grads[1][k] - grads[0][k]) * (grads[1][k] - grads[0][k]);
      den += double(grads[0][k]) * grads[0][k];
    }
    INFO("gradient relative error " << std::sqrt(num / den));
    CHECK(std::sqrt(num / den) < 3e-2);  // bf16 activations, different summation orders
    for (std::size_t s = 0; s < losses[0].size(); ++s) CHECK(losses[1][s] == doctest::Approx(losses[0][s]).epsilon(2e-2));
  }
}

TEST_CASE("CUDA weight initialisation is bit-identical to the CPU's") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  test::Pipeline cpu(kModel, {"engine.device=cpu"});
  test::Pipeline gpu(kModel, {"engine.device=cuda"});
  for (auto* p : {&cpu, &gpu}) p->world->systems().run(Phase::setup, *p->world);
  auto master = [](World& w) {
    auto& be = w.resource<ops::ActiveBackend>().get();
    auto flat = w.resource<nn::ParamStore>().master_flat();
    std::vector<float> h(static_cast<std::size_t>(flat.numel()));
    be.copy(TensorView(h.data(), {flat.numel()}, DType::f32, Device::cpu), flat);
    return h;
  };
  CHECK(master(*cpu.world) == master(*gpu.world));
}
