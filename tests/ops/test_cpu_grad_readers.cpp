// The ops that read parameter gradients (AdamW, grad_clip, sum_squares, sum_squares_each,
// sum_squares_parts) with bf16 gradients (optim.grads = "bf16"): bf16 -> f32 is exact, so each must
// give, bit for bit, what the same call gives with an f32 gradient holding the same values. Random,
// never zero, bf16-representable data at awkward sizes; f32 and bf16 moments; segments mixed.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kiln/ops/backend.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/tensor/bf16.hpp"
#include "host_view.hpp"
#include "kiln_test.hpp"
#include "op_harness.hpp"

using namespace kiln;
using kiln::test::random_values;
using kiln::test::view;

namespace {

// A gradient both ways: f32 values that are bf16 values (none zero), and their bf16 bits.
struct Grad {
  std::vector<float> f32;
  std::vector<std::uint16_t> bits;
  Grad(std::size_t n, std::uint64_t seed, float scale) : f32(random_values(n, seed, scale)), bits(n) {
    for (std::size_t i = 0; i < n; ++i) {
      if (f32[i] == 0.0f) f32[i] = scale * 0.5f;
      bits[i] = float_to_bf16_bits(f32[i]);
      f32[i] = bf16_bits_to_float(bits[i]);
    }
  }
  TensorView f32_view() { return view(f32, {static_cast<std::int64_t>(f32.size())}); }
  TensorView bf16_view() {
    return TensorView(bits.data(), {static_cast<std::int64_t>(bits.size())}, DType::bf16, Device::cpu);
  }
};

// AdamW's state on the host, moments f32 or bf16 (as optim.moments holds them).
struct State {
  std::vector<float> p, m32, v32, act;
  std::vector<std::uint16_t> m16, v16;
  bool bf16_moments;
  State(int P, std::uint64_t seed, bool bf16m) : p(random_values(P, seed)), act(P, 1234.5f), bf16_moments(bf16m) {
    m32 = random_values(P, seed + 1, 0.01f);
    v32 = random_values(P, seed + 2, 1e-3f);
    for (auto& x : v32) x = std::fabs(x) + 1e-6f;
    for (int i = 0; i < P; ++i) m16.push_back(float_to_bf16_bits(m32[i])), v16.push_back(float_to_bf16_bits(v32[i]));
  }
  TensorView m() { return moment(m32, m16); }
  TensorView v() { return moment(v32, v16); }
  TensorView moment(std::vector<float>& f, std::vector<std::uint16_t>& b) {
    const std::int64_t P = static_cast<std::int64_t>(f.size());
    return bf16_moments ? TensorView(b.data(), {P}, DType::bf16, Device::cpu) : view(f, {P});
  }
  bool operator==(const State& o) const {
    return test::same_bits(p, o.p) && test::same_bits(act, o.act) &&
           (bf16_moments ? m16 == o.m16 && v16 == o.v16 : test::same_bits(m32, o.m32) && test::same_bits(v32, o.v32));
  }
};

}  // namespace

TEST_CASE("adamw with a bf16 gradient equals the step with an f32 gradient of the same values, bit for bit") {
  auto b = ops::make_cpu_backend();
  using S = ops::AdamWSegment;
  for (const int P : {1037, 4099, 7}) {
    for (const bool bf16m : {false, true}) {
      INFO("P " << P << (bf16m ? " bf16 moments" : " f32 moments"));
      Grad g(P, 500 + P, 0.1f);
      State with32(P, 600 + P, bf16m), with16 = with32;
      // Segments out of order: decayed, not decayed, one left to another module, one without a copy.
      const int a = P / 2, c = P - a - 2;
      const std::vector<S> segs = {{a + 2, c, true}, {0, a, true}, {a, 1, false}, {a + 1, 1, true, false},
                                   {a + 2 + c, 0, false}};
      for (std::int64_t step = 1; step <= 3; ++step) {  // the moments carried from step to step
        auto run = [&](State& s, TensorView grads) {
          ops::AdamW x;
          x.params = view(s.p, {P});
          x.params_act = view(s.act, {P});
          x.grads = grads;
          x.m = s.m();
          x.v = s.v();
          x.segments = segs;
          x.lr = 1e-2f;
          x.weight_decay = 0.1f;
          x.grad_scale = 0.7f;
          x.step = step;
          b->adamw(x);
        };
        run(with32, g.f32_view());
        run(with16, g.bf16_view());
        CHECK(with16 == with32);
      }
      CHECK_FALSE(test::same_bits(with32.p, State(P, 600 + P, bf16m).p));  // the steps changed the parameters
    }
  }
}

