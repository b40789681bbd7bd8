// CPU reference ops against direct formulas and invariants.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kiln/ops/backend.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/rng/philox.hpp"
#include "host_view.hpp"
#include "kiln_test.hpp"
#include "op_harness.hpp"

using namespace kiln;
using kiln::test::random_values;
using kiln::test::view;

TEST_CASE("attention of the first token returns its value vector") {
  auto b = ops::make_cpu_backend();
  const int B = 1, T = 3, H = 2, D = 4;
  auto qkv = random_values(B * T * 3 * H * D, 1);
  std::vector<float> out(B * T * H * D), lse(B * H * T);
  b->attention_forward({view(out, {B, T, H, D}), view(lse, {B, H, T}), view(qkv, {B, T, 3, H, D}), 0.5f});
  for (int h = 0; h < H; ++h)
    for (int d = 0; d < D; ++d) CHECK(out[h * D + d] == doctest::Approx(qkv[2 * H * D + h * D + d]));
}

TEST_CASE("attention dropout on a batch's later sequences draws what the whole batch draws for them") {
  auto b = ops::make_cpu_backend();
  const int B = 3, T = 9, H = 2, D = 4, first = 1;
  auto qkv = random_values(B * T * 3 * H * D, 41);
  std::vector<float> out(B * T * H * D), lse(B * H * T);
  const rng::PhiloxArgs r{77, 5, nullptr};
  b->attention_forward({view(out, {B, T, H, D}), view(lse, {B, H, T}), view(qkv, {B, T, 3, H, D}), 0.5f, 0.3f, r});
  const int Bp = B - first;
  std::vector<float> part_qkv(qkv.begin() + first * T * 3 * H * D, qkv.end()), part_out(Bp * T * H * D),
      part_lse(Bp * H * T);
  ops::AttentionForward a{view(part_out, {Bp, T, H, D}), view(part_lse, {Bp, H, T}), view(part_qkv, {Bp, T, 3, H, D}),
                          0.5f, 0.3f, r};
  a.seq_offset = first;
  b->attention_forward(a);
  CHECK(part_out == std::vector<float>(out.begin() + first * T * H * D, out.end()));
  a.seq_offset = 0;  // as if it were the batch's first sequences: other masks
  b->attention_forward(a);
  CHECK(part_out != std::vector<float>(out.begin() + first * T * H * D, out.end()));
}

TEST_CASE("layernorm output has zero mean and unit variance before the affine part") {
  auto b = ops::make_cpu_backend();
  const int N = 4, C = 64;
  auto x = random_values(N * C, 2, 3.0f, 1.0f);
  std::vector<float> w(C, 1.0f), bias(C, 0.0f), out(N * C), mean(N), rstd(N);
  b->layernorm_forward({view(out, {N, C}), view(mean, {N}), view(rstd, {N}), view(x, {N, C}), view(w, {C}),
                        view(bias, {C}), 1e-5f});
  for (int n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int c = 0; c < C; ++c) m += out[n * C + c];
    m /= C;
    for (int c = 0; c < C; ++c) v += (out[n * C + c] - m) * (out[n * C + c] - m);
    CHECK(std::fabs(m) < 1e-5);
    CHECK(v / C == doctest::Approx(1.0).epsilon(1e-3));
  }
}

TEST_CASE("cross entropy loss is minus the log softmax of the target") {
  auto b = ops::make_cpu_backend();
  std::vector<float> logits = {1.0f, 2.0f, 3.0f, 100.0f}, losses(1);
  std::vector<std::int32_t> t = {1};
  b->cross_entropy({view(losses, {1}), view(logits, {1, 4}), TensorView(t.data(), {1}, DType::i32, Device::cpu), 3, 1.0f});
  double expected = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)) - 2.0;
  CHECK(losses[0] == doctest::Approx(expected).epsilon(1e-6));
  CHECK(logits[3] == 0.0f);  // padded vocabulary column
}

