// The CPU emulation of the FP8 operations and Fp8Linear: quantisation (both copies, amax), the FP8
// GEMM with its epilogues, and a linear layer's forward and backward against an fp32 product of the
// dequantised inputs; replays (activation recompute) leave the meta untouched.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "fp8_test_util.hpp"
#include "host_view.hpp"
#include "kiln/fp8/linear.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/ops/formulas.hpp"

using namespace kiln;
using kiln::test::view;
using namespace kiln::fp8;

namespace {

std::vector<float> meta_state(const Fp8MetaStore& m) {
  const TensorView s = m.state();
  return std::vector<float>(s.as<float>(), s.as<float>() + s.numel());
}

struct Layer {
  std::unique_ptr<Fp8Ops> ops = make_cpu_ops({.threads = 2});
  Fp8MetaStore meta;
  Fp8Workspace ws{*ops};
  Fp8Linear lin;
  Layer(RecipeKind kind, FormatPolicy policy, int margin = 0)
      : meta(*ops, {format_for(policy, TensorRole::input), format_for(policy, TensorRole::weight),
                    format_for(policy, TensorRole::grad_output)},
             kind == RecipeKind::delayed ? 16 : 1),
        lin(*ops, meta, 0, ws, Fp8Recipe{kind, 16, AmaxAlgo::max, margin, policy, true}, "test.linear") {}
};

}  // namespace

TEST_CASE("CPU quantize writes the rowwise copy, its transpose and max-accumulates the amax") {
  auto ops = make_cpu_ops();
  const int R = 5, C = 7;
  auto x = test::normal_values(R * C, 1, 3.0f);
  x[9] = -20.0f;
  float scale = 10.0f, scale_inv = 0.1f, amax = 4.0f;
  std::vector<std::uint8_t> row(R * C), col(R * C);
  Fp8TensorView q;
  q.rowwise = TensorView(row.data(), {R, C}, DType::e4m3, Device::cpu);
  q.colwise = TensorView(col.data(), {C, R}, DType::e4m3, Device::cpu);
  q.scale = &scale;
  q.scale_inv = &scale_inv;
  ops->quantize(view(x, {R, C}), q, &amax);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      CHECK(row[r * C + c] == fp8::quantize(x[r * C + c], scale, Format::e4m3));
      CHECK(col[c * R + r] == row[r * C + c]);
    }
  CHECK(amax == 20.0f);
  x[3] = NAN;
  ops->quantize(view(x, {R, C}), q, &amax);
  CHECK(std::isnan(amax));
  CHECK(row[3] == 0x7f);
}

TEST_CASE("CPU transpose of one-byte codes puts element (r, c) at (c, r) and refuses wider elements") {
  auto ops = make_cpu_ops({.threads = 2});
  const std::int64_t rows = 5, cols = 7;
  std::vector<std::uint8_t> in(rows * cols), out(rows * cols);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::uint8_t>(3 * i + 1);
  ops->transpose(TensorView(out.data(), {cols, rows}, DType::u8, Device::cpu),
                 TensorView(in.data(), {rows, cols}, DType::u8, Device::cpu));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) CHECK(out[c * rows + r] == in[r * cols + c]);
  std::vector<std::uint16_t> wide(rows * cols);
  CHECK_THROWS_WITH(ops->transpose(TensorView(wide.data(), {cols, rows}, DType::bf16, Device::cpu),
                                   TensorView(wide.data(), {rows, cols}, DType::bf16, Device::cpu)),
                    doctest::Contains("codes of one byte"));
}

