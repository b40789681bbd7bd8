// Every CPU backward against central finite differences of its forward, on random data.
// The loss is L = sum(out * w) with fixed random weights w; forward runs in fp32, the loss sums in
// double, and h = 1e-2 keeps both the truncation and the rounding error near 1e-4 relative.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "kiln/ops/backend.hpp"
#include "kiln/ops/formulas.hpp"
#include "grad_check.hpp"
#include "op_harness.hpp"

using namespace kiln;
using namespace kiln::test;

TEST_CASE("linear backward matches finite differences, with bias and GELU") {
  auto b = cpu();
  const int N = 7, IC = 11, OC = 13;
  auto x = random_values(N * IC, 1), w = random_values(OC * IC, 2, 0.3f), bias = random_values(OC, 3);
  auto lw = random_values(N * OC, 4);
  for (bool use_gelu : {false, true}) {
    std::vector<float> out(N * OC), pre(N * OC);
    auto forward = [&] {
      b->linear_forward({view(out, {N, OC}), use_gelu ? view(pre, {N, OC}) : TensorView{}, view(x, {N, IC}),
                         view(w, {OC, IC}), view(bias, {OC})});
      return dot(out, lw);
    };
    forward();
    // Through the GELU: dL/dpre = lw * gelu'(pre); then the plain linear backward.
    std::vector<float> dout = lw;
    if (use_gelu)
      for (int i = 0; i < N * OC; ++i) dout[i] = lw[i] * ops::gelu_grad(pre[i]);
    std::vector<float> dx(N * IC), dw(OC * IC, 0.0f), db(OC, 0.0f);
    b->linear_backward({view(dx, {N, IC}), view(dw, {OC, IC}), view(db, {OC}), view(dout, {N, OC}), view(x, {N, IC}),
                        view(w, {OC, IC}), {}});
    check_gradient(use_gelu ? "gelu linear dx" : "linear dx", x, dx, forward);
    check_gradient(use_gelu ? "gelu linear dw" : "linear dw", w, dw, forward);
    check_gradient(use_gelu ? "gelu linear db" : "linear db", bias, db, forward);
  }
}

TEST_CASE("linear backward's dgelu path equals gelu' times the plain input gradient") {
  auto b = cpu();
  const int N = 5, IC = 9, OC = 6;
  auto pre = random_values(N * IC, 10), w = random_values(OC * IC, 11), dout = random_values(N * OC, 12);
  std::vector<float> h(N * IC);
  for (int i = 0; i < N * IC; ++i) h[i] = ops::gelu(pre[i]);
  std::vector<float> dx(N * IC), dx_plain(N * IC), dw(OC * IC, 0.0f);
  b->linear_backward({view(dx, {N, IC}), view(dw, {OC, IC}), {}, view(dout, {N, OC}), view(h, {N, IC}),
                      view(w, {OC, IC}), view(pre, {N, IC})});
  b->linear_backward({view(dx_plain, {N, IC}), view(dw, {OC, IC}), {}, view(dout, {N, OC}), view(h, {N, IC}),
                      view(w, {OC, IC}), {}});
  for (int i = 0; i < N * IC; ++i) CHECK(dx[i] == doctest::Approx(dx_plain[i] * ops::gelu_grad(pre[i])).epsilon(1e-5));
  // And gelu' against finite differences of gelu.
  for (float v : {-3.0f, -0.7f, 0.0f, 0.4f, 2.5f}) {
    double numeric = (double(ops::gelu(v + 1e-3f)) - ops::gelu(v - 1e-3f)) / 2e-3;
    CHECK(ops::gelu_grad(v) == doctest::Approx(numeric).epsilon(1e-3));
  }
}

TEST_CASE("layernorm backward matches finite differences and accumulates into dx") {
  auto b = cpu();
  const int N = 6, C = 10;
  auto x = random_values(N * C, 20, 2.0f, 0.5f), w = random_values(C, 21, 0.5f, 1.0f), bias = random_values(C, 22);
  auto lw = random_values(N * C, 23);
  std::vector<float> out(N * C), mean(N), rstd(N);
  auto forward = [&] {
    b->layernorm_forward({view(out, {N, C}), view(mean, {N}), view(rstd, {N}), view(x, {N, C}), view(w, {C}),
                          view(bias, {C}), 1e-5f});
    return dot(out, lw);
  };
  forward();
  auto start = random_values(N * C, 24);  // dx accumulates onto this
  std::vector<float> dx = start, dw(C, 0.0f), db(C, 0.0f);
  b->layernorm_backward({view(dx, {N, C}), view(dw, {C}), view(db, {C}), view(lw, {N, C}), view(x, {N, C}),
                         view(w, {C}), view(mean, {N}), view(rstd, {N})});
  for (int i = 0; i < N * C; ++i) dx[i] -= start[i];
  check_gradient("layernorm dx", x, dx, forward);
  check_gradient("layernorm dw", w, dw, forward);
  check_gradient("layernorm db", bias, db, forward);
}