TEST_CASE("vocabulary-parallel cross-entropy over column shards equals the fused cross-entropy") {
  auto b = ops::make_cpu_backend({.threads = 2});
  const std::int64_t N = 37, V = 48, Vr = 41;  // 7 padded columns; the last shard holds only 1 real column
  std::vector<float> logits(N * V);
  std::mt19937_64 gen(5);
  std::normal_distribution<float> d(0.0f, 3.0f);
  for (auto& x : logits) x = d(gen);
  std::vector<std::int32_t> t(N);
  for (std::int64_t n = 0; n < N; ++n) t[n] = n == 4 ? -1 : static_cast<std::int32_t>(gen() % Vr);
  const TensorView targets(t.data(), {N}, DType::i32, Device::cpu);
  std::vector<float> whole = logits, losses(N);
  b->cross_entropy({view(losses, {N}), view(whole, {N, V}), targets, static_cast<int>(Vr), 0.25f});
  for (int R : {2, 3}) {  // 2 shards of 24 columns, 3 of 16 (the third: columns 32..47, 9 real)
    const std::int64_t Vl = V / R;
    std::vector<std::vector<float>> shard(R, std::vector<float>(N * Vl));
    std::vector<float> all(R * N * 3), shard_losses(N);
    for (int r = 0; r < R; ++r) {
      for (std::int64_t n = 0; n < N; ++n)
        std::copy_n(logits.begin() + n * V + r * Vl, Vl, shard[r].begin() + n * Vl);
      std::vector<float> st(N * 3);
      b->cross_entropy_stats({view(st, {N, 3}), view(shard[r], {N, Vl}), targets, r * Vl, static_cast<int>(Vr)});
      std::copy(st.begin(), st.end(), all.begin() + r * N * 3);
    }
    for (int r = 0; r < R; ++r) {
      b->cross_entropy_finish({view(shard_losses, {N}), view(shard[r], {N, Vl}), targets, view(all, {R, N, 3}), r * Vl,
                               static_cast<int>(Vr), 0.25f});
      for (std::int64_t n = 0; n < N; ++n) {
        CHECK(shard_losses[n] == doctest::Approx(losses[n]).epsilon(1e-6));
        for (std::int64_t c = 0; c < Vl; ++c)
          CHECK(shard[r][n * Vl + c] == doctest::Approx(whole[n * V + r * Vl + c]).epsilon(1e-5).scale(1e-6));
      }
    }
  }
  CHECK(losses[4] == 0.0f);
}

TEST_CASE("a vocabulary-parallel embedding: the shards' lookups sum to the whole lookup") {
  auto b = ops::make_cpu_backend();
  const std::int64_t N = 12, C = 5, V = 10, T = 4;
  std::vector<float> wte(V * C), wpe(T * C);
  for (std::size_t i = 0; i < wte.size(); ++i) wte[i] = 0.5f + static_cast<float>(i);
  for (std::size_t i = 0; i < wpe.size(); ++i) wpe[i] = -0.25f * static_cast<float>(i + 1);
  std::vector<std::int32_t> tok = {0, 9, 3, 4, 5, 5, 1, 8, 2, 7, 6, 9};
  const TensorView tokens(tok.data(), {N}, DType::i32, Device::cpu);
  std::vector<float> whole(N * C), sum(N * C, 0.0f), part(N * C);
  b->embedding_forward({view(whole, {N, C}), tokens, view(wte, {V, C}), view(wpe, {T, C}), static_cast<int>(T)});
  std::vector<float> dwte_whole(V * C, 0.0f), dwpe_whole(T * C, 0.0f), dwte_parts(V * C, 0.0f);
  std::vector<float> dout(N * C);
  for (std::size_t i = 0; i < dout.size(); ++i) dout[i] = 1.0f + 0.1f * static_cast<float>(i);
  b->embedding_backward({view(dwte_whole, {V, C}), view(dwpe_whole, {T, C}), view(dout, {N, C}), tokens, tok.data(),
                         static_cast<int>(T)});
  for (std::int64_t begin : {0, 5}) {  // two shards of 5 rows
    TensorView rows(wte.data() + begin * C, {5, C}, DType::f32, Device::cpu);
    b->embedding_forward({view(part, {N, C}), tokens, rows, view(wpe, {T, C}), static_cast<int>(T), begin, V, begin == 0});
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
    std::vector<float> dwpe(T * C, 0.0f);
    TensorView drows(dwte_parts.data() + begin * C, {5, C}, DType::f32, Device::cpu);
    b->embedding_backward({drows, view(dwpe, {T, C}), view(dout, {N, C}), tokens, tok.data(), static_cast<int>(T), begin, V});
    CHECK(dwpe == dwpe_whole);
  }
  CHECK(sum == whole);
  CHECK(dwte_parts == dwte_whole);
  std::vector<std::int32_t> bad = {10};
  std::vector<float> one(C);
  CHECK_THROWS_AS(b->embedding_forward({view(one, {1, C}), TensorView(bad.data(), {1}, DType::i32, Device::cpu),
                                        view(wte, {V, C}).rows(0, 5), view(wpe, {T, C}), 1, 0, V, true}),
                  Error);
}

