// A mixture of experts' grouped linears in FP8 on the CPU emulation: the grouped quantisation (rows
// as they are, each expert's transpose padded to 16, or activations computed on load), and
// Fp8GroupedLinear's forward, data gradient and weight gradient against fp32 products of each
// expert's dequantised operands, for both weight layouts, and through prologues and a kept input.
#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "fp8_test_util.hpp"
#include "host_view.hpp"
#include "kiln/fp8/grouped_linear.hpp"
#include "kiln/ops/formulas.hpp"

using namespace kiln;
using kiln::test::view;
using namespace kiln::fp8;

TEST_CASE("CPU grouped quantisation: the rows as they are, each expert's transpose padded to 16 with zeros, the amax") {
  auto ops = make_cpu_ops({.threads = 2});
  const int R = 30, C = 6, E = 4;
  // an empty expert, one of exactly 16 rows, two rows past the experts'
  const std::vector<std::int32_t> off = {0, 5, 5, 21, 28};
  CHECK(segment_rows(off.data(), 0) == 16);
  CHECK(segment_rows(off.data(), 1) == 0);
  CHECK(segment_rows(off.data(), 2) == 16);
  CHECK(segment_row(off.data(), 3) == 32);
  const std::int64_t S = segment_row(off.data(), E);
  CHECK(S == 48);
  auto x = test::normal_values(R * C, 5, 2.0f);
  x[29 * C + 1] = 100.0f;  // past the experts' rows: neither quantised nor in the amax
  float scale = 20.0f, scale_inv = 1.0f / 20.0f, amax = 0;
  std::vector<std::uint8_t> row(off[E] * C, 0xaa), col(S * C, 0xaa);
  Fp8TensorView out;
  out.rowwise = TensorView(row.data(), {off[E], C}, DType::e4m3, Device::cpu);
  out.colwise = TensorView(col.data(), {S * C}, DType::e4m3, Device::cpu);
  out.scale = &scale;
  out.scale_inv = &scale_inv;
  ops->quantize_grouped({view(x, {R, C}), off.data(), E, out, &amax});
  for (int r = 0; r < off[E]; ++r)
    for (int c = 0; c < C; ++c) CHECK(row[r * C + c] == fp8::quantize(x[r * C + c], scale, Format::e4m3));
  for (int e = 0; e < E; ++e) {
    const std::int64_t P = segment_rows(off.data(), e), at = segment_row(off.data(), e);
    for (int p = 0; p < P; ++p)
      for (int c = 0; c < C; ++c) {
        const int r = off[e] + p;
        const std::uint8_t want = r < off[e + 1] ? fp8::quantize(x[r * C + c], scale, Format::e4m3) : 0;
        CHECK(col[at * C + c * P + p] == want);
      }
  }
  float want_amax = 0;
  for (int i = 0; i < off[E] * C; ++i) want_amax = std::max(want_amax, std::fabs(x[i]));
  CHECK(amax == want_amax);
  // Offsets that decrease are refused.
  const std::vector<std::int32_t> bad = {0, 9, 4, 12, 28};
  CHECK_THROWS_WITH_AS(ops->quantize_grouped({view(x, {R, C}), bad.data(), E, out, nullptr}),
                       doctest::Contains("offsets decrease at expert 1"), Error);
}

