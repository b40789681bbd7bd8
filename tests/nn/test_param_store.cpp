// ParamStore: one flat f32 master buffer, a compute copy and f32 gradients of the same layout; a
// parameter is a view at its offset in each.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kiln/core/error.hpp"
#include "kiln/nn/param_store.hpp"

using namespace kiln;

namespace {

// Registers a parameter (the store lays it out later, as a model's does in Phase::setup).
nn::Param& add_param(World& w, nn::ParamStore& store, std::string name, Shape shape, bool decay = false, int unit = 0) {
  nn::Param p;
  p.name = std::move(name);
  p.shape = p.global_shape = shape;
  p.weight_decay = decay;
  p.unit = unit;
  return w.get<nn::Param>(store.add(w, std::move(p)));
}

// Lays the store out and gives it host buffers of what it holds.
void allocate(World& w, nn::ParamStore& store, DType act) {
  store.lay_out(w);
  const auto n = static_cast<std::size_t>(store.held());
  store.allocate({Buffer(Device::cpu, n * 4), Buffer(Device::cpu, n * size_of(act)), Buffer(Device::cpu, n * 4), act,
                  nullptr});
}

std::ptrdiff_t byte_offset(const TensorView& v, const TensorView& flat) {
  return static_cast<const char*>(v.data) - static_cast<const char*>(flat.data);
}

}  // namespace

TEST_CASE("a parameter's views sit at its offset in the master, gradient and compute buffers") {
  World w;
  nn::ParamStore store;
  add_param(w, store, "wte", {10, 7}, true);
  const nn::Param& b = add_param(w, store, "ln.bias", {7});
  allocate(w, store, DType::bf16);
  REQUIRE(b.offset == 128);  // 70 elements rounded up to two alignment units

  const TensorView m = store.master_view(b), g = store.grad_view(b), c = store.compute_view(b);
  CHECK(byte_offset(m, store.master_flat()) == 128 * 4);
  CHECK(byte_offset(g, store.grads_flat()) == 128 * 4);
  CHECK(byte_offset(c, store.compute_flat()) == 128 * 2);
  CHECK(m.dtype == DType::f32);
  CHECK(g.dtype == DType::f32);
  CHECK(c.dtype == DType::bf16);
  for (const TensorView* v : {&m, &g, &c}) {
    CHECK(v->shape == Shape{7});
    CHECK(v->contiguous());
    CHECK(v->device == Device::cpu);
  }
}

TEST_CASE("writing through a parameter's view changes the flat buffer at its offset and nothing else") {
  World w;
  nn::ParamStore store;
  add_param(w, store, "a", {3, 5});
  const nn::Param& p = add_param(w, store, "b", {2, 33});
  add_param(w, store, "c", {4});
  allocate(w, store, DType::f32);
  float* flat = store.grads_flat().as<float>();
  for (std::int64_t i = 0; i < store.total(); ++i) flat[i] = -1;

  std::mt19937 gen(17);
  std::normal_distribution<float> normal;
  std::vector<float> values(static_cast<std::size_t>(p.numel));
  for (auto& v : values) v = normal(gen);
  TensorView g = store.grad_view(p);
  for (std::int64_t i = 0; i < p.numel; ++i) g.as<float>()[i] = values[static_cast<std::size_t>(i)];

  for (std::int64_t i = 0; i < store.total(); ++i) {
    const bool inside = i >= p.offset && i < p.offset + p.numel;
    if (inside)
      REQUIRE(flat[i] == values[static_cast<std::size_t>(i - p.offset)]);
    else
      REQUIRE(flat[i] == -1);
  }
}

TEST_CASE("the flat views span the whole store, alignment padding included") {
  World w;
  nn::ParamStore store;
  add_param(w, store, "a", {5});
  add_param(w, store, "b", {65});
  allocate(w, store, DType::bf16);
  CHECK(store.total() == 64 + 128);
  CHECK(store.master_flat().shape == Shape{store.total()});
  CHECK(store.master_flat().data == store.master_flat().data);
  CHECK(store.master_flat().dtype == DType::f32);
  CHECK(store.grads_flat().shape == Shape{store.total()});
  CHECK(store.grads_flat().data == store.grads_flat().data);
  CHECK(store.compute_flat().shape == Shape{store.total()});
  CHECK(store.compute_flat().dtype == DType::bf16);
  CHECK(store.compute_flat().bytes() == static_cast<std::size_t>(store.total()) * 2);
}