TEST_CASE("CPU FP8 GEMM: D = deq(X) deq(Y)^T with bias, GELU, dGELU and accumulation") {
  auto ops = make_cpu_ops({.threads = 3});
  const int M = 6, N = 10, K = 12;
  auto xv = test::normal_values(M * K, 2), yv = test::normal_values(N * K, 3);
  std::vector<std::uint8_t> xq(M * K), yq(N * K);
  const float sx = 100.0f, sy = 3000.0f, sxi = 1.0f / sx, syi = 1.0f / sy;
  for (int i = 0; i < M * K; ++i) xq[i] = fp8::quantize(xv[i], sx, Format::e4m3);
  for (int i = 0; i < N * K; ++i) yq[i] = fp8::quantize(yv[i], sy, Format::e5m2);
  auto xd = test::fake_quantize(xv, sx, Format::e4m3), yd = test::fake_quantize(yv, sy, Format::e5m2);
  const auto ref = test::matmul_nt(xd, yd, M, N, K);
  auto bias = test::normal_values(N, 4);
  GemmArgs g;
  g.x = TensorView(xq.data(), {M, K}, DType::e4m3, Device::cpu);
  g.x_scale_inv = &sxi;
  g.y = TensorView(yq.data(), {N, K}, DType::e5m2, Device::cpu);
  g.y_scale_inv = &syi;
  std::vector<float> d(M * N), aux(M * N);
  g.d = view(d, {M, N});

  ops->gemm(g);
  CHECK(test::rel_error(d, ref) < 1e-6);

  g.epilogue = ops::Epilogue::bias;
  g.bias = view(bias, {N});
  ops->gemm(g);
  for (int i = 0; i < M * N; ++i) CHECK(d[i] == doctest::Approx(ref[i] + bias[i % N]).epsilon(1e-5));

  g.epilogue = ops::Epilogue::gelu;
  g.aux = view(aux, {M, N});
  ops->gemm(g);
  for (int i = 0; i < M * N; ++i) {
    CHECK(aux[i] == doctest::Approx(ref[i] + bias[i % N]).epsilon(1e-5));
    CHECK(d[i] == doctest::Approx(ops::gelu(ref[i] + bias[i % N])).epsilon(1e-5));
  }

  auto pre = test::normal_values(M * N, 5);
  g.epilogue = ops::Epilogue::dgelu;
  g.bias = {};
  g.aux = view(pre, {M, N});
  ops->gemm(g);
  for (int i = 0; i < M * N; ++i) CHECK(d[i] == doctest::Approx(ref[i] * ops::gelu_grad(pre[i])).epsilon(1e-5));

  g.epilogue = ops::Epilogue::none;
  g.aux = {};
  std::vector<float> acc(M * N, 1.5f);
  g.d = view(acc, {M, N});
  g.accumulate = true;
  g.f32_result = true;
  ops->gemm(g);
  for (int i = 0; i < M * N; ++i) CHECK(acc[i] == doctest::Approx(1.5f + ref[i]).epsilon(1e-5));
  // An f32 result written (a weight gradient's first contribution): the plain sums, not rounded to
  // bf16 even where activations are.
  g.accumulate = false;
  make_cpu_ops({.round_bf16 = true, .threads = 2})->gemm(g);
  for (int i = 0; i < M * N; ++i) CHECK(acc[i] == doctest::Approx(ref[i]).epsilon(1e-5));

  // E5M2 x E5M2 does not exist on Hopper; the emulation refuses it too.
  g.x = TensorView(xq.data(), {M, K}, DType::e5m2, Device::cpu);
  CHECK_THROWS_AS(ops->gemm(g), Error);
}

TEST_CASE("an FP8 linear layer on the CPU matches fp32 products of the dequantised inputs") {
  const int N = 24, IC = 20, OC = 12;
  for (auto kind : {RecipeKind::delayed, RecipeKind::current})
    for (auto policy : {FormatPolicy::hybrid, FormatPolicy::e4m3})
      for (bool gelu : {false, true}) {
        INFO("recipe " << (kind == RecipeKind::delayed ? "delayed" : "current") << ", format "
                       << (policy == FormatPolicy::hybrid ? "hybrid" : "e4m3") << ", gelu " << gelu);
        Layer L(kind, policy, 1);
        auto x = test::normal_values(N * IC, 10, 2.0f), w = test::normal_values(OC * IC, 11, 0.1f);
        auto b = test::normal_values(OC, 12), dout = test::normal_values(N * OC, 13, 1e-3f);
        auto pre = test::normal_values(N * IC, 14);
        std::vector<float> out(N * OC), pre_gelu(N * OC), dx(N * IC), dw(OC * IC, 0.25f), db(OC, -1.0f);
        ops::LinearForward f{view(out, {N, OC}), gelu ? view(pre_gelu, {N, OC}) : TensorView{}, view(x, {N, IC}),
                             view(w, {OC, IC}), view(b, {OC})};
        L.lin.forward(f, 1);
        ops::LinearBackward bw{view(dx, {N, IC}), view(dw, {OC, IC}), view(db, {OC}), view(dout, {N, OC}),
                               view(x, {N, IC}),  view(w, {OC, IC}),  gelu ? view(pre, {N, IC}) : TensorView{}};
        L.lin.backward(bw);

        // The scales: on the first step every tensor is scaled by its own amax (margin 1).
        const Format fg = format_for(policy, TensorRole::grad_output);
        const float sx = fp8::compute_scale(448.0f, test::max_abs(x), 1, 1.0f);
        const float sw = fp8::compute_scale(448.0f, test::max_abs(w), 1, 1.0f);
        const float sg = fp8::compute_scale(fp8::max_value(fg), test::max_abs(dout), 1, 1.0f);
        CHECK(*L.lin.slot(TensorRole::input).scale == sx);
        CHECK(*L.lin.slot(TensorRole::weight).scale == sw);
        CHECK(*L.lin.slot(TensorRole::grad_output).scale == sg);
        const auto xd = test::fake_quantize(x, sx, Format::e4m3), wd = test::fake_quantize(w, sw, Format::e4m3);
        const auto gd = test::fake_quantize(dout, sg, fg);

        auto y = test::matmul_nt(xd, wd, N, OC, IC);
        for (int i = 0; i < N * OC; ++i) y[i] += b[i % OC];
        if (gelu) {
          CHECK(test::rel_error(pre_gelu, y) < 1e-6);
          for (auto& v : y) v = ops::gelu(v);
        }
        CHECK(test::rel_error(out, y) < 1e-6);

        auto dx_ref = test::matmul_nt(gd, test::transpose(wd, OC, IC), N, IC, OC);
        if (gelu)
          for (int i = 0; i < N * IC; ++i) dx_ref[i] *= ops::gelu_grad(pre[i]);
        CHECK(test::rel_error(dx, dx_ref) < 1e-6);
        auto dw_ref = test::matmul_nt(test::transpose(gd, N, OC), test::transpose(xd, N, IC), OC, IC, N);
        for (auto& v : dw_ref) v += 0.25f;
        CHECK(test::rel_error(dw, dw_ref) < 1e-6);
        for (int o = 0; o < OC; ++o) {
          double s = -1.0;
          for (int n = 0; n < N; ++n) s += dout[n * OC + o];  // from the unquantised gradient
          CHECK(db[o] == doctest::Approx(s).epsilon(1e-5));
        }
        // Quantisation error is visible but small against the exact fp32 product.
        auto exact = test::matmul_nt(x, w, N, OC, IC);
        for (int i = 0; i < N * OC; ++i) exact[i] += b[i % OC];
        if (gelu)
          for (auto& v : exact) v = ops::gelu(v);
        CHECK(test::rel_error(out, exact) < 0.08);
      }
}

