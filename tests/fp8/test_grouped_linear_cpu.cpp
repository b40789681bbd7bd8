// A mixture of experts' grouped linears in FP8 on the CPU emulation: the grouped quantisation (rows
// as they are, each expert's transpose padded to 16), and Fp8GroupedLinear's forward, data gradient and weight
// gradient against fp32 products of each expert's dequantised operands, for both weight layouts.
#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "fp8_test_util.hpp"
#include "kiln/fp8/grouped_linear.hpp"
#include "kiln/ops/formulas.hpp"

using namespace kiln;
using namespace kiln::fp8;

namespace {

TensorView host(std::vector<float>& v, Shape s) { return TensorView(v.data(), s, DType::f32, Device::cpu); }

}  // namespace

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
  ops->quantize_grouped({host(x, {R, C}), off.data(), E, out, &amax});
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
  CHECK_THROWS_WITH_AS(ops->quantize_grouped({host(x, {R, C}), bad.data(), E, out, nullptr}),
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
      lin.forward({host(out, {R, OC}), host(x, {R, IC}), host(w, wshape), off.data(), in_out}, 1);
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
      lin.backward({.dx = host(dx, {R, IC}),
                    .dweight = host(dw, wshape),
                    .dout = host(dout, {R, OC}),
                    .x = host(x, {R, IC}),
                    .weight = host(w, wshape),
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
      lin.backward({.dweight = host(dw, wshape),
                    .dout = host(dout, {R, OC}),
                    .x = host(x, {R, IC}),
                    .weight = host(w, wshape),
                    .offsets_host = off.data(),
                    .weight_in_out = in_out});
      for (std::size_t i = 0; i < dw.size(); ++i) CHECK(dw[i] == doctest::Approx(2 * once[i]).epsilon(1e-6));
    }
}
