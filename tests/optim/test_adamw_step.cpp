// The optimizer module's step on one CPU rank, against the AdamW formula (ops::adamw_update) applied
// to the toy model's weights and gradients on the host.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "kiln/core/error.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/ops/formulas.hpp"
#include "toy_model.hpp"

using namespace kiln;
using test::toy_world;

namespace {

const test::ToyModelConfig& model_of(World& w) { return w.resource<test::ToyModelConfig>(); }
std::int64_t steps_of(World& w) { return w.resource<train::TrainConfig>().steps; }

const nn::Param& param(World& w, std::size_t index) {
  return w.get<nn::Param>(w.resource<nn::ParamStore>().order()[index]);
}

// Element-by-element equality of a parameter's weights and moments with the reference.
void check_equals_reference(World& w, std::size_t index, const test::AdamWReference& ref) {
  const auto& store = w.resource<nn::ParamStore>();
  const auto& st = w.resource<optim::OptimState>();
  const auto& p = param(w, index);
  CAPTURE(p.name);
  const auto master = test::to_vector(store.master_view(p));
  const auto compute = test::to_vector(store.compute_view(p));
  const auto m = test::to_vector(nn::ParamStore::view_in(st.m.view(DType::f32, {store.total()}), p));
  const auto v = test::to_vector(nn::ParamStore::view_in(st.v.view(DType::f32, {store.total()}), p));
  REQUIRE(master.size() == ref.p.size());
  int differing = 0;
  for (std::size_t k = 0; k < ref.p.size(); ++k)
    differing += master[k] != ref.p[k] || compute[k] != ref.p[k] || m[k] != ref.m[k] || v[k] != ref.v[k];
  CHECK(differing == 0);
}

std::vector<float> initial_weights(World& w, std::size_t index) {
  const auto& p = param(w, index);
  return test::toy_values(model_of(w).seed, index, 0, p.numel);
}

}  // namespace

TEST_CASE("AdamW steps over the flat buffer equal adamw_update element by element, with decay only where a parameter decays") {
  auto w = toy_world();
  run_pipeline(*w);
  const auto& oc = w->resource<optim::OptimConfig>();
  REQUIRE(w->resource<optim::OptimState>().steps_taken == 3);
  REQUIRE(oc.weight_decay > 0);
  for (std::size_t i = 0; i < test::toy_params(model_of(*w).width).size(); ++i)
    check_equals_reference(*w, i, test::adamw_reference(model_of(*w), oc, steps_of(*w), i, {1, 1, 1}));
  // The decay made a difference: a decaying parameter stepped without it ends elsewhere.
  auto no_decay = oc;
  no_decay.weight_decay = 0;
  const auto undecayed = test::adamw_reference(model_of(*w), no_decay, steps_of(*w), 0, {1, 1, 1});
  CHECK(test::to_vector(w->resource<nn::ParamStore>().master_view(param(*w, 0))) != undecayed.p);
}

TEST_CASE("the alignment padding between parameters is never updated") {
  auto w = toy_world();
  run_pipeline(*w);
  const auto& store = w->resource<nn::ParamStore>();
  const float* master = store.master_flat().as<float>();
  std::int64_t at = 0, padding = 0;
  for (Entity e : store.order()) {
    const auto& p = w->get<nn::Param>(e);
    for (; at < p.offset; ++at, ++padding) REQUIRE(master[at] == 0.0f);
    at = p.offset + p.numel;
  }
  for (; at < store.total(); ++at, ++padding) REQUIRE(master[at] == 0.0f);
  CHECK(padding > 0);
}

