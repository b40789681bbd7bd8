// bf16 parameter gradients (optim.grads = "bf16") in the FP8 module's CPU emulation: the FP8 GEMM's
// gradient result, the bias gradient of quantize_grad and bias_grad, and Fp8Linear's backward store
// the f32 path's values from the same old gradient, rounded once (bit for bit).
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "fp8_test_util.hpp"
#include "grad_twin.hpp"
#include "host_view.hpp"
#include "kiln/fp8/grouped_linear.hpp"
#include "kiln/fp8/linear.hpp"
#include "kiln/ops/backend.hpp"

using namespace kiln;
using namespace kiln::fp8;
using kiln::test::GradTwin;
using kiln::test::view;

TEST_CASE("the CPU FP8 GEMM into a bf16 gradient is the f32 result rounded once, accumulated or written") {
  auto ops = make_cpu_ops({.round_bf16 = true, .threads = 3});
  const int M = 23, N = 32, K = 48;
  auto xv = test::normal_values(M * K, 60), yv = test::normal_values(N * K, 61);
  std::vector<std::uint8_t> xq(M * K), yq(N * K);
  const float sx = 50.0f, sy = 20000.0f, sxi = 1.0f / sx, syi = 1.0f / sy;
  for (int i = 0; i < M * K; ++i) xq[i] = fp8::quantize(xv[i], sx, Format::e4m3);
  for (int i = 0; i < N * K; ++i) yq[i] = fp8::quantize(yv[i], sy, Format::e5m2);
  for (bool accumulate : {true, false}) {
    INFO("accumulate " << accumulate);
    GradTwin d({M, N}, 62, 0.1f);
    GemmArgs g;
    g.x = TensorView(xq.data(), {M, K}, DType::e4m3, Device::cpu);
    g.x_scale_inv = &sxi;
    g.y = TensorView(yq.data(), {N, K}, DType::e5m2, Device::cpu);
    g.y_scale_inv = &syi;
    g.f32_result = true;
    g.accumulate = accumulate;
    g.d = d.f32();
    ops->gemm(g);
    g.d = d.bf16();
    ops->gemm(g);
    d.check_rounded_once("d");
    // A bf16 D that is not a gradient result is an activation, which the CPU holds in f32: refused.
    g.f32_result = false;
    g.accumulate = false;
    CHECK_THROWS_WITH(ops->gemm(g), doctest::Contains("fp8 gemm: d"));
  }
}

TEST_CASE("the CPU FP8 bias gradients into bf16 are the f32 sums rounded once") {
  auto ops = make_cpu_ops({.threads = 2});
  const int R = 37, C = 21;
  auto dy = test::normal_values(R * C, 70);
  GradTwin db({C}, 71);
  ops->bias_grad(db.f32(), view(dy, {R, C}));
  ops->bias_grad(db.bf16(), view(dy, {R, C}));
  db.check_rounded_once("bias_grad dbias");

  // quantize_grad's bias gradient, in the same pass as the quantisation.
  GradTwin qb({C}, 72);
  std::vector<std::uint8_t> row(R * C), col(C * R);
  float scale = 100.0f, scale_inv = 0.01f, amax = 0;
  auto quantize = [&](TensorView dbias) {
    Fp8TensorView out;
    out.rowwise = TensorView(row.data(), {R, C}, DType::e5m2, Device::cpu);
    out.colwise = TensorView(col.data(), {C, R}, DType::e5m2, Device::cpu);
    out.format = Format::e5m2;
    out.scale = &scale;
    out.scale_inv = &scale_inv;
    auto g = dy;
    ops->quantize_grad({view(g, {R, C}), {}, out, &amax, dbias});
  };
  quantize(qb.f32());
  quantize(qb.bf16());
  qb.check_rounded_once("quantize_grad dbias");
}