TEST_CASE("a replayed forward (activation recompute) reuses the scales and leaves the meta unchanged") {
  for (auto kind : {RecipeKind::delayed, RecipeKind::current}) {
    Layer L(kind, FormatPolicy::hybrid);
    const int N = 16, IC = 8, OC = 8;
    auto x = test::normal_values(N * IC, 20), w = test::normal_values(OC * IC, 21);
    std::vector<float> out1(N * OC), out2(N * OC);
    // Step 1, then the once-per-step update, then step 2 with a replay.
    L.lin.forward({view(out1, {N, OC}), {}, view(x, {N, IC}), view(w, {OC, IC}), {}}, 1);
    if (kind == RecipeKind::delayed) L.meta.update(*L.ops, AmaxAlgo::max, 0);
    x[0] *= 1.5f;  // step 2's input
    L.lin.forward({view(out1, {N, OC}), {}, view(x, {N, IC}), view(w, {OC, IC}), {}}, 2);
    const auto before = meta_state(L.meta);
    L.lin.forward({view(out2, {N, OC}), {}, view(x, {N, IC}), view(w, {OC, IC}), {}}, 2, /*replay=*/true);
    CHECK(test::same_bits(out1, out2));
    CHECK(test::same_bits(meta_state(L.meta), before));
    // A replay neither records an amax nor derives a scale from its input: even a larger input
    // leaves the meta as it was, where a normal forward records it (delayed) or rescales (current).
    auto big = x;
    for (auto& v : big) v *= 4.0f;
    L.lin.forward({view(out2, {N, OC}), {}, view(big, {N, IC}), view(w, {OC, IC}), {}}, 2, /*replay=*/true);
    CHECK(test::same_bits(meta_state(L.meta), before));
    L.lin.forward({view(out2, {N, OC}), {}, view(big, {N, IC}), view(w, {OC, IC}), {}}, 2);
    CHECK_FALSE(test::same_bits(meta_state(L.meta), before));
  }
}

TEST_CASE("the FP8 weight is cached per weight version") {
  Layer L(RecipeKind::delayed, FormatPolicy::hybrid);
  const int N = 16, IC = 8, OC = 8;
  auto x = test::normal_values(N * IC, 30), w = test::normal_values(OC * IC, 31);
  std::vector<float> a(N * OC), b(N * OC), c(N * OC);
  L.lin.forward({view(a, {N, OC}), {}, view(x, {N, IC}), view(w, {OC, IC}), {}}, 7);
  for (auto& v : w) v *= -1.0f;  // changed without a new version: the cached copy is used
  L.lin.forward({view(b, {N, OC}), {}, view(x, {N, IC}), view(w, {OC, IC}), {}}, 7);
  CHECK(test::same_bits(a, b));
  L.lin.forward({view(c, {N, OC}), {}, view(x, {N, IC}), view(w, {OC, IC}), {}}, 8);
  for (int i = 0; i < N * OC; ++i) CHECK(c[i] == -a[i]);
  // Dropping the cache re-quantises at the next forward, whatever the version.
  for (auto& v : w) v *= -1.0f;
  L.lin.invalidate_weight();
  L.lin.forward({view(c, {N, OC}), {}, view(x, {N, IC}), view(w, {OC, IC}), {}}, 8);
  CHECK(test::same_bits(a, c));
}