TEST_CASE("gradient clipping scales the gradient by grad_clip / norm") {
  // eps comparable to the clipped gradients, so that the scale shows in the update.
  auto w = toy_world({"model.grad_gain=50", "optim.grad_clip=1", "optim.eps=0.05", "train.steps=1"});
  std::vector<nn::AdamWStep> events;
  auto sub = w->events().subscribe<nn::AdamWStep>([&](const nn::AdamWStep& e) { events.push_back(e); });
  run_pipeline(*w);
  REQUIRE(events.size() == 1);
  const double norm = test::toy_grad_norm(model_of(*w), 1);
  REQUIRE(norm > 100);
  CHECK(w->resource<train::TrainState>().grad_norm == doctest::Approx(norm).epsilon(1e-6));
  CHECK(events[0].scalars[ops::kAdamWGradScale] == doctest::Approx(1.0 / norm).epsilon(1e-5));
  const auto& oc = w->resource<optim::OptimConfig>();
  for (std::size_t i = 0; i < 5; ++i)
    check_equals_reference(*w, i, test::adamw_reference(model_of(*w), oc, 1, i, {events[0].scalars[ops::kAdamWGradScale]}));
  const auto unclipped = test::adamw_reference(model_of(*w), oc, 1, 0, {1.0f});
  CHECK(test::to_vector(w->resource<nn::ParamStore>().master_view(param(*w, 0))) != unclipped.p);
}

TEST_CASE("a gradient norm below grad_clip is not scaled") {
  auto w = toy_world({"model.grad_gain=0.01", "optim.grad_clip=1", "train.steps=1"});
  std::vector<float> scales;
  auto sub = w->events().subscribe<nn::AdamWStep>([&](const nn::AdamWStep& e) { scales.push_back(e.scalars[ops::kAdamWGradScale]); });
  run_pipeline(*w);
  REQUIRE(test::toy_grad_norm(model_of(*w), 1) < 1);
  CHECK(scales == std::vector<float>{1.0f});
}

TEST_CASE("grad_clip = 0 never scales the gradient") {
  auto w = toy_world({"model.grad_gain=50", "optim.grad_clip=0", "train.steps=2"});
  std::vector<float> scales;
  auto sub = w->events().subscribe<nn::AdamWStep>([&](const nn::AdamWStep& e) { scales.push_back(e.scalars[ops::kAdamWGradScale]); });
  run_pipeline(*w);
  CHECK(scales == std::vector<float>{1.0f, 1.0f});
  CHECK(w->resource<train::TrainState>().grad_norm == doctest::Approx(test::toy_grad_norm(model_of(*w), 2)).epsilon(1e-6));
}

TEST_CASE("a non-finite gradient stops the step with an error naming the parameter, before any update") {
  auto w = toy_world({"model.non_finite_grad=proj.bias"});
  try {
    run_pipeline(*w);
    FAIL("expected the step to stop");
  } catch (const Error& e) {
    const std::string m = e.what();
    CHECK(m.find("step 1: non-finite gradient in 'proj.bias'") != std::string::npos);
    CHECK(m.find("qkv.weight") == std::string::npos);
    CHECK(m.find("ln.weight") == std::string::npos);
  }
  CHECK(w->resource<optim::OptimState>().steps_taken == 0);
  for (std::size_t i = 0; i < 5; ++i)
    CHECK(test::to_vector(w->resource<nn::ParamStore>().master_view(param(*w, i))) == initial_weights(*w, i));
}

TEST_CASE("parameters marked UpdatedBy are left alone by the optimizer") {
  auto w = toy_world({"model.updated_elsewhere=proj.weight"});
  run_pipeline(*w);
  const auto& oc = w->resource<optim::OptimConfig>();
  const auto& store = w->resource<nn::ParamStore>();
  const auto& st = w->resource<optim::OptimState>();
  const auto& proj = param(*w, 2);
  REQUIRE(proj.name == "proj.weight");
  CHECK(test::to_vector(store.master_view(proj)) == initial_weights(*w, 2));
  CHECK(test::to_vector(store.compute_view(proj)) == initial_weights(*w, 2));
  const auto m = test::to_vector(nn::ParamStore::view_in(st.m.view(DType::f32, {store.total()}), proj));
  CHECK(m == std::vector<float>(m.size(), 0.0f));
  for (std::size_t i : {0u, 1u, 3u, 4u})
    check_equals_reference(*w, i, test::adamw_reference(model_of(*w), oc, steps_of(*w), i, {1, 1, 1}));
}