TEST_CASE("view_in places a parameter in any buffer laid out like the store") {
  World w;
  nn::ParamStore store;
  add_param(w, store, "a", {100});
  const nn::Param& p = add_param(w, store, "b", {3, 4});
  store.lay_out(w);
  std::vector<float> moments(static_cast<std::size_t>(store.total()));
  const TensorView flat(moments.data(), {store.total()}, DType::f32, Device::cpu);
  const TensorView v = nn::ParamStore::view_in(flat, p);
  CHECK(v.data == moments.data() + p.offset);
  CHECK(v.shape == Shape{3, 4});
  CHECK(v.dtype == DType::f32);
  CHECK(v.contiguous());
  // The element size is the flat buffer's: a bf16 buffer of the same layout.
  std::vector<std::uint16_t> half(static_cast<std::size_t>(store.total()));
  const TensorView hv = nn::ParamStore::view_in(TensorView(half.data(), {store.total()}, DType::bf16, Device::cpu), p);
  CHECK(hv.data == half.data() + p.offset);
  CHECK(hv.dtype == DType::bf16);
}

TEST_CASE("offsets at multiples of kParamAlign give 256-byte aligned f32 and 128-byte aligned bf16 views") {
  static_assert(nn::kParamAlign * 4 == 256 && nn::kParamAlign * 2 == 128);
  World w;
  nn::ParamStore store;
  std::mt19937 gen(99);
  std::uniform_int_distribution<std::int64_t> size(1, 300);
  for (int i = 0; i < 20; ++i) add_param(w, store, "p" + std::to_string(i), {size(gen)});
  allocate(w, store, DType::bf16);
  for (Entity e : store.order()) {
    const auto& p = w.get<nn::Param>(e);
    CAPTURE(p.name);
    CHECK(p.offset % nn::kParamAlign == 0);
    CHECK(byte_offset(store.master_view(p), store.master_flat()) % 256 == 0);
    CHECK(byte_offset(store.grad_view(p), store.grads_flat()) % 256 == 0);
    CHECK(byte_offset(store.compute_view(p), store.compute_flat()) % 128 == 0);
    CHECK(reinterpret_cast<std::uintptr_t>(store.master_view(p).data) % 64 == 0);  // host buffers are 64-byte aligned
  }
}

TEST_CASE("a parameter reaching past the store's buffers is an error") {
  World w;
  nn::ParamStore store;
  nn::Param& p = add_param(w, store, "a", {64});
  allocate(w, store, DType::f32);
  p.offset = 1;  // a layout the buffers were not made for
  CHECK_THROWS_WITH_AS(store.master_view(p), doctest::Contains("exceeds a buffer"), Error);
  CHECK_THROWS_AS(store.grad_view(p), Error);
}

TEST_CASE("the layout puts units in ascending order, each padded to a multiple of kParamAlign x shards") {
  World w;
  nn::ParamStore store;
  store.shard_over(4, 0);
  const nn::Param& c = add_param(w, store, "c", {10}, false, 2);  // created first, laid out last
  const nn::Param& a = add_param(w, store, "a", {70}, false, 0);
  const nn::Param& b = add_param(w, store, "b", {3}, false, 0);
  store.lay_out(w);
  CHECK(a.offset == 0);
  CHECK(b.offset == 128);
  REQUIRE(store.num_units() == 3);
  CHECK(store.unit(0).begin == 0);
  CHECK(store.unit(0).end == 256);  // 192 elements padded to a multiple of 64 x 4
  CHECK(store.unit(1).size() == 0);  // no parameter in unit 1
  CHECK(store.unit(2).begin == 256);
  CHECK(c.offset == 256);
  CHECK(store.total() == 512);
  CHECK(store.held() == 128);
}