TEST_CASE("adamw matches a hand computed step with decoupled weight decay") {
  auto b = ops::make_cpu_backend();
  std::vector<float> p = {1.0f, -2.0f}, g = {0.5f, 0.25f}, m = {0.0f, 0.0f}, v = {0.0f, 0.0f};
  ops::AdamW a;
  a.params = view(p, {2});
  a.grads = view(g, {2});
  a.m = view(m, {2});
  a.v = view(v, {2});
  a.segments = {{0, 1, true}, {1, 1, false}};
  a.lr = 0.1f;
  a.weight_decay = 0.5f;
  a.grad_scale = 2.0f;
  b->adamw(a);
  // Step 1: mhat = g', vhat = g'^2, so the update is lr * sign(g') (eps aside).
  CHECK(p[0] == doctest::Approx(1.0 * (1 - 0.1 * 0.5) - 0.1).epsilon(1e-5));
  CHECK(p[1] == doctest::Approx(-2.0 - 0.1).epsilon(1e-5));
  CHECK(m[0] == doctest::Approx(0.1 * 1.0));
  CHECK(v[1] == doctest::Approx(0.05 * 0.25));
}

TEST_CASE("adamw leaves a segment another module updates untouched") {
  auto b = ops::make_cpu_backend();
  std::vector<float> p = {1.0f, -2.0f, 3.0f}, g = {0.5f, 0.25f, 1.0f}, m = {0.1f, 0.2f, 0.3f}, v = {0.1f, 0.2f, 0.3f};
  std::vector<float> act(3, 7.0f);
  ops::AdamW a;
  a.params = view(p, {3});
  a.params_act = view(act, {3});
  a.grads = view(g, {3});
  a.m = view(m, {3});
  a.v = view(v, {3});
  a.segments = {{0, 1, true}, {1, 1, true, false}, {2, 1, false}};
  a.lr = 0.1f;
  b->adamw(a);
  CHECK(p[1] == -2.0f);
  CHECK(m[1] == 0.2f);
  CHECK(v[1] == 0.2f);
  CHECK(act[1] == 7.0f);
  CHECK(p[0] != 1.0f);
  CHECK(p[2] != 3.0f);
  CHECK(act[2] == p[2]);
}

