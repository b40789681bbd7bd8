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

// Lays a parameter out after the previous ones, at the next multiple of kParamAlign (as a model
// does), and records it as an entity.
nn::Param& add_param(World& w, nn::ParamStore& store, std::string name, Shape shape, bool decay = false) {
  const Entity e = w.create(name);
  auto& p = w.emplace<nn::Param>(e);
  p.name = std::move(name);
  p.shape = p.global_shape = shape;
  p.numel = shape.numel();
  p.offset = store.total;
  p.weight_decay = decay;
  store.total += (p.numel + nn::kParamAlign - 1) / nn::kParamAlign * nn::kParamAlign;
  store.order.push_back(e);
  return p;
}

void allocate(nn::ParamStore& store, DType act) {
  store.act = act;
  store.master = Buffer(Device::cpu, static_cast<std::size_t>(store.total) * 4);
  store.compute = Buffer(Device::cpu, static_cast<std::size_t>(store.total) * size_of(act));
  store.grads = Buffer(Device::cpu, static_cast<std::size_t>(store.total) * 4);
}

std::ptrdiff_t byte_offset(const TensorView& v, const Buffer& b) {
  return static_cast<const char*>(v.data) - static_cast<const char*>(b.data());
}

}  // namespace

TEST_CASE("a parameter's views sit at its offset in the master, gradient and compute buffers") {
  World w;
  nn::ParamStore store;
  add_param(w, store, "wte", {10, 7}, true);
  const nn::Param& b = add_param(w, store, "ln.bias", {7});
  allocate(store, DType::bf16);
  REQUIRE(b.offset == 128);  // 70 elements rounded up to two alignment units

  const TensorView m = store.master_view(b), g = store.grad_view(b), c = store.compute_view(b);
  CHECK(byte_offset(m, store.master) == 128 * 4);
  CHECK(byte_offset(g, store.grads) == 128 * 4);
  CHECK(byte_offset(c, store.compute) == 128 * 2);
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
  allocate(store, DType::f32);
  float* flat = store.grads_flat().as<float>();
  for (std::int64_t i = 0; i < store.total; ++i) flat[i] = -1;

  std::mt19937 gen(17);
  std::normal_distribution<float> normal;
  std::vector<float> values(static_cast<std::size_t>(p.numel));
  for (auto& v : values) v = normal(gen);
  TensorView g = store.grad_view(p);
  for (std::int64_t i = 0; i < p.numel; ++i) g.as<float>()[i] = values[static_cast<std::size_t>(i)];

  for (std::int64_t i = 0; i < store.total; ++i) {
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
  allocate(store, DType::bf16);
  CHECK(store.total == 64 + 128);
  CHECK(store.master_flat().shape == Shape{store.total});
  CHECK(store.master_flat().data == store.master.data());
  CHECK(store.master_flat().dtype == DType::f32);
  CHECK(store.grads_flat().shape == Shape{store.total});
  CHECK(store.grads_flat().data == store.grads.data());
  CHECK(store.compute_flat().shape == Shape{store.total});
  CHECK(store.compute_flat().dtype == DType::bf16);
  CHECK(store.compute_flat().bytes() == static_cast<std::size_t>(store.total) * 2);
}

TEST_CASE("view_in places a parameter in any buffer laid out like the store") {
  World w;
  nn::ParamStore store;
  add_param(w, store, "a", {100});
  const nn::Param& p = add_param(w, store, "b", {3, 4});
  std::vector<float> moments(static_cast<std::size_t>(store.total));
  const TensorView flat(moments.data(), {store.total}, DType::f32, Device::cpu);
  const TensorView v = nn::ParamStore::view_in(flat, p);
  CHECK(v.data == moments.data() + p.offset);
  CHECK(v.shape == Shape{3, 4});
  CHECK(v.dtype == DType::f32);
  CHECK(v.contiguous());
  // The element size is the flat buffer's: a bf16 buffer of the same layout.
  std::vector<std::uint16_t> half(static_cast<std::size_t>(store.total));
  const TensorView hv = nn::ParamStore::view_in(TensorView(half.data(), {store.total}, DType::bf16, Device::cpu), p);
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
  allocate(store, DType::bf16);
  for (Entity e : store.order) {
    const auto& p = w.get<nn::Param>(e);
    CAPTURE(p.name);
    CHECK(p.offset % nn::kParamAlign == 0);
    CHECK(byte_offset(store.master_view(p), store.master) % 256 == 0);
    CHECK(byte_offset(store.grad_view(p), store.grads) % 256 == 0);
    CHECK(byte_offset(store.compute_view(p), store.compute) % 128 == 0);
    CHECK(reinterpret_cast<std::uintptr_t>(store.master_view(p).data) % 64 == 0);  // host buffers are 64-byte aligned
  }
}

TEST_CASE("a parameter reaching past the store's buffers is an error") {
  World w;
  nn::ParamStore store;
  nn::Param& p = add_param(w, store, "a", {64});
  allocate(store, DType::f32);
  p.offset = 1;  // a layout the buffers were not made for
  CHECK_THROWS_WITH_AS(store.master_view(p), doctest::Contains("exceeds a buffer"), Error);
  CHECK_THROWS_AS(store.grad_view(p), Error);
}