TEST_CASE("adamw with a bf16 gradient reading its numbers from scalars equals the f32 gradient's, bit for bit") {
  auto b = ops::make_cpu_backend();
  const int P = 2053;
  Grad g(P, 71, 0.05f);
  State with32(P, 72, false), with16 = with32;
  float bc1 = 0, bc2 = 0;
  ops::adamw_bias_corrections(0.9f, 0.95f, 5, bc1, bc2);
  std::vector<float> scalars = {3e-3f, 0.6f, bc1, bc2};
  auto run = [&](State& s, TensorView grads) {
    ops::AdamW x;
    x.params = view(s.p, {P});
    x.grads = grads;
    x.m = s.m();
    x.v = s.v();
    x.segments = {{0, P, true}};
    x.weight_decay = 0.1f;
    x.scalars = scalars.data();
    b->adamw(x);
  };
  run(with32, g.f32_view());
  run(with16, g.bf16_view());
  CHECK(with16 == with32);
}

TEST_CASE("sum_squares, sum_squares_each and grad_clip of a bf16 gradient equal the f32 gradient's, bit for bit") {
  auto b = ops::make_cpu_backend({.threads = 2});
  // 40000: several of the CPU's fixed chunks; 1 and 5: shorter than anything vectorised.
  for (const int n : {40000, 5003, 1, 5}) {
    INFO("n " << n);
    Grad g(n, 800 + n, 0.3f);
    const double s32 = b->sum_squares(g.f32_view()), s16 = b->sum_squares(g.bf16_view());
    CHECK(std::memcmp(&s32, &s16, sizeof(double)) == 0);
    CHECK(s16 > 0);
    const TensorView mixed[] = {g.bf16_view(), g.f32_view(), g.bf16_view()};
    const std::vector<double> each = b->sum_squares_each(mixed);
    for (double e : each) CHECK(std::memcmp(&e, &s32, sizeof(double)) == 0);
    for (const double max_norm : {0.0, 0.5, 1e9}) {
      float sc32[4] = {}, sc16[4] = {};
      double norm32 = 0, norm16 = 0;
      b->grad_clip({g.f32_view(), max_norm, sc32, &norm32});
      b->grad_clip({g.bf16_view(), max_norm, sc16, &norm16});
      CHECK(std::memcmp(&norm32, &norm16, sizeof(double)) == 0);
      CHECK(std::memcmp(&sc32[ops::kAdamWGradScale], &sc16[ops::kAdamWGradScale], sizeof(float)) == 0);
    }
  }
}

TEST_CASE("sum_squares_parts of a bf16 gradient's parts equals the f32 parts', bit for bit") {
  auto b = ops::make_cpu_backend();
  const std::vector<int> sizes = {5003, 1, 77, 40000, 129};
  const std::vector<int> divisors = {1, 2, 0, 3, 1};
  std::vector<Grad> parts;
  for (std::size_t i = 0; i < sizes.size(); ++i) parts.emplace_back(sizes[i], 301 + i, 0.3f);
  std::vector<TensorView> v32, v16;
  for (auto& g : parts) v32.push_back(g.f32_view()), v16.push_back(g.bf16_view());
  float out32 = 0, out16 = 0;
  b->sum_squares_parts({v32, divisors, TensorView(&out32, {1}, DType::f32, Device::cpu)});
  b->sum_squares_parts({v16, divisors, TensorView(&out16, {1}, DType::f32, Device::cpu)});
  CHECK(std::memcmp(&out32, &out16, sizeof(float)) == 0);
  CHECK(out16 > 0);
}

TEST_CASE("the gradient readers refuse a gradient of another dtype and parts of mixed dtypes, naming the argument") {
  auto b = ops::make_cpu_backend();
  const int P = 64;
  State s(P, 9, false);
  std::vector<std::int32_t> ints(P, 1);
  const TensorView wrong(ints.data(), {P}, DType::i32, Device::cpu);
  ops::AdamW x;
  x.params = view(s.p, {P});
  x.grads = wrong;
  x.m = s.m();
  x.v = s.v();
  x.segments = {{0, P, true}};
  CHECK_THROWS_WITH_AS(b->adamw(x), doctest::Contains("adamw grads: expected f32 or bf16 (the gradient dtype), got i32"), Error);
  CHECK_THROWS_WITH_AS(b->sum_squares(wrong), doctest::Contains("sum_squares x: expected f32 or bf16"), Error);
  float scalars[4] = {};
  double norm = 0;
  CHECK_THROWS_WITH_AS(b->grad_clip({wrong, 1.0, scalars, &norm}),
                       doctest::Contains("grad_clip grads: expected f32 or bf16"), Error);
  Grad g(P, 10, 0.1f);
  const TensorView two[] = {g.f32_view(), g.bf16_view()};
  const int divisors[] = {1, 1};
  float out = 0;
  CHECK_THROWS_WITH_AS(b->sum_squares_parts({two, divisors, TensorView(&out, {1}, DType::f32, Device::cpu)}),
                       doctest::Contains("parts[1] is bf16 but parts[0] is f32"), Error);
  const TensorView one_wrong[] = {wrong};
  CHECK_THROWS_WITH_AS(
      b->sum_squares_parts({one_wrong, std::span(divisors, 1), TensorView(&out, {1}, DType::f32, Device::cpu)}),
      doctest::Contains("sum_squares_parts parts[0]: expected f32 or bf16"), Error);
}