TEST_CASE("the fused weight update: the optimizer's step and the copies the next forward would make, bit for bit") {
  Layer L(RecipeKind::delayed, FormatPolicy::hybrid);
  const int N = 16, IC = 32, OC = 16;
  auto x = test::normal_values(N * IC, 50), master = test::normal_values(OC * IC, 51, 0.1f);
  auto grad = test::normal_values(OC * IC, 52, 0.01f), m = test::normal_values(OC * IC, 53, 1e-3f);
  auto v = test::normal_values(OC * IC, 54, 1e-5f);
  for (auto& e : v) e = std::fabs(e);
  std::vector<float> compute(OC * IC), a(N * OC), b(N * OC), c(N * OC);
  L.lin.use_master_weight(view(master, {OC, IC}), view(compute, {OC, IC}));
  const TensorView W = view(compute, {OC, IC});
  auto args = [&] {
    AdamWQuantizeArgs u;
    u.grad = view(grad, {OC, IC});
    u.m = view(m, {OC, IC});
    u.v = view(v, {OC, IC});
    u.lr = 1e-2f;
    u.weight_decay = 0.1f;
    u.grad_scale = 0.5f;
    u.step = 3;
    return u;
  };
  // No scale yet (delayed scaling before its first update): the update alone, the forward quantises.
  auto ref = master, ref_m = m, ref_v = v;
  float bc1 = 0, bc2 = 0;
  ops::adamw_bias_corrections(0.9f, 0.95f, 3, bc1, bc2);
  auto step_ref = [&] {
    for (int i = 0; i < OC * IC; ++i)
      ops::adamw_update(ref[i], ref_m[i], ref_v[i], grad[i] * 0.5f, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, bc1, bc2);
  };
  step_ref();
  L.lin.update_weight(args(), 1);
  CHECK(test::same_bits(master, ref));
  CHECK(test::same_bits(m, ref_m));
  CHECK(test::same_bits(v, ref_v));
  L.lin.forward({view(a, {N, OC}), {}, view(x, {N, IC}), W, {}}, 1);
  L.meta.update(*L.ops, AmaxAlgo::max, 0);  // now every scale is known
  const ScalingSlot sw = L.lin.slot(TensorRole::weight);
  // The fused step writes the copies of version 2 with the weight's scale and records its amax.
  step_ref();
  L.lin.update_weight(args(), 2);
  CHECK(test::same_bits(master, ref));
  float amax = 0;
  for (float e : ref) amax = std::max(amax, std::fabs(e));
  CHECK(*sw.amax == amax);
  L.lin.forward({view(b, {N, OC}), {}, view(x, {N, IC}), W, {}}, 2);  // reuses them
  L.lin.invalidate_weight();
  L.lin.forward({view(c, {N, OC}), {}, view(x, {N, IC}), W, {}}, 2);  // quantises the master again
  CHECK(test::same_bits(b, c));
  CHECK(!test::same_bits(a, b));
}

TEST_CASE("a producer may hand in an already quantised input") {
  Layer L(RecipeKind::delayed, FormatPolicy::hybrid);
  const int N = 16, IC = 8, OC = 4;
  auto x = test::normal_values(N * IC, 40), w = test::normal_values(OC * IC, 41);
  std::vector<float> a(N * OC), b(N * OC);
  L.lin.forward({view(a, {N, OC}), {}, view(x, {N, IC}), view(w, {OC, IC}), {}}, 1);
  // The producer quantises with the layer's input slot.
  const ScalingSlot s = L.lin.slot(TensorRole::input);
  std::vector<std::uint8_t> q(N * IC);
  Fp8TensorView xq;
  xq.rowwise = TensorView(q.data(), {N, IC}, DType::e4m3, Device::cpu);
  xq.format = s.format;
  xq.scale = s.scale;
  xq.scale_inv = s.scale_inv;
  L.ops->quantize(view(x, {N, IC}), xq, s.amax);
  L.lin.forward_quantized(xq, {view(b, {N, OC}), {}, view(x, {N, IC}), view(w, {OC, IC}), {}}, 1);
  CHECK(test::same_bits(a, b));
}