TEST_CASE("Fp8GroupedLinear: forward, data and weight gradients are each expert's products of dequantised operands") {
  for (const bool in_out : {false, true})
    for (const RecipeKind kind : {RecipeKind::delayed, RecipeKind::current}) {
      CAPTURE(in_out);
      CAPTURE(kind == RecipeKind::delayed);
      auto ops = make_cpu_ops({.threads = 2});
      const FormatPolicy policy = FormatPolicy::hybrid;
      Fp8MetaStore meta(*ops, {format_for(policy, TensorRole::input), format_for(policy, TensorRole::weight),
                               format_for(policy, TensorRole::grad_output)},
                        kind == RecipeKind::delayed ? 4 : 1);
      Fp8Workspace ws(*ops);
      const Fp8Recipe recipe{kind, 4, AmaxAlgo::max, 0, policy, false};
      Fp8GroupedLinear lin(*ops, meta, 0, ws, recipe, "test.experts");
      const int E = 3, R = 21, IC = 24, OC = 40;
      const std::vector<std::int32_t> off = {0, 7, 7, 19};
      auto x = test::normal_values(R * IC, 11), w = test::normal_values(E * OC * IC, 12, 0.3f);
      auto dout = test::normal_values(R * OC, 13, 0.01f);
      const Shape wshape = in_out ? Shape{E, IC, OC} : Shape{E, OC, IC};
      // Element (o, i) of expert e's weight as [out, in].
      auto w_at = [&](int e, int o, int i) { return in_out ? (e * IC + i) * OC + o : (e * OC + o) * IC + i; };
      std::vector<float> out(R * OC, 7.0f);
      lin.forward({view(out, {R, OC}), view(x, {R, IC}), view(w, wshape), off.data(), in_out}, 1);
      // The forward's scales (the layer's slots): the reference quantises with them.
      const float sx = *lin.slot(TensorRole::input).scale, sw = *lin.slot(TensorRole::weight).scale;
      const auto xd = test::fake_quantize(x, sx, Format::e4m3), wd = test::fake_quantize(w, sw, Format::e4m3);
      std::vector<float> want(R * OC, 7.0f);
      for (int e = 0; e < E; ++e)
        for (int r = off[e]; r < off[e + 1]; ++r)
          for (int o = 0; o < OC; ++o) {
            double acc = 0;
            for (int i = 0; i < IC; ++i) acc += double(xd[r * IC + i]) * wd[w_at(e, o, i)];
            want[r * OC + o] = static_cast<float>(acc);
          }
      CHECK(test::rel_error(out, want) < 1e-6);
      CHECK(out[(R - 1) * OC] == 7.0f);  // rows past the experts' left alone

      std::vector<float> dx(R * IC, 3.0f), dw(E * OC * IC, 0.5f);
      lin.backward({.dx = view(dx, {R, IC}),
                    .dweight = view(dw, wshape),
                    .dout = view(dout, {R, OC}),
                    .x = view(x, {R, IC}),
                    .weight = view(w, wshape),
                    .offsets_host = off.data(),
                    .weight_in_out = in_out,
                    .dweight_overwrite = true});
      const float sg = *lin.slot(TensorRole::grad_output).scale;
      const auto gd = test::fake_quantize(dout, sg, Format::e5m2);
      std::vector<float> want_dx(R * IC, 0.0f), want_dw(E * OC * IC, 0.0f);
      for (int e = 0; e < E; ++e) {
        for (int r = off[e]; r < off[e + 1]; ++r)
          for (int i = 0; i < IC; ++i) {
            double acc = 0;
            for (int o = 0; o < OC; ++o) acc += double(gd[r * OC + o]) * wd[w_at(e, o, i)];
            want_dx[r * IC + i] = static_cast<float>(acc);
          }
        for (int o = 0; o < OC; ++o)
          for (int i = 0; i < IC; ++i) {
            double acc = 0;
            for (int r = off[e]; r < off[e + 1]; ++r) acc += double(gd[r * OC + o]) * xd[r * IC + i];
            want_dw[w_at(e, o, i)] = static_cast<float>(acc);
          }
      }
      CHECK(test::rel_error(dx, want_dx) < 1e-6);
      for (int r = off[E]; r < R; ++r) CHECK(dx[r * IC] == 0.0f);  // rows past the experts': zero
      CHECK(test::rel_error(dw, want_dw) < 1e-6);
      for (int o = 0; o < OC; ++o) CHECK(dw[w_at(1, o, 0)] == 0.0f);  // the empty expert: written zero
      // Accumulating adds the same again.
      const auto once = dw;
      lin.backward({.dweight = view(dw, wshape),
                    .dout = view(dout, {R, OC}),
                    .x = view(x, {R, IC}),
                    .weight = view(w, wshape),
                    .offsets_host = off.data(),
                    .weight_in_out = in_out});
      for (std::size_t i = 0; i < dw.size(); ++i) CHECK(dw[i] == doctest::Approx(2 * once[i]).epsilon(1e-6));
    }
}