TEST_CASE("embedding backward matches finite differences with repeated tokens") {
  auto b = cpu();
  const int B = 2, T = 5, C = 4, V = 7, Tmax = 8;
  std::vector<std::int32_t> tokens = {1, 3, 3, 0, 6, 3, 1, 2, 2, 5};
  auto wte = random_values(V * C, 30), wpe = random_values(Tmax * C, 31), lw = random_values(B * T * C, 32);
  std::vector<float> out(B * T * C);
  auto forward = [&] {
    b->embedding_forward({view(out, {B * T, C}), iview(tokens, {B * T}), view(wte, {V, C}), view(wpe, {Tmax, C}), T});
    return dot(out, lw);
  };
  forward();
  std::vector<float> dwte(V * C, 0.0f), dwpe(Tmax * C, 0.0f);
  b->embedding_backward({view(dwte, {V, C}), view(dwpe, {Tmax, C}), view(lw, {B * T, C}), iview(tokens, {B * T}),
                         tokens.data(), T});
  check_gradient("embedding dwte", wte, dwte, forward, {.samples = 100});
  check_gradient("embedding dwpe", wpe, dwpe, forward, {.samples = 100});
}

TEST_CASE("attention backward matches finite differences, with and without dropout") {
  auto b = cpu();
  const int B = 2, T = 6, H = 3, D = 4;
  auto qkv = random_values(B * T * 3 * H * D, 40);
  auto lw = random_values(B * T * H * D, 41);
  for (float p : {0.0f, 0.3f}) {
    std::vector<float> out(B * T * H * D), lse(B * H * T);
    rng::PhiloxArgs r{1234, 77, nullptr};
    auto forward = [&] {
      ops::AttentionForward a{view(out, {B, T, H, D}), view(lse, {B, H, T}), view(qkv, {B, T, 3, H, D}), 0.5f, p, r};
      b->attention_forward(a);
      return dot(out, lw);
    };
    forward();
    std::vector<float> dqkv(qkv.size());
    b->attention_backward({view(dqkv, {B, T, 3, H, D}), view(lw, {B, T, H, D}), view(out, {B, T, H, D}),
                           view(lse, {B, H, T}), view(qkv, {B, T, 3, H, D}), 0.5f, p, r});
    check_gradient(p > 0 ? "attention dqkv (dropout)" : "attention dqkv", qkv, dqkv, forward, {.samples = 80});
  }
}

TEST_CASE("residual dropout backward matches finite differences") {
  auto b = cpu();
  const int N = 9, C = 8;
  auto res = random_values(N * C, 50), x = random_values(N * C, 51), lw = random_values(N * C, 52);
  ops::DropoutArgs d{0.25f, {99, 5, nullptr}, 3, 0, 0};
  std::vector<float> out(N * C);
  auto forward = [&] {
    b->residual_forward({view(out, {N, C}), view(res, {N, C}), view(x, {N, C}), d});
    return dot(out, lw);
  };
  forward();
  std::vector<float> dx(N * C);
  b->dropout_backward({view(dx, {N, C}), view(lw, {N, C}), d});
  check_gradient("dropout dx", x, dx, forward, {.samples = 72});
  int dropped = 0;
  for (float g : dx) dropped += (g == 0.0f);
  CHECK(dropped > 5);
  CHECK(dropped < 36);
}

TEST_CASE("cross entropy gradient matches finite differences of the loss") {
  auto b = cpu();
  const int N = 5, V = 12, Vr = 10;
  auto logits = random_values(N * V, 60, 2.0f);
  std::vector<std::int32_t> targets = {3, 0, 9, -1, 7};
  const float dloss = 0.5f;
  std::vector<float> losses(N);
  auto loss_of = [&] {
    std::vector<float> l = logits;
    b->cross_entropy({view(losses, {N}), view(l, {N, V}), iview(targets, {N}), Vr, dloss});
    double s = 0;
    for (float v : losses) s += v;
    return s * dloss;
  };
  std::vector<float> grad = logits;
  b->cross_entropy({view(losses, {N}), view(grad, {N, V}), iview(targets, {N}), Vr, dloss});
  CHECK(losses[3] == 0.0f);
  for (int n = 0; n < N; ++n)
    for (int v = Vr; v < V; ++v) CHECK(grad[n * V + v] == 0.0f);
  check_gradient("cross entropy dlogits", logits, grad, loss_of, {.samples = 60});
}