TEST_CASE("the shards of every rank hold each parameter's elements exactly once, each run at its held offset") {
  std::mt19937 gen(5);
  std::uniform_int_distribution<std::int64_t> size(1, 500);
  for (int shards : {1, 2, 3, 4}) {
    CAPTURE(shards);
    std::vector<std::vector<int>> seen;  // per parameter: how often each element is held
    std::vector<std::int64_t> numels;
    for (int shard = 0; shard < shards; ++shard) {
      World w;
      nn::ParamStore store;
      store.shard_over(shards, shard);
      std::mt19937 sizes(11);
      for (int i = 0; i < 12; ++i) {
        add_param(w, store, "p" + std::to_string(i), {size(sizes)}, false, i / 3);
        if (i % 4 == 1) w.emplace<nn::ByteCompute>(store.order().back());  // gathered as bytes, laid out apart
      }
      store.lay_out(w);
      if (seen.empty())
        for (Entity e : store.order()) {
          numels.push_back(w.get<nn::Param>(e).numel);
          seen.emplace_back(static_cast<std::size_t>(numels.back()), 0);
        }
      std::vector<int> held_used(static_cast<std::size_t>(store.held()), 0);
      for (std::size_t i = 0; i < store.order().size(); ++i) {
        const auto& p = w.get<nn::Param>(store.order()[i]);
        int runs = 0;
        // The parameter's group: the one-byte compute copies first in a sharded store.
        const auto groups = store.groups(p.unit);
        const nn::UnitGroup* g = nullptr;
        for (const auto& x : groups)
          if (p.offset >= x.begin && p.offset < x.begin + x.count) g = &x;
        REQUIRE(g);
        CHECK(g->bytes == (shards > 1 && w.has<nn::ByteCompute>(store.order()[i])));
        const std::int64_t part_size = g->count / shards, first = g->begin + shard * part_size;
        store.for_each_held(p, [&](const nn::HeldPart& part) {
          ++runs;
          // The run's layout elements are this shard's part of the group, at the matching held place.
          CHECK(p.offset + part.first >= first);
          CHECK(p.offset + part.first + part.count <= first + part_size);
          CHECK(part.held == g->held + (p.offset + part.first - first));
          CHECK(g->held == g->begin / shards);  // one domain: the parts of every group before it
          for (std::int64_t k = 0; k < part.count; ++k) {
            ++seen[i][static_cast<std::size_t>(part.first + k)];
            ++held_used[static_cast<std::size_t>(part.held + k)];
          }
        });
        CHECK(runs <= 1);
      }
      for (int u : held_used) CHECK(u <= 1);  // no two runs share a held element
    }
    for (const auto& counts : seen)
      for (int c : counts) CHECK(c == 1);
  }
}

TEST_CASE("the gradient zeroing ranges leave out the gradients their first micro-batch writes, per unit") {
  World w;
  nn::ParamStore store;
  add_param(w, store, "ln", {10}, false, 0);
  const nn::Param& weight = add_param(w, store, "w", {4, 32}, true, 0);
  add_param(w, store, "bias", {4}, false, 0);
  add_param(w, store, "w2", {64}, true, 1);
  for (Entity e : store.order())
    if (w.get<nn::Param>(e).name == "w" || w.get<nn::Param>(e).name == "w2") w.emplace<nn::GradWrittenFirst>(e);
  store.lay_out(w);
  const auto ranges = store.grad_zero_ranges(w);
  REQUIRE(ranges.size() == 2);
  // Unit 0: ln (and its padding) before w, then bias and the unit's padding after it.
  REQUIRE(ranges[0].size() == 2);
  CHECK(ranges[0][0].begin == 0);
  CHECK(ranges[0][0].end == weight.offset);
  CHECK(ranges[0][1].begin == weight.offset + weight.numel);
  CHECK(ranges[0][1].end == store.unit(0).size());
  CHECK(ranges[1].empty());  // w2 fills its unit
}

TEST_CASE("a sharded store's whole master views are refused, its units are where someone puts them") {
  World w;
  nn::ParamStore store;
  store.shard_over(2, 0);
  const nn::Param& p = add_param(w, store, "a", {100}, false, 0);
  allocate(w, store, DType::f32);
  CHECK(store.held() == 64);
  CHECK_THROWS_WITH(store.master_view(p), doctest::Contains("sharded over 2 ranks"));
  CHECK_THROWS_WITH(store.compute_view(p), doctest::Contains("not on this rank now"));
  std::vector<float> gathered(static_cast<std::size_t>(store.unit(0).size()));
  store.place_unit_compute(0, gathered.data());
  CHECK(store.compute_view(p).data == gathered.data());
}