namespace {
struct Bf16GradLayer {
  std::unique_ptr<Fp8Ops> ops = make_cpu_ops({.threads = 2});
  Fp8MetaStore meta{*ops,
                    {format_for(FormatPolicy::hybrid, TensorRole::input), format_for(FormatPolicy::hybrid, TensorRole::weight),
                     format_for(FormatPolicy::hybrid, TensorRole::grad_output)},
                    1};
  Fp8Workspace ws{*ops};
  Fp8Linear lin{*ops, meta, 0, ws, Fp8Recipe{RecipeKind::current, 16, AmaxAlgo::max, 0, FormatPolicy::hybrid, true},
                "test.linear"};
};
}  // namespace

TEST_CASE("an FP8 linear's bf16 weight and bias gradients are its f32 ones rounded once") {
  const int N = 40, IC = 24, OC = 20;
  auto x = test::normal_values(N * IC, 80, 2.0f), w = test::normal_values(OC * IC, 81, 0.1f);
  auto b = test::normal_values(OC, 82), dout = test::normal_values(N * OC, 83, 0.05f);
  for (bool overwrite : {false, true}) {
    INFO("overwrite " << overwrite);
    GradTwin dw({OC, IC}, 84, 0.05f), db({OC}, 85);
    auto run = [&](TensorView gw, TensorView gb) {
      Bf16GradLayer L;  // a fresh layer each: the same scales for both
      std::vector<float> out(N * OC), dx(N * IC);
      L.lin.forward({view(out, {N, OC}), {}, view(x, {N, IC}), view(w, {OC, IC}), view(b, {OC})}, 1);
      ops::LinearBackward a{view(dx, {N, IC}), gw, gb, view(dout, {N, OC}), view(x, {N, IC}), view(w, {OC, IC})};
      a.dweight_overwrite = overwrite;
      L.lin.backward(a);
      return dx;
    };
    const auto dx32 = run(dw.f32(), db.f32());
    const auto dx16 = run(dw.bf16(), db.bf16());
    dw.check_rounded_once("dweight");
    db.check_rounded_once("dbias");
    CHECK(dx16 == dx32);
  }
  GradTwin dw({OC, IC}, 86), db({OC}, 87);
  Bf16GradLayer L;
  std::vector<float> out(N * OC), dx(N * IC);
  L.lin.forward({view(out, {N, OC}), {}, view(x, {N, IC}), view(w, {OC, IC}), view(b, {OC})}, 1);
  CHECK_THROWS_WITH(L.lin.backward({view(dx, {N, IC}), dw.bf16(), db.f32(), view(dout, {N, OC}), view(x, {N, IC}),
                                    view(w, {OC, IC})}),
                    doctest::Contains("backward dbias: expected 20 bf16"));
}

TEST_CASE("the grouped FP8 linear refuses a bf16 weight gradient by name") {
  auto ops = make_cpu_ops({.threads = 2});
  const FormatPolicy policy = FormatPolicy::hybrid;
  Fp8MetaStore meta(*ops, {format_for(policy, TensorRole::input), format_for(policy, TensorRole::weight),
                           format_for(policy, TensorRole::grad_output)},
                    1);
  Fp8Workspace ws(*ops);
  Fp8GroupedLinear lin(*ops, meta, 0, ws, Fp8Recipe{RecipeKind::current, 4, AmaxAlgo::max, 0, policy, false}, "test.experts");
  const int E = 2, R = 9, IC = 16, OC = 32;
  const std::vector<std::int32_t> off = {0, 4, 9};
  auto x = test::normal_values(R * IC, 90), w = test::normal_values(E * OC * IC, 91, 0.3f);
  auto dout = test::normal_values(R * OC, 92, 0.01f);
  std::vector<float> out(R * OC), dx(R * IC);
  lin.forward({view(out, {R, OC}), view(x, {R, IC}), view(w, {E, OC, IC}), off.data()}, 1);
  GradTwin dw({E, OC, IC}, 93);
  CHECK_THROWS_WITH(lin.backward({.dx = view(dx, {R, IC}), .dweight = dw.bf16(), .dout = view(dout, {R, OC}),
                                  .x = view(x, {R, IC}), .weight = view(w, {E, OC, IC}), .offsets_host = off.data()}),
                    doctest::Contains("test.experts: a bf16 gradient (optim.grads = \"bf16\") is not supported"));
}