TEST_CASE("adamw with bf16 moments is the f32 step, the moments stored rounded to nearest even") {
  // optim.moments = "bf16": moments bf16-representable going in, the parameters take exactly the
  // f32 path's update (the unrounded moments), and the stored moments are its moments rounded.
  auto b = ops::make_cpu_backend();
  const int P = 1037;
  auto p32 = random_values(P, 71), g = random_values(P, 72, 0.1f), m32 = random_values(P, 73, 0.01f);
  auto v32 = random_values(P, 74, 1e-3f);
  for (auto& x : m32) x = round_bf16(x);
  for (auto& x : v32) x = round_bf16(std::fabs(x) + 1e-6f);
  std::vector<std::uint16_t> m16(P), v16(P);
  for (int i = 0; i < P; ++i) m16[i] = float_to_bf16_bits(m32[i]), v16[i] = float_to_bf16_bits(v32[i]);
  auto p16 = p32;
  auto step = [&](std::vector<float>& p, TensorView m, TensorView v) {
    ops::AdamW a;
    a.params = view(p, {P});
    a.grads = view(g, {P});
    a.m = m;
    a.v = v;
    a.segments = {{0, 600, true}, {600, P - 600, false}};
    a.lr = 1e-2f;
    a.weight_decay = 0.1f;
    a.grad_scale = 0.7f;
    a.step = 3;
    b->adamw(a);
  };
  step(p32, view(m32, {P}), view(v32, {P}));
  step(p16, TensorView(m16.data(), {P}, DType::bf16, Device::cpu), TensorView(v16.data(), {P}, DType::bf16, Device::cpu));
  CHECK(p16 == p32);
  int rounded = 0;
  for (int i = 0; i < P; ++i) {
    CHECK(m16[i] == float_to_bf16_bits(m32[i]));
    CHECK(v16[i] == float_to_bf16_bits(v32[i]));
    rounded += bf16_bits_to_float(m16[i]) != m32[i];
  }
  CHECK(rounded > P / 2);  // the f32 moments are not bf16 values: the rounding is real
  // Moments of two dtypes, or another dtype, are refused naming the argument.
  std::vector<float> v_wide(P);
  CHECK_THROWS_WITH_AS(step(p16, TensorView(m16.data(), {P}, DType::bf16, Device::cpu), view(v_wide, {P})),
                       doctest::Contains("adamw v"), Error);
}

TEST_CASE("adamw writes each segment's act copy at its own index, elsewhere, or not at all") {
  auto b = ops::make_cpu_backend();
  std::vector<float> p = {1.0f, -2.0f, 3.0f, 4.0f}, g = {0.5f, 0.25f, 1.0f, -1.0f}, m(4, 0.1f), v(4, 0.2f);
  std::vector<float> act(8, 7.0f);
  using S = ops::AdamWSegment;
  ops::AdamW a;
  a.params = view(p, {4});
  a.params_act = view(act, {8});
  a.grads = view(g, {4});
  a.m = view(m, {4});
  a.v = view(v, {4});
  a.segments = {{0, 1, true}, {1, 2, true, true, 5}, {3, 1, false, true, S::kNoAct}};
  a.lr = 0.1f;
  b->adamw(a);
  CHECK(act == std::vector<float>{p[0], 7.0f, 7.0f, 7.0f, 7.0f, p[1], p[2], 7.0f});
  a.segments = {{0, 4, true, true, 6}};  // [6, 10) is outside the 8 elements
  CHECK_THROWS_WITH_AS(b->adamw(a), doctest::Contains("act copy"), Error);
}

TEST_CASE("normal initialisation is layout invariant: a slice draws what the whole draws") {
  auto b = ops::make_cpu_backend();
  std::vector<float> whole(1000), part(300);
  rng::PhiloxArgs r{42, 7, nullptr};
  b->init_normal(view(whole, {1000}), 0.02f, r, 0);
  b->init_normal(view(part, {300}), 0.02f, r, 555);
  for (int i = 0; i < 300; ++i) CHECK(part[i] == whole[555 + i]);
  double m = 0, s = 0;
  std::vector<float> big(200000);
  b->init_normal(view(big, {200000}), 1.0f, r, 0);
  for (float x : big) m += x;
  m /= big.size();
  for (float x : big) s += (x - m) * (x - m);
  CHECK(std::fabs(m) < 0.01);
  CHECK(std::sqrt(s / big.size()) == doctest::Approx(1.0).epsilon(0.01));
}

