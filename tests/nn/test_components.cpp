// The components modules attach to a network's entities, and the events they exchange through the
// World's bus.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "kiln/engine/world.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/nn/events.hpp"

using namespace kiln;

namespace {
Entity param_entity(World& w, const std::string& name, bool decay = false) {
  const Entity e = w.create(name);
  nn::Param p;
  p.name = name;
  p.weight_decay = decay;
  w.emplace<nn::Param>(e, std::move(p));
  return e;
}
}  // namespace

TEST_CASE("parameters are found by view<Param>() in creation order, whatever order their components came in") {
  World w;
  const Entity a = w.create("a"), layer = w.create("layer"), b = w.create("b"), c = w.create("c");
  w.emplace<nn::Param>(c).name = "c";
  w.emplace<nn::Layer>(layer, nn::Layer{1, 0, nn::LayerKind::block, {a, b, c}});
  w.emplace<nn::Param>(a).name = "a";
  w.emplace<nn::Param>(b).name = "b";
  CHECK(w.view<nn::Param>() == std::vector<Entity>{a, b, c});
  CHECK(w.view<nn::Layer>() == std::vector<Entity>{layer});
  CHECK(w.get<nn::Layer>(layer).params == std::vector<Entity>{a, b, c});
  std::vector<std::string> names;
  w.each<nn::Param>([&](Entity, nn::Param& p) { names.push_back(p.name); });
  CHECK(names == std::vector<std::string>{"a", "b", "c"});
}

TEST_CASE("GradWrittenFirst and UpdatedBy mark the parameters other modules treat specially") {
  World w;
  const Entity wte = param_entity(w, "wte", true);
  const Entity fc = param_entity(w, "blocks.0.mlp.fc.weight", true);
  const Entity bias = param_entity(w, "blocks.0.mlp.fc.bias");
  const Entity proj = param_entity(w, "blocks.0.mlp.proj.weight", true);
  w.emplace<nn::GradWrittenFirst>(fc);
  w.emplace<nn::GradWrittenFirst>(proj);
  w.emplace<nn::UpdatedBy>(proj, nn::UpdatedBy{"fp8"});
  CHECK(w.view<nn::Param, nn::GradWrittenFirst>() == std::vector<Entity>{fc, proj});
  CHECK(w.view<nn::Param, nn::UpdatedBy>() == std::vector<Entity>{proj});
  CHECK(w.get<nn::UpdatedBy>(proj).module == "fp8");
  CHECK_FALSE(w.has<nn::UpdatedBy>(wte));
  CHECK_FALSE(w.has<nn::GradWrittenFirst>(bias));
  w.remove<nn::UpdatedBy>(proj);
  CHECK(w.view<nn::Param, nn::UpdatedBy>().empty());
}

TEST_CASE("a parameter's defaults describe an unsharded tensor without decay") {
  nn::Param p;
  CHECK_FALSE(p.shard.sharded());
  CHECK_FALSE(p.weight_decay);
  CHECK_FALSE(p.tp_partial_grad);
  CHECK(p.offset == 0);
  CHECK(p.numel == 0);
  nn::ActivationRecompute r;
  CHECK(r.scope == nn::RecomputeScope::full);
  CHECK_FALSE(r.distribute_input);
}

TEST_CASE("layer events reach their subscribers through the World's bus, in publication order") {
  World w;
  std::vector<std::string> seen;
  auto fb = w.events().subscribe<nn::LayerForwardBegin>(
      [&](const nn::LayerForwardBegin& e) { seen.push_back("fwd+" + std::to_string(e.unit)); });
  auto fe = w.events().subscribe<nn::LayerForwardEnd>(
      [&](const nn::LayerForwardEnd& e) { seen.push_back("fwd-" + std::to_string(e.unit)); });
  auto be = w.events().subscribe<nn::LayerBackwardEnd>(
      [&](const nn::LayerBackwardEnd& e) { seen.push_back("bwd-" + std::to_string(e.unit)); });
  for (int unit = 0; unit < 3; ++unit) {
    w.events().publish(nn::LayerForwardBegin{unit});
    w.events().publish(nn::LayerForwardEnd{unit});
  }
  for (int unit = 2; unit >= 0; --unit) w.events().publish(nn::LayerBackwardEnd{unit});
  w.events().publish(nn::LayerRecomputeBegin{1});  // nobody listens: dropped
  CHECK(seen == std::vector<std::string>{"fwd+0", "fwd-0", "fwd+1", "fwd-1", "fwd+2", "fwd-2", "bwd-2", "bwd-1",
                                         "bwd-0"});
}

TEST_CASE("queued layer events wait for the World's next drain") {
  World w;
  std::vector<int> units;
  auto sub = w.events().subscribe<nn::LayerBackwardEnd>([&](const nn::LayerBackwardEnd& e) { units.push_back(e.unit); });
  w.events().enqueue(nn::LayerBackwardEnd{4});
  w.events().enqueue(nn::LayerBackwardEnd{3});
  CHECK(units.empty());
  CHECK(w.events().drain() == 2);
  CHECK(units == std::vector<int>{4, 3});
  sub.reset();
  w.events().publish(nn::LayerBackwardEnd{2});
  CHECK(units.size() == 2);
}

TEST_CASE("an AdamWStep event carries the step's hyperparameters and the moment buffers") {
  World w;
  std::vector<float> m(128), v(128);
  nn::AdamWStep got;
  int calls = 0;
  auto sub = w.events().subscribe<nn::AdamWStep>([&](const nn::AdamWStep& e) {
    got = e;
    ++calls;
  });
  const float scalars[4] = {3e-4f, 0.25f, 0.5f, 0.75f};
  w.events().publish(nn::AdamWStep{7, 3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, scalars,
                                   TensorView(m.data(), {128}, DType::f32, Device::cpu),
                                   TensorView(v.data(), {128}, DType::f32, Device::cpu)});
  REQUIRE(calls == 1);
  CHECK(got.step == 7);
  CHECK(got.lr == 3e-4f);
  CHECK(got.beta1 == 0.9f);
  CHECK(got.beta2 == 0.95f);
  CHECK(got.eps == 1e-8f);
  CHECK(got.weight_decay == 0.1f);
  CHECK(got.scalars == scalars);
  CHECK(got.m.data == m.data());
  CHECK(got.v.data == v.data());
  CHECK(got.m.shape == Shape{128});
}
