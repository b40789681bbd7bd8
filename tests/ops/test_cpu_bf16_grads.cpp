// bf16 parameter gradients (optim.grads = "bf16") on the CPU backend: every op that writes a
// parameter gradient computes its contribution in f32 exactly as for an f32 gradient and stores
// round_bf16(old + contribution) (or round(contribution) where it writes): bit for bit the f32 path
// from the same old values, rounded once. Mixed gradient dtypes are refused by name.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "grad_twin.hpp"
#include "host_view.hpp"
#include "kiln/core/error.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/tensor/bf16.hpp"
#include "op_harness.hpp"

using namespace kiln;
using kiln::test::GradTwin;
using kiln::test::random_values;
using kiln::test::view;

TEST_CASE("a bf16 linear weight and bias gradient is the f32 one rounded once, accumulated or written") {
  auto b = ops::make_cpu_backend({.threads = 3});
  const std::int64_t N = 37, IC = 19, OC = 23;
  auto x = random_values(N * IC, 1), w = random_values(OC * IC, 2, 0.2f), dout = random_values(N * OC, 3);
  for (bool overwrite : {false, true})
    for (bool bias : {false, true}) {
      INFO("overwrite " << overwrite << ", bias " << bias);
      GradTwin dw({OC, IC}, 4), db({OC}, 5);
      std::vector<float> dx32(N * IC, 0.5f), dx16(N * IC, 0.5f);
      auto run = [&](TensorView gw, TensorView gb, std::vector<float>& dx) {
        ops::LinearBackward a{view(dx, {N, IC}), gw, bias ? gb : TensorView{}, view(dout, {N, OC}), view(x, {N, IC}),
                              view(w, {OC, IC})};
        a.dweight_overwrite = overwrite;
        b->linear_backward(a);
      };
      run(dw.f32(), db.f32(), dx32);
      run(dw.bf16(), db.bf16(), dx16);
      dw.check_rounded_once("dweight");
      if (bias) db.check_rounded_once("dbias");
      CHECK(dx16 == dx32);  // the activation gradient is untouched by the gradient dtype
    }
}

TEST_CASE("a bf16 layernorm weight and bias gradient is the f32 one rounded once") {
  auto b = ops::make_cpu_backend({.threads = 2});
  const std::int64_t N = 29, C = 37;
  auto x = random_values(N * C, 10, 2.0f, 0.3f), w = random_values(C, 11), bb = random_values(C, 12);
  auto dout = random_values(N * C, 13);
  std::vector<float> out(N * C), mean(N), rstd(N);
  b->layernorm_forward({view(out, {N, C}), view(mean, {N}), view(rstd, {N}), view(x, {N, C}), view(w, {C}), view(bb, {C})});
  GradTwin dw({C}, 14), db({C}, 15);
  auto dx32 = random_values(N * C, 16), dx16 = dx32;
  b->layernorm_backward({view(dx32, {N, C}), dw.f32(), db.f32(), view(dout, {N, C}), view(x, {N, C}), view(w, {C}),
                         view(mean, {N}), view(rstd, {N})});
  b->layernorm_backward({view(dx16, {N, C}), dw.bf16(), db.bf16(), view(dout, {N, C}), view(x, {N, C}), view(w, {C}),
                         view(mean, {N}), view(rstd, {N})});
  dw.check_rounded_once("dweight");
  db.check_rounded_once("dbias");
  CHECK(dx16 == dx32);
}

TEST_CASE("a bf16 rmsnorm weight gradient is the f32 one rounded once") {
  auto b = ops::make_cpu_backend({.threads = 2});
  const std::int64_t N = 31, C = 45;
  auto x = random_values(N * C, 20, 1.5f, -0.2f), w = random_values(C, 21), dout = random_values(N * C, 22);
  std::vector<float> out(N * C), rstd(N);
  b->rmsnorm_forward({view(out, {N, C}), view(rstd, {N}), view(x, {N, C}), view(w, {C})});
  GradTwin dw({C}, 23);
  auto dx32 = random_values(N * C, 24), dx16 = dx32;
  b->rmsnorm_backward({view(dx32, {N, C}), dw.f32(), view(dout, {N, C}), view(x, {N, C}), view(w, {C}), view(rstd, {N})});
  b->rmsnorm_backward({view(dx16, {N, C}), dw.bf16(), view(dout, {N, C}), view(x, {N, C}), view(w, {C}), view(rstd, {N})});
  dw.check_rounded_once("dweight");
  CHECK(dx16 == dx32);
}