TEST_CASE("the deferred dGELU and a kept input give the gradients of the unfused path, bit for bit") {
  // FC2 -> GELU -> FC1 in reverse: the reference lets FC2's dgrad apply gelu'(pre) (dx_gelu_pre);
  // the fused path hands FC1 the GELU output's gradient (ops::DgeluOnLoad). Delayed scaling uses the
  // fused pass from its second step on (the first derives the scale from the tensor itself).
  const int N = 32, H = 48, OC = 16;
  for (auto kind : {RecipeKind::delayed, RecipeKind::current})
    for (bool keep : {false, true}) {
      INFO("recipe " << (kind == RecipeKind::delayed ? "delayed" : "current") << ", keep_input " << keep);
      Layer ref(kind, FormatPolicy::hybrid), fused(kind, FormatPolicy::hybrid);
      Fp8Linear fused_keep(*fused.ops, fused.meta, 0, fused.ws,
                           Fp8Recipe{kind, 16, AmaxAlgo::max, 0, FormatPolicy::hybrid, true}, "kept", true);
      Fp8Linear& lin = keep ? fused_keep : fused.lin;
      for (int step = 1; step <= 3; ++step) {
        auto x = test::normal_values(N * H, 100 + step, 1.5f), w = test::normal_values(OC * H, 200 + step, 0.2f);
        auto b = test::normal_values(OC, 300 + step), pre = test::normal_values(N * OC, 400 + step, 2.0f);
        auto dgelu_out = test::normal_values(N * OC, 500 + step, 1e-2f);  // gradient of gelu(pre)
        std::vector<float> out(N * OC), dx_r(N * H), dx_f(N * H), dw_r(OC * H, 0.5f), dw_f(OC * H, 0.5f),
            db_r(OC, 0.1f), db_f(OC, 0.1f);
        auto x_f = x;
        ref.lin.forward({view(out, {N, OC}), {}, view(x, {N, H}), view(w, {OC, H}), view(b, {OC})}, step);
        lin.forward({view(out, {N, OC}), {}, view(x_f, {N, H}), view(w, {OC, H}), view(b, {OC})}, step);
        if (keep)
          for (auto& v : x_f) v = 1e6f;  // the kept copy is used, not whatever the buffer holds now
        // Reference: the output gradient with the dGELU applied as FC2's dgrad epilogue stores it.
        auto dout_r = dgelu_out;
        for (int i = 0; i < N * OC; ++i) dout_r[i] = dout_r[i] * ops::gelu_grad(pre[i]);
        ref.lin.backward({view(dx_r, {N, H}), view(dw_r, {OC, H}), view(db_r, {OC}), view(dout_r, {N, OC}),
                          view(x, {N, H}), view(w, {OC, H}), {}});
        auto dout_f = dgelu_out;
        ops::LinearBackward bw{view(dx_f, {N, H}), view(dw_f, {OC, H}), view(db_f, {OC}),
                               ops::DgeluOnLoad{view(dout_f, {N, OC}), view(pre, {N, OC})}, view(x_f, {N, H}),
                               view(w, {OC, H}), {}};
        lin.backward(bw);
        CHECK(test::same_bits(dx_r, dx_f));
        CHECK(test::same_bits(dw_r, dw_f));
        CHECK(test::same_bits(db_r, db_f));
        CHECK(test::same_bits(meta_state(ref.meta), meta_state(fused.meta)));
        if (kind == RecipeKind::delayed) {
          ref.meta.update(*ref.ops, AmaxAlgo::max, 0);
          fused.meta.update(*fused.ops, AmaxAlgo::max, 0);
        }
      }
    }
}