TEST_CASE("each step publishes AdamWStep with that step's hyperparameters and the moment buffers") {
  auto w = toy_world({"optim.beta1=0.8", "optim.beta2=0.99", "optim.eps=1e-6", "optim.weight_decay=0.05"});
  std::vector<nn::AdamWStep> events;
  auto sub = w->events().subscribe<nn::AdamWStep>([&](const nn::AdamWStep& e) { events.push_back(e); });
  run_pipeline(*w);
  const auto& oc = w->resource<optim::OptimConfig>();
  const auto& store = w->resource<nn::ParamStore>();
  const auto& st = w->resource<optim::OptimState>();
  REQUIRE(events.size() == 3);
  for (std::size_t s = 0; s < 3; ++s) {
    const auto& e = events[s];
    CAPTURE(s);
    CHECK(e.step == static_cast<std::int64_t>(s + 1));
    CHECK(e.lr == static_cast<float>(optim::learning_rate(oc, e.step, 3)));
    CHECK(e.beta1 == 0.8f);
    CHECK(e.beta2 == 0.99f);
    CHECK(e.eps == 1e-6f);
    CHECK(e.weight_decay == 0.05f);
    CHECK(e.scalars == static_cast<const float*>(st.scalars.data()));  // read when the kernels run
    CHECK(e.m.data == st.m.data());
    CHECK(e.v.data == st.v.data());
    CHECK(e.m.shape == Shape{store.total()});
    CHECK(e.v.dtype == DType::f32);
  }
  CHECK(st.grad_scale == 1.0f);
  CHECK(events[0].lr < events[1].lr);  // warm-up
  CHECK(w->resource<train::TrainState>().lr == events[2].lr);
}

TEST_CASE("a handler applying AdamWStep to a parameter marked UpdatedBy reproduces the optimizer's own update") {
  auto w = toy_world({"model.updated_elsewhere=qkv.weight", "model.grad_gain=50", "optim.grad_clip=1",
                      "optim.eps=0.05"});
  // What a module that takes over a parameter's update does (the fp8 module fuses it with its
  // quantisation): the formula with the event's hyperparameters on the parameter's own segment.
  auto sub = w->events().subscribe<nn::AdamWStep>([&world = *w](const nn::AdamWStep& e) {
    auto& store = world.resource<nn::ParamStore>();
    for (Entity ent : world.view<nn::Param, nn::UpdatedBy>()) {
      const auto& p = world.get<nn::Param>(ent);
      float* x = store.master_view(p).as<float>();
      float* xc = store.compute_view(p).as<float>();
      const float* g = store.grad_view(p).as<float>();
      float* m = nn::ParamStore::view_in(e.m, p).as<float>();
      float* v = nn::ParamStore::view_in(e.v, p).as<float>();
      float bc1 = 0, bc2 = 0;
      ops::adamw_bias_corrections(e.beta1, e.beta2, e.step, bc1, bc2);
      for (std::int64_t k = 0; k < p.numel; ++k) {
        ops::adamw_update(x[k], m[k], v[k], g[k] * e.scalars[ops::kAdamWGradScale], e.lr, e.beta1, e.beta2, e.eps,
                          p.weight_decay ? e.weight_decay : 0.0f, bc1, bc2);
        xc[k] = x[k];
      }
    }
  });
  std::vector<float> scales;
  auto record = w->events().subscribe<nn::AdamWStep>([&](const nn::AdamWStep& e) { scales.push_back(e.scalars[ops::kAdamWGradScale]); });
  run_pipeline(*w);
  REQUIRE(scales.size() == 3);
  CHECK(scales[0] < 1.0f);
  check_equals_reference(*w, 0, test::adamw_reference(model_of(*w), w->resource<optim::OptimConfig>(), 3, 0, scales));
}