namespace {

// The activations' values as the CPU backend's ops store them (f32: no rounding).
std::vector<float> swiglu_values(const std::vector<float>& pre, int R, int F) {
  std::vector<float> v(static_cast<std::size_t>(R * F));
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) v[r * F + f] = ops::swiglu(pre[r * 2 * F + f], pre[r * 2 * F + F + f]);
  return v;
}
std::vector<float> dswiglu_values(const std::vector<float>& dact, const std::vector<float>& pre, int R, int F) {
  std::vector<float> v(static_cast<std::size_t>(R * 2 * F));
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) {
      const float g = pre[r * 2 * F + f], u = pre[r * 2 * F + F + f], go = dact[r * F + f];
      v[r * 2 * F + f] = ops::dswiglu_gate(go, g, u);
      v[r * 2 * F + F + f] = ops::dswiglu_up(go, g);
    }
  return v;
}
std::vector<float> gelu_values(const std::vector<float>& pre) {
  std::vector<float> v(pre.size());
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = ops::gelu(pre[i]);
  return v;
}
std::vector<float> dgelu_values(const std::vector<float>& dact, const std::vector<float>& pre) {
  std::vector<float> v(pre.size());
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = dact[i] * ops::gelu_grad(pre[i]);
  return v;
}

}  // namespace

TEST_CASE("CPU grouped quantisation from a prologue equals quantising the activation op's values, bit for bit") {
  auto ops = make_cpu_ops({.threads = 2});
  const int R = 30, F = 10, E = 4;
  const std::vector<std::int32_t> off = {0, 5, 5, 21, 28};
  const std::int64_t S = segment_row(off.data(), E);
  auto pre2 = test::normal_values(R * 2 * F, 21, 2.0f), pre = test::normal_values(R * F, 22, 2.0f);
  auto dact = test::normal_values(R * F, 23, 0.5f);
  struct Case {
    const char* name;
    GroupedSource src;
    std::vector<float> values;
    int cols;
  };
  std::vector<Case> cases;
  cases.push_back({"gelu", ops::GeluOnLoad{view(pre, {R, F})}, gelu_values(pre), F});
  cases.push_back({"swiglu", ops::SwigluOnLoad{view(pre2, {R, 2 * F})}, swiglu_values(pre2, R, F), F});
  cases.push_back({"dgelu", ops::DgeluOnLoad{view(dact, {R, F}), view(pre, {R, F})}, dgelu_values(dact, pre), F});
  cases.push_back({"dswiglu", ops::DswigluOnLoad{view(dact, {R, F}), view(pre2, {R, 2 * F})},
                   dswiglu_values(dact, pre2, R, F), 2 * F});
  for (Case& c : cases) {
    CAPTURE(c.name);
    const int C = c.cols;
    float scale = 20.0f, amax[2] = {0, 0};
    std::vector<std::uint8_t> row[2], col[2];
    for (int k = 0; k < 2; ++k) {
      row[k].assign(static_cast<std::size_t>(off[E] * C), 0xaa);
      col[k].assign(static_cast<std::size_t>(S * C), 0xaa);
      Fp8TensorView out;
      out.rowwise = TensorView(row[k].data(), {off[E], C}, DType::e4m3, Device::cpu);
      out.colwise = TensorView(col[k].data(), {S * C}, DType::e4m3, Device::cpu);
      out.scale = &scale;
      const GroupedSource src = k == 0 ? c.src : GroupedSource(view(c.values, {R, C}));
      ops->quantize_grouped({src, off.data(), E, out, &amax[k]});
    }
    CHECK(row[0] == row[1]);
    CHECK(col[0] == col[1]);
    CHECK(amax[0] == amax[1]);
    CHECK(amax[0] > 0.0f);
    float alone = 0;  // neither copy: the amax alone
    ops->quantize_grouped({c.src, off.data(), E, Fp8TensorView{.scale = &scale}, &alone});
    CHECK(alone == amax[0]);
  }
  // A source whose tensors do not fit together is named.
  CHECK_THROWS_WITH_AS(ops->quantize_grouped({ops::DswigluOnLoad{view(dact, {R, F}), view(pre2, {R, F})}, off.data(),
                                              E, Fp8TensorView{.scale = nullptr}, nullptr}),
                       doctest::Contains("the SwiGLU output's gradient"), Error);
}