TEST_CASE("the SwiGLU's backward computed on load gives the gradients of the unfused path, bit for bit") {
  // FC1 of a Llama MLP: the reference gets swiglu_backward's output; the fused layer gets the SwiGLU
  // output's gradient with FC1's [gate | up] output (ops::DswigluOnLoad). N = 32: the colwise copy is
  // written by the grouped quantisation; N = 37: the rowwise codes are transposed.
  const int H = 24, F = 20, OC = 2 * F;
  for (const int N : {32, 37})
    for (auto kind : {RecipeKind::delayed, RecipeKind::current}) {
      INFO("N " << N << ", recipe " << (kind == RecipeKind::delayed ? "delayed" : "current"));
      Layer ref(kind, FormatPolicy::hybrid), fused(kind, FormatPolicy::hybrid);
      for (int step = 1; step <= 3; ++step) {
        auto x = test::normal_values(N * H, 110 + step, 1.5f), w = test::normal_values(OC * H, 210 + step, 0.2f);
        auto pre = test::normal_values(N * OC, 410 + step, 2.0f);
        auto dact = test::normal_values(N * F, 510 + step, 1e-2f);  // gradient of swiglu(pre)
        std::vector<float> out(N * OC), dx_r(N * H), dx_f(N * H), dw_r(OC * H, 0.5f), dw_f(OC * H, 0.5f);
        ref.lin.forward({view(out, {N, OC}), {}, view(x, {N, H}), view(w, {OC, H}), {}}, step);
        fused.lin.forward({view(out, {N, OC}), {}, view(x, {N, H}), view(w, {OC, H}), {}}, step);
        std::vector<float> dpre(N * OC);  // as swiglu_backward stores it (f32 on the CPU)
        for (int n = 0; n < N; ++n)
          for (int f = 0; f < F; ++f) {
            const float g = pre[n * OC + f], u = pre[n * OC + F + f], go = dact[n * F + f];
            dpre[n * OC + f] = ops::dswiglu_gate(go, g, u);
            dpre[n * OC + F + f] = ops::dswiglu_up(go, g);
          }
        ref.lin.backward({view(dx_r, {N, H}), view(dw_r, {OC, H}), {}, view(dpre, {N, OC}), view(x, {N, H}),
                          view(w, {OC, H}), {}});
        fused.lin.backward({view(dx_f, {N, H}), view(dw_f, {OC, H}), {},
                            ops::DswigluOnLoad{view(dact, {N, F}), view(pre, {N, OC})}, view(x, {N, H}),
                            view(w, {OC, H}), {}});
        CHECK(test::same_bits(dx_r, dx_f));
        CHECK(test::same_bits(dw_r, dw_f));
        CHECK(test::same_bits(meta_state(ref.meta), meta_state(fused.meta)));
        if (kind == RecipeKind::delayed) {
          ref.meta.update(*ref.ops, AmaxAlgo::max, 0);
          fused.meta.update(*fused.ops, AmaxAlgo::max, 0);
        }
      }
    }
  // A bias is not taken with it (the bias gradient is the plain path's fused reduction).
  Layer L(RecipeKind::current, FormatPolicy::hybrid);
  const int N = 16;
  auto x = test::normal_values(N * H, 1), w = test::normal_values(OC * H, 2), pre = test::normal_values(N * OC, 3);
  auto dact = test::normal_values(N * F, 4);
  std::vector<float> out(N * OC), dw(OC * H), db(OC);
  L.lin.forward({view(out, {N, OC}), {}, view(x, {N, H}), view(w, {OC, H}), {}}, 1);
  CHECK_THROWS_WITH_AS(L.lin.backward({{}, view(dw, {OC, H}), view(db, {OC}),
                                       ops::DswigluOnLoad{view(dact, {N, F}), view(pre, {N, OC})}, view(x, {N, H}),
                                       view(w, {OC, H}), {}}),
                       doctest::Contains("dswiglu-on-load needs an even output width and no bias"), Error);
}

TEST_CASE("a backward without its kept input is an error naming the layer") {
  Layer L(RecipeKind::delayed, FormatPolicy::hybrid);
  Fp8Linear kept(*L.ops, L.meta, 0, L.ws, Fp8Recipe{}, "blocks.0.mlp.proj", true);
  const int N = 16, IC = 8, OC = 8;
  auto x = test::normal_values(N * IC, 50), w = test::normal_values(OC * IC, 51), dout = test::normal_values(N * OC, 52);
  std::vector<float> dw(OC * IC);
  CHECK_THROWS_WITH_AS(kept.backward({{}, view(dw, {OC, IC}), {}, view(dout, {N, OC}), view(x, {N, IC}), view(w, {OC, IC}), {}}),
                       doctest::Contains("blocks.0.mlp.proj: backward of [16,8] without the forward's kept input"),
                       Error);
}

TEST_CASE("a SwiGLU input computed on load gives the unfused layer's outputs and gradients, bit for bit") {
  // FC2 of a Llama MLP: the reference reads x = silu(gate) * up as swiglu_forward stores it; the
  // fused layer gets FC1's [gate | up] output (ops::SwigluOnLoad) and computes it while quantising, in the
  // forward (rowwise, with the amax) and again in the backward (the colwise copy for dweight).
  const int N = 32, F = 24, OC = 16;
  for (auto kind : {RecipeKind::delayed, RecipeKind::current}) {
    INFO("recipe " << (kind == RecipeKind::delayed ? "delayed" : "current"));
    Layer ref(kind, FormatPolicy::hybrid), fused(kind, FormatPolicy::hybrid);
    for (int step = 1; step <= 3; ++step) {
      auto pre = test::normal_values(N * 2 * F, 600 + step, 2.0f), w = test::normal_values(OC * F, 700 + step, 0.2f);
      auto dout = test::normal_values(N * OC, 800 + step, 1e-2f);
      std::vector<float> x(N * F);
      for (int n = 0; n < N; ++n)
        for (int f = 0; f < F; ++f) x[n * F + f] = ops::silu(pre[n * 2 * F + f]) * pre[n * 2 * F + F + f];
      std::vector<float> out_r(N * OC), out_f(N * OC), dx_r(N * F), dx_f(N * F), dw_r(OC * F, 0.5f),
          dw_f(OC * F, 0.5f);
      ref.lin.forward({view(out_r, {N, OC}), {}, view(x, {N, F}), view(w, {OC, F}), {}}, step);
      fused.lin.forward({view(out_f, {N, OC}), {}, ops::SwigluOnLoad{view(pre, {N, 2 * F})}, view(w, {OC, F}), {}},
                        step);
      CHECK(test::same_bits(out_r, out_f));
      auto dout_f = dout;
      ref.lin.backward({view(dx_r, {N, F}), view(dw_r, {OC, F}), {}, view(dout, {N, OC}), view(x, {N, F}),
                        view(w, {OC, F}), {}});
      fused.lin.backward({view(dx_f, {N, F}), view(dw_f, {OC, F}), {}, view(dout_f, {N, OC}),
                          ops::SwigluOnLoad{view(pre, {N, 2 * F})}, view(w, {OC, F}), {}});
      CHECK(test::same_bits(dx_r, dx_f));
      CHECK(test::same_bits(dw_r, dw_f));
      CHECK(meta_state(ref.meta) == meta_state(fused.meta));
    }
  }
}