TEST_CASE("bf16 embedding gradients are the f32 ones rounded once, with and without positions") {
  auto b = ops::make_cpu_backend({.threads = 3});
  const std::int64_t T = 7, N = 5 * T, C = 13, V = 9;
  auto tok = test::random_ints(N, 30, 0, static_cast<int>(V));
  for (std::int64_t i = 0; i < V; ++i) tok[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i);  // every row
  auto dout = random_values(N * C, 31);
  const TensorView tokens(tok.data(), {N}, DType::i32, Device::cpu);
  for (bool positions : {true, false}) {
    INFO("positions " << positions);
    GradTwin dwte({V, C}, 32), dwpe({T, C}, 33);
    b->embedding_backward({dwte.f32(), positions ? dwpe.f32() : TensorView{}, view(dout, {N, C}), tokens, tok.data(),
                           static_cast<int>(T)});
    b->embedding_backward({dwte.bf16(), positions ? dwpe.bf16() : TensorView{}, view(dout, {N, C}), tokens,
                           tok.data(), static_cast<int>(T)});
    dwte.check_rounded_once("dwte");
    if (positions) dwpe.check_rounded_once("dwpe");
  }
}

TEST_CASE("add of bf16 gradients sums in f32 and rounds once") {
  auto b = ops::make_cpu_backend({.threads = 3});
  const std::int64_t n = 1001;
  GradTwin dst({n}, 40), src({n}, 41, 0.01f);
  b->add(dst.f32(), src.f32());
  b->add(dst.bf16(), src.bf16());
  dst.check_rounded_once("dst");
}

TEST_CASE("a call mixing f32 and bf16 gradients is refused, naming the op and the argument") {
  auto b = ops::make_cpu_backend();
  const std::int64_t N = 4, IC = 8, OC = 6;
  auto x = random_values(N * IC, 50), w = random_values(OC * IC, 51), dout = random_values(N * OC, 52);
  GradTwin dw({OC, IC}, 53), db({OC}, 54);
  CHECK_THROWS_WITH(b->linear_backward({{}, dw.bf16(), db.f32(), view(dout, {N, OC}), view(x, {N, IC}), view(w, {OC, IC})}),
                    doctest::Contains("linear_backward dbias: expected a contiguous bf16"));
  CHECK_THROWS_WITH(b->linear_backward({{}, dw.f32(), db.bf16(), view(dout, {N, OC}), view(x, {N, IC}), view(w, {OC, IC})}),
                    doctest::Contains("linear_backward dbias: expected a contiguous f32"));
  GradTwin a({OC}, 55);
  CHECK_THROWS_WITH(b->add(a.bf16(), db.f32()), doctest::Contains("add src: expected a contiguous bf16"));
  CHECK_THROWS_WITH(b->add(a.f32(), db.bf16()), doctest::Contains("add src: expected a contiguous f32"));
  std::vector<std::uint8_t> bytes(OC);
  CHECK_THROWS_WITH(b->add(TensorView(bytes.data(), {OC}, DType::u8, Device::cpu), db.f32()),
                    doctest::Contains("add dst"));
  // LayerNorm: dweight's dtype is the call's.
  std::vector<float> xs(N * OC, 0.5f), ws(OC, 1.0f), mean(N), rstd(N, 1.0f), dxs(N * OC);
  CHECK_THROWS_WITH(b->layernorm_backward({view(dxs, {N, OC}), db.bf16(), a.f32(), view(xs, {N, OC}), view(xs, {N, OC}),
                                           view(ws, {OC}), view(mean, {N}), view(rstd, {N})}),
                    doctest::Contains("layernorm_backward dbias"));
}

TEST_CASE("the grouped (mixture-of-experts) linear refuses a bf16 weight gradient by name") {
  auto b = ops::make_cpu_backend();
  const std::int64_t E = 2, R = 6, IC = 8, OC = 4;
  auto x = random_values(R * IC, 60), w = random_values(E * OC * IC, 61), dout = random_values(R * OC, 62);
  GradTwin dw({E, OC, IC}, 63);
  const std::int32_t offsets[] = {0, 3, 6};
  ops::GroupedLinearBackward a;
  a.dweight = dw.bf16();
  a.dout = view(dout, {R, OC});
  a.x = view(x, {R, IC});
  a.weight = view(w, {E, OC, IC});
  a.offsets_host = offsets;
  CHECK_THROWS_WITH(b->grouped_linear_backward(a), doctest::Contains("grouped_linear_backward: dweight: a bf16 gradient"));
  a.dweight = dw.f32();
  CHECK_NOTHROW(b->grouped_linear_backward(a));
}