TEST_CASE("Fp8GroupedLinear: an input and output gradient through prologues, and a kept input, give the plain path's "
          "results bit for bit") {
  for (const bool swiglu : {true, false})
    for (const RecipeKind kind : {RecipeKind::delayed, RecipeKind::current}) {
      CAPTURE(swiglu);
      CAPTURE(kind == RecipeKind::delayed);
      auto ops = make_cpu_ops({.threads = 2});
      const FormatPolicy policy = FormatPolicy::hybrid;
      std::vector<Format> formats;
      for (int layer = 0; layer < 2; ++layer)
        for (TensorRole r : {TensorRole::input, TensorRole::weight, TensorRole::grad_output})
          formats.push_back(format_for(policy, r));
      const int history = kind == RecipeKind::delayed ? 4 : 1;
      Fp8MetaStore meta_a(*ops, formats, history), meta_b(*ops, formats, history);
      Fp8Workspace ws(*ops);
      const Fp8Recipe recipe{kind, 4, AmaxAlgo::max, 0, policy, false};
      // An FC2 (weight stored [in, out] per expert) and an FC1 ([out, in]), each plain and fused.
      Fp8GroupedLinear fc2_a(*ops, meta_a, 0, ws, recipe, "plain.proj"), fc1_a(*ops, meta_a, 3, ws, recipe, "plain.fc");
      Fp8GroupedLinear fc2_b(*ops, meta_b, 0, ws, recipe, "fused.proj", /*keep_input=*/true),
          fc1_b(*ops, meta_b, 3, ws, recipe, "fused.fc");
      const int E = 3, R = 37, H = 16, C = 24, FC = swiglu ? 2 * H : H;
      const std::vector<std::int32_t> off = {0, 9, 9, 33};
      auto w2 = test::normal_values(E * H * C, 31, 0.3f), w1 = test::normal_values(E * FC * C, 32, 0.3f);
      auto x = test::normal_values(R * C, 33, 1.0f);
      for (int step = 1; step <= 3; ++step) {  // delayed scaling takes the recorded amaxes from step 2 on
        CAPTURE(step);
        auto pre = test::normal_values(R * FC, 40 + step, 2.0f), dy = test::normal_values(R * C, 50 + step, 0.01f);
        std::vector<float> act = swiglu ? swiglu_values(pre, R, H) : gelu_values(pre);
        const ops::LinearInput on_load =
            swiglu ? ops::LinearInput(ops::SwigluOnLoad{view(pre, {R, FC})}) : ops::LinearInput(ops::GeluOnLoad{view(pre, {R, FC})});
        std::vector<float> y_a(R * C, 0.0f), y_b(R * C, 0.0f);
        fc2_a.forward({view(y_a, {R, C}), view(act, {R, H}), view(w2, {E, H, C}), off.data(), true}, step);
        fc2_b.forward({view(y_b, {R, C}), on_load, view(w2, {E, H, C}), off.data(), true}, step);
        CHECK(y_a == y_b);
        std::vector<float> dact_a(R * H, 0.0f), dact_b(R * H, 0.0f), dw2_a(E * H * C), dw2_b(E * H * C);
        fc2_a.backward({.dx = view(dact_a, {R, H}), .dweight = view(dw2_a, {E, H, C}), .dout = view(dy, {R, C}),
                        .x = view(act, {R, H}), .weight = view(w2, {E, H, C}), .offsets_host = off.data(),
                        .weight_in_out = true, .dweight_overwrite = true});
        // The kept input: the backward reads none (an empty view).
        fc2_b.backward({.dx = view(dact_b, {R, H}), .dweight = view(dw2_b, {E, H, C}), .dout = view(dy, {R, C}),
                        .x = TensorView{}, .weight = view(w2, {E, H, C}), .offsets_host = off.data(),
                        .weight_in_out = true, .dweight_overwrite = true});
        CHECK(dact_a == dact_b);
        CHECK(dw2_a == dw2_b);
        // FC1: the plain output gradient is the activation's backward of dact.
        std::vector<float> dpre = swiglu ? dswiglu_values(dact_a, pre, R, H) : dgelu_values(dact_a, pre);
        const ops::OutputGrad grad_on_load = swiglu ? ops::OutputGrad(ops::DswigluOnLoad{view(dact_b, {R, H}), view(pre, {R, FC})})
                                                    : ops::OutputGrad(ops::DgeluOnLoad{view(dact_b, {R, H}), view(pre, {R, FC})});
        std::vector<float> h_a(R * FC), h_b(R * FC), dx_a(R * C), dx_b(R * C), dw1_a(E * FC * C), dw1_b(E * FC * C);
        fc1_a.forward({view(h_a, {R, FC}), view(x, {R, C}), view(w1, {E, FC, C}), off.data()}, step);
        fc1_b.forward({view(h_b, {R, FC}), view(x, {R, C}), view(w1, {E, FC, C}), off.data()}, step);
        fc1_a.backward({.dx = view(dx_a, {R, C}), .dweight = view(dw1_a, {E, FC, C}), .dout = view(dpre, {R, FC}),
                        .x = view(x, {R, C}), .weight = view(w1, {E, FC, C}), .offsets_host = off.data(),
                        .dweight_overwrite = true});
        fc1_b.backward({.dx = view(dx_b, {R, C}), .dweight = view(dw1_b, {E, FC, C}), .dout = grad_on_load,
                        .x = view(x, {R, C}), .weight = view(w1, {E, FC, C}), .offsets_host = off.data(),
                        .dweight_overwrite = true});
        CHECK(dx_a == dx_b);
        CHECK(dw1_a == dw1_b);
        for (int i = 0; i < 6; ++i) CHECK(meta_a.scales().as<float>()[i] == meta_b.scales().as<float>()[i]);
      }
      // A backward over another grouping than its forward's kept input is refused, naming the layer.
      const std::vector<std::int32_t> other = {0, 9, 10, 33};
      std::vector<float> dw(E * H * C), dy(R * C, 0.01f);
      CHECK_THROWS_WITH_AS(fc2_b.backward({.dweight = view(dw, {E, H, C}), .dout = view(dy, {R, C}),
                                           .weight = view(w2, {E, H, C}), .offsets_host = other.data(),
                                           .weight_in_out = true}),
                           doctest::Contains("fused.proj: backward without its forward's kept input"), Error);
      // A LayerNorm prologue is not a grouped linear's.
      std::vector<float> y(R * C);
      CHECK_THROWS_WITH_AS(fc1_b.forward({view(y, {R, C}), ops::LayerNormOnLoad{}, view(w1, {E, FC, C}), off.data()}, 9),
                           doctest::Contains("takes no layernorm-on-load prologue"), Error);
    }
}