TEST_CASE("a linear layer refuses a SwiGLU input of an odd width, naming the prologue") {
  // (Two inputs computed on load cannot be written: the input is one ops::LinearInput.)
  Layer l(RecipeKind::current, FormatPolicy::hybrid);
  const int N = 4, F = 8, OC = 4;
  std::vector<float> w(OC * F, 0.1f), out(N * OC), odd(N * 7, 0.5f);
  ops::LinearForward f{view(out, {N, OC}), {}, ops::SwigluOnLoad{view(odd, {N, 7})}, view(w, {OC, F}), {}};
  CHECK_THROWS_WITH_AS(l.lin.forward(f, 1), doctest::Contains("forward x (swiglu-on-load): expected [N, 2 IC]"),
                       kiln::Error);
}

TEST_CASE("an FP8 linear backward calls dgrad_queued once dx is written, before the weight and bias gradients") {
  // The dGELU on load, delayed scaling's fused pass (step 2) and current scaling, kept input or not.
  const int N = 24, H = 40, OC = 16;
  for (auto kind : {RecipeKind::delayed, RecipeKind::current})
    for (bool keep : {false, true}) {
      INFO("recipe " << (kind == RecipeKind::delayed ? "delayed" : "current") << ", keep_input " << keep);
      Layer L(kind, FormatPolicy::hybrid);
      Fp8Linear kept(*L.ops, L.meta, 0, L.ws, Fp8Recipe{kind, 16, AmaxAlgo::max, 0, FormatPolicy::hybrid, true}, "kept",
                     true);
      Fp8Linear& lin = keep ? kept : L.lin;
      for (int step = 1; step <= 2; ++step) {
        auto x = test::normal_values(N * H, 600 + step, 1.5f), w = test::normal_values(OC * H, 610 + step, 0.2f);
        auto pre = test::normal_values(N * OC, 620 + step, 2.0f), dout = test::normal_values(N * OC, 630 + step, 1e-2f);
        std::vector<float> out(N * OC), dx(N * H, -7.0f), dw = test::normal_values(OC * H, 640 + step),
                                        db = test::normal_values(OC, 650 + step);
        const auto dw0 = dw;
        lin.forward({view(out, {N, OC}), {}, view(x, {N, H}), view(w, {OC, H}), {}}, step);
        test::DgradProbe probe{dx, dw};
        ops::LinearBackward bw{view(dx, {N, H}), view(dw, {OC, H}), view(db, {OC}),
                               ops::DgeluOnLoad{view(dout, {N, OC}), view(pre, {N, OC})}, view(x, {N, H}),
                               view(w, {OC, H}), {}};
        bw.dgrad_queued = probe.hook();
        lin.backward(bw);
        probe.check(dw0);
        if (kind == RecipeKind::delayed) L.meta.update(*L.ops, AmaxAlgo::max, 0);
      }
    }
}

TEST_CASE("an FP8 linear forward in pieces of rows writes the whole forward's rows, its input quantised once") {
  // The input through the GELU prologue; the pieces' outputs land in another order; the scale and
  // amax those of the whole call (current scaling would otherwise take each piece's own).
  const int N = 29, H = 24, OC = 16;
  for (auto kind : {RecipeKind::delayed, RecipeKind::current}) {
    INFO("recipe " << (kind == RecipeKind::delayed ? "delayed" : "current"));
    Layer whole(kind, FormatPolicy::hybrid), split(kind, FormatPolicy::hybrid);
    for (int step = 1; step <= 2; ++step) {
      auto pre = test::normal_values(N * H, 700 + step, 2.0f), w = test::normal_values(OC * H, 710 + step, 0.2f);
      auto b = test::normal_values(OC, 720 + step);
      std::vector<float> out(N * OC), got(N * OC, -7.0f);
      const ops::LinearForward f{view(out, {N, OC}), {}, ops::GeluOnLoad{view(pre, {N, H})}, view(w, {OC, H}),
                                 view(b, {OC})};
      whole.lin.forward(f, step);
      // Rows [0, 5), [5, 17), [17, 29) written back to front.
      const std::vector<ops::RowsOut> pieces = {{0, 5, view(got, {N, OC}).rows(24, 5)},
                                                {5, 12, view(got, {N, OC}).rows(12, 12)},
                                                {17, 12, view(got, {N, OC}).rows(0, 12)}};
      std::vector<std::size_t> queued;
      ops::LinearForward g = f;
      g.out = view(got, {N, OC});
      split.lin.forward_pieces(g, step, false, pieces, [&](std::size_t k) { queued.push_back(k); });
      CHECK(queued == std::vector<std::size_t>{0, 1, 2});
      std::vector<float> back(N * OC);
      std::memcpy(back.data(), got.data() + 24 * OC, 5 * OC * sizeof(float));
      std::memcpy(back.data() + 5 * OC, got.data() + 12 * OC, 12 * OC * sizeof(float));
      std::memcpy(back.data() + 17 * OC, got.data(), 12 * OC * sizeof(float));
      CHECK(test::same_bits(back, out));
      CHECK(test::same_bits(meta_state(whole.meta), meta_state(split.meta)));
      if (kind == RecipeKind::delayed) {
        whole.meta.update(*whole.ops, AmaxAlgo::max, 0);
        split.meta.update(*split.ops, AmaxAlgo::max, 0);
      }
    }
  }
}