TEST_CASE("bf16 rounding emulation rounds act outputs to bf16") {
  auto b = ops::make_cpu_backend({.round_bf16 = true});
  std::vector<float> src = {1.0f + 1.0f / 512.0f, 3.14159f}, dst(2);
  b->convert(view(dst, {2}), view(src, {2}));
  CHECK(dst[0] == 1.0f);  // ties to even
  CHECK(dst[1] == round_bf16(3.14159f));
  CHECK(dst[1] != 3.14159f);
}

TEST_CASE("convert moves f32 to bf16 (round to nearest even) and back exactly") {
  auto b = ops::make_cpu_backend();
  std::vector<float> src = random_values(1001, 95, 3.0f), back(src.size());
  src[0] = 1.0f + 1.0f / 256.0f;  // a tie: rounds to even
  std::vector<std::uint16_t> half(src.size());
  const TensorView h(half.data(), {1001}, DType::bf16, Device::cpu);
  b->convert(h, view(src, {1001}));
  b->convert(view(back, {1001}), h);
  CHECK(back[0] == 1.0f);
  for (std::size_t i = 0; i < src.size(); ++i) CHECK(back[i] == round_bf16(src[i]));
}

TEST_CASE("add accumulates one f32 tensor into another, element by element") {
  auto b = ops::make_cpu_backend({.threads = 3});
  std::vector<float> dst = random_values(777, 96), src = random_values(777, 97), want(dst.size());
  for (std::size_t i = 0; i < dst.size(); ++i) want[i] = dst[i] + src[i];
  b->add(view(dst, {777}), view(src, {777}));
  CHECK(dst == want);
  std::vector<float> shorter(776);
  CHECK_THROWS_WITH(b->add(view(dst, {777}), view(shorter, {776})), doctest::Contains("add src"));
}

TEST_CASE("results do not depend on the number of threads") {
  auto one = ops::make_cpu_backend({.threads = 1});
  auto many = ops::make_cpu_backend({.threads = 3});
  const int N = 37, IC = 19, OC = 23;
  auto x = random_values(N * IC, 5), w = random_values(OC * IC, 6), dout = random_values(N * OC, 7);
  std::vector<float> dw1(OC * IC, 0.0f), dw2(OC * IC, 0.0f), dx1(N * IC), dx2(N * IC);
  one->linear_backward({view(dx1, {N, IC}), view(dw1, {OC, IC}), {}, view(dout, {N, OC}), view(x, {N, IC}), view(w, {OC, IC})});
  many->linear_backward({view(dx2, {N, IC}), view(dw2, {OC, IC}), {}, view(dout, {N, OC}), view(x, {N, IC}), view(w, {OC, IC})});
  CHECK(dw1 == dw2);
  CHECK(dx1 == dx2);
}

TEST_CASE("the CPU linear backward calls dgrad_queued once dx is written, before the weight and bias gradients") {
  auto be = ops::make_cpu_backend({.threads = 2});
  const int N = 29, IC = 13, OC = 17;
  auto x = random_values(N * IC, 8), w = random_values(OC * IC, 9), dout = random_values(N * OC, 10),
       pre = random_values(N * IC, 11);
  std::vector<float> dx(N * IC, -7.0f), dw = random_values(OC * IC, 12), db = random_values(OC, 13);
  const auto dw0 = dw;
  kiln::test::DgradProbe probe{dx, dw};
  ops::LinearBackward a{view(dx, {N, IC}), view(dw, {OC, IC}), view(db, {OC}), view(dout, {N, OC}),
                        view(x, {N, IC}),  view(w, {OC, IC}),  view(pre, {N, IC})};
  a.dgrad_queued = probe.hook();
  be->linear_backward(a);
  probe.check(dw0);
}