TEST_CASE("CPU: an LM head's cross-entropy gradient quantised on load equals the loss's dlogits quantised, bit for "
          "bit") {
  // The CPU backend's loss (statistics, then the gradient written over the logits, or left to the
  // head with each row's logsumexp) and the CPU FP8 operations' gradient from that logsumexp.
  auto be = ops::make_cpu_backend({.round_bf16 = true, .threads = 2});
  auto q = make_cpu_ops({.round_bf16 = true, .threads = 2});
  const std::int64_t R = 37, V = 48, begin = 16;
  const int real = 60;  // this slice's columns 16..59 are real, 60..63 padding
  std::vector<float> logits(static_cast<std::size_t>(R * V));
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = round_bf16(3.0f * std::sin(0.37f * float(i) + 0.2f));
  std::vector<std::int32_t> targets(static_cast<std::size_t>(R));
  for (std::size_t r = 0; r < targets.size(); ++r) targets[r] = r % 9 == 4 ? -1 : static_cast<std::int32_t>((r * 13) % real);
  const float dloss = 0.125f;
  struct Out {
    std::vector<float> logits, losses, lse;
    std::vector<std::uint8_t> codes;
    float amax;
  };
  auto run = [&](bool on_load, bool materialise) {
    Out o{logits, std::vector<float>(R), std::vector<float>(R), std::vector<std::uint8_t>(2 * R * V), 0.0f};
    std::vector<float> stats(static_cast<std::size_t>(R * 3)), meta = {64.0f, 0.0f};
    const TensorView L = view(o.logits, {R, V}), T(targets.data(), {R}, DType::i32, Device::cpu);
    be->cross_entropy_stats({view(stats, {R, 3}), L, T, begin, real});
    be->cross_entropy_finish({.losses = view(o.losses, {R}),
                              .logits = L,
                              .targets = T,
                              .all_stats = view(stats, {1, R, 3}),
                              .vocab_begin = begin,
                              .vocab_real = real,
                              .dloss = dloss,
                              .lse = view(o.lse, {R}),
                              .write_dlogits = !on_load && !materialise});
    const ops::XentOnLoad x{L, view(o.lse, {R}), T, begin, real, dloss};
    if (materialise) q->xent_grad(x);
    GradQuantizeArgs g;
    g.dy = L;
    g.out.rowwise = TensorView(o.codes.data(), {R, V}, DType::e5m2, Device::cpu);
    g.out.colwise = TensorView(o.codes.data() + R * V, {V, R}, DType::e5m2, Device::cpu);
    g.out.format = Format::e5m2;
    g.out.scale = &meta[0];
    g.amax = &meta[1];
    if (on_load) g.xent = &x;
    q->quantize_grad(g);
    o.amax = meta[1];
    return o;
  };
  const Out written = run(false, false), loaded = run(true, false), made = run(false, true);
  CHECK(loaded.codes == written.codes);
  CHECK(loaded.amax == written.amax);
  CHECK(loaded.amax > 0);
  CHECK(loaded.losses == written.losses);
  CHECK(loaded.lse == written.lse);
  CHECK(made.logits == written.logits);  // xent_grad writes the loss's dlogits
  for (std::int64_t r = 0; r < R; ++r) {
    const float* row = written.logits.data() + r * V;
    for (std::int64_t v = real - begin; v < V; ++v) CHECK(row[v] == 0.0f);  // padding
    if (targets[static_cast<std::size_t>(r)] < 0) {
      CHECK(written.losses[static_cast<std::size_t>(r)] == 0.0f);
      for (std::int64_t v = 0; v < V; ++v) CHECK(row[v] == 0.0f);
    }
  }
}
