// FP8 block scaling on the CPU (kiln/fp8/block.hpp): the scales' layout, the quantisation of 1x128
// and 128x128 blocks (partial ones included), and block-scaled products against products of the
// dequantised operands; and why the recipe exists: an outlier costs its own block only.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "fp8_test_util.hpp"
#include "kiln/fp8/block.hpp"
#include "kiln/fp8/block_linear.hpp"
#include "kiln/fp8/ops.hpp"
#include "kiln/ops/formulas.hpp"

using namespace kiln;
using namespace kiln::fp8;

namespace {

struct Quantized {
  std::vector<std::uint8_t> codes;
  std::vector<float> scale_inv;
  BlockLayout layout;
  Format f;
  // decode(code) * the scale of its block
  std::vector<float> dequantized() const {
    std::vector<float> d(codes.size());
    for (std::int64_t r = 0; r < layout.rows; ++r)
      for (std::int64_t c = 0; c < layout.cols; ++c) {
        const auto i = static_cast<std::size_t>(r * layout.cols + c);
        d[i] = decode(codes[i], f) * scale_inv[static_cast<std::size_t>(layout.index(r, c))];
      }
    return d;
  }
};

Quantized quantize(Fp8Ops& ops, const std::vector<float>& x, std::int64_t R, std::int64_t C, ScalingMode mode,
                   Format f = Format::e4m3, bool pow2 = false) {
  Quantized q{std::vector<std::uint8_t>(x.size()), {}, {mode, R, C}, f};
  q.scale_inv.assign(static_cast<std::size_t>(q.layout.count()), -1.0f);
  auto in = x;
  ops.quantize_blocks({TensorView(in.data(), {R, C}, DType::f32, Device::cpu), mode, pow2,
                       TensorView(q.codes.data(), {R, C}, dtype_of(f), Device::cpu), q.scale_inv.data()});
  return q;
}

}  // namespace

TEST_CASE("block scales are laid out as cuBLASLt reads them, the leading dimension padded to 4") {
  const BlockLayout a{ScalingMode::block_1x128, 198, 300};  // 3 K blocks, rows padded to 200
  CHECK(a.ld() == 200);
  CHECK(a.count() == 600);
  CHECK(a.index(0, 0) == 0);
  CHECK(a.index(197, 127) == 197);
  CHECK(a.index(5, 128) == 205);
  CHECK(a.index(7, 299) == 407);
  const BlockLayout b{ScalingMode::block_128x128, 300, 129};  // 3 row blocks, 2 K blocks padded to 4
  CHECK(b.ld() == 4);
  CHECK(b.count() == 12);
  CHECK(b.index(299, 0) == 8);
  CHECK(b.index(128, 128) == 5);
  CHECK(b.index(0, 128) == 1);
}

TEST_CASE("block quantisation: each block's amax reaches the format's maximum, partial and zero blocks included") {
  auto cpu = make_cpu_ops({.threads = 2});
  const std::int64_t R = 130, C = 300;  // partial blocks in both directions
  for (auto mode : {ScalingMode::block_1x128, ScalingMode::block_128x128})
    for (Format f : {Format::e4m3, Format::e5m2}) {
      INFO("mode " << static_cast<int>(mode) << " " << name_of(f));
      auto x = test::normal_values(static_cast<std::size_t>(R * C), 11);
      for (std::int64_t r = 0; r < R; ++r) x[static_cast<std::size_t>(r * C + 5)] *= 50.0f;  // one big column
      // The last K block of row 129 is zero: its scale stays 1 (and the whole tile's, 128x128, does not).
      for (std::int64_t c = 256; c < C; ++c) x[static_cast<std::size_t>(129 * C + c)] = 0.0f;
      const Quantized q = quantize(*cpu, x, R, C, mode, f);
      const auto d = q.dequantized();
      const std::int64_t row_step = mode == ScalingMode::block_1x128 ? 1 : kBlock;
      for (std::int64_t r0 = 0; r0 < R; r0 += row_step)
        for (std::int64_t c0 = 0; c0 < C; c0 += kBlock) {
          float amax = 0, worst = 0;
          bool at_max = false;
          for (std::int64_t r = r0; r < std::min(R, r0 + row_step); ++r)
            for (std::int64_t c = c0; c < std::min(C, c0 + kBlock); ++c) {
              const auto i = static_cast<std::size_t>(r * C + c);
              amax = std::max(amax, std::fabs(x[i]));
              worst = std::max(worst, std::fabs(d[i] - x[i]));
              at_max |= (q.codes[i] & 0x7f) == detail::max_code(f);
            }
          const float si = q.scale_inv[static_cast<std::size_t>(q.layout.index(r0, c0))];
          if (amax == 0.0f) {
            CHECK(si == 1.0f);
            continue;
          }
          CHECK(at_max);
          CHECK(si == doctest::Approx(amax / max_value(f)).epsilon(1e-6));
          // Round to nearest: half a step of the format's precision at the block's amax.
          CHECK(worst <= amax * (f == Format::e4m3 ? 0.0625f : 0.125f));
        }
      const float zero_block = q.scale_inv[static_cast<std::size_t>(q.layout.index(129, 256))];
      if (mode == ScalingMode::block_1x128) CHECK(zero_block == 1.0f);
      else CHECK(zero_block != 1.0f);  // row 128 of the same tile is not zero
    }
}

TEST_CASE("the transpose's blocks in the same pass equal quantising the transpose (128x128: the same scales)") {
  auto cpu = make_cpu_ops({.threads = 1});
  const std::int64_t R = 200, C = 300;
  const auto x = test::normal_values(static_cast<std::size_t>(R * C), 9);
  const auto xt = test::transpose(x, static_cast<int>(R), static_cast<int>(C));
  for (auto mode : {ScalingMode::block_1x128, ScalingMode::block_128x128}) {
    const Quantized want = quantize(*cpu, xt, C, R, mode), rows = quantize(*cpu, x, R, C, mode);
    std::vector<std::uint8_t> codes(x.size()), rcodes(x.size());
    std::vector<float> scales(want.scale_inv.size(), -1.0f), rscales(rows.scale_inv.size(), -1.0f);
    auto in = x;
    cpu->quantize_blocks({TensorView(in.data(), {R, C}, DType::f32, Device::cpu), mode, false,
                          TensorView(rcodes.data(), {R, C}, DType::e4m3, Device::cpu), rscales.data(),
                          TensorView(codes.data(), {C, R}, DType::e4m3, Device::cpu), scales.data()});
    CHECK(codes == want.codes);
    CHECK(test::same_bits(scales, want.scale_inv));
    CHECK(rcodes == rows.codes);
    if (mode == ScalingMode::block_128x128)  // tile (rb, cb) of x is tile (cb, rb) of the transpose
      for (std::int64_t r = 0; r < R; r += kBlock)
        for (std::int64_t c = 0; c < C; c += kBlock)
          CHECK(rows.scale_inv[static_cast<std::size_t>(rows.layout.index(r, c))] ==
                want.scale_inv[static_cast<std::size_t>(want.layout.index(c, r))]);
  }
}

TEST_CASE("power-of-two block scales are powers of two at or below the exact scale") {
  auto cpu = make_cpu_ops({.threads = 1});
  const auto x = test::normal_values(257 * 200, 5, 3.0f);
  for (auto mode : {ScalingMode::block_1x128, ScalingMode::block_128x128}) {
    const Quantized exact = quantize(*cpu, x, 257, 200, mode), p2 = quantize(*cpu, x, 257, 200, mode, Format::e4m3, true);
    // The values survive as well as with exact scales (at most one bit of precision less).
    const auto de = exact.dequantized(), dp = p2.dequantized();
    CHECK(test::rel_error(dp, x) < 2.5 * test::rel_error(de, x));
    CHECK(test::rel_error(dp, x) < 0.05);
    for (std::size_t i = 0; i < exact.scale_inv.size(); ++i) {
      if (exact.scale_inv[i] < 0) continue;  // padding
      int e = 0;
      CHECK(std::frexp(p2.scale_inv[i], &e) == 0.5f);  // a power of two
      CHECK(p2.scale_inv[i] >= exact.scale_inv[i]);    // the scale rounded down
      CHECK(p2.scale_inv[i] < 2 * exact.scale_inv[i]);
    }
  }
}

TEST_CASE("block-scaled products equal products of the dequantised operands (every mode pair, awkward shapes)") {
  auto cpu = make_cpu_ops({.threads = 2});
  using M = ScalingMode;
  struct Case {
    std::int64_t m, n, k;
    M xm, ym;
  } cases[] = {{200, 272, 384, M::block_1x128, M::block_128x128},  // forward / dgrad: activations x weights
               {77, 48, 336, M::block_1x128, M::block_1x128},     // wgrad: both along the tokens
               {130, 129, 200, M::block_128x128, M::block_1x128},
               {1, 16, 1000, M::block_1x128, M::block_128x128}};
  std::uint64_t seed = 40;
  for (const Case& c : cases) {
    INFO(c.m << " x " << c.n << " x " << c.k << " modes " << static_cast<int>(c.xm) << ", " << static_cast<int>(c.ym));
    auto xv = test::normal_values(static_cast<std::size_t>(c.m * c.k), ++seed);
    auto yv = test::normal_values(static_cast<std::size_t>(c.n * c.k), ++seed, 0.05f);
    for (std::size_t i = 0; i < xv.size(); i += 97) xv[i] *= 30.0f;  // outliers
    const Quantized qx = quantize(*cpu, xv, c.m, c.k, c.xm), qy = quantize(*cpu, yv, c.n, c.k, c.ym, Format::e5m2);
    const auto want = test::matmul_nt(qx.dequantized(), qy.dequantized(), static_cast<int>(c.m), static_cast<int>(c.n),
                                      static_cast<int>(c.k));
    std::vector<float> d(want.size(), 7.0f);
    auto xc = qx.codes, yc = qy.codes;
    auto xs = qx.scale_inv, ys = qy.scale_inv;
    GemmArgs g;
    g.x = TensorView(xc.data(), {c.m, c.k}, DType::e4m3, Device::cpu);
    g.y = TensorView(yc.data(), {c.n, c.k}, DType::e5m2, Device::cpu);
    g.d = TensorView(d.data(), {c.m, c.n}, DType::f32, Device::cpu);
    g.x_scale_inv = xs.data();
    g.y_scale_inv = ys.data();
    g.x_mode = c.xm;
    g.y_mode = c.ym;
    g.f32_result = true;
    cpu->gemm(g);
    CHECK(test::rel_error(d, want) < 1e-6);
    // Accumulating adds the product to what D holds.
    auto before = d;
    g.accumulate = true;
    cpu->gemm(g);
    for (std::size_t i = 0; i < d.size(); i += 13) CHECK(d[i] == doctest::Approx(2 * before[i]).epsilon(1e-6));
  }
}

TEST_CASE("an outlier costs its own block: block scaling keeps small values that per-tensor scaling flushes") {
  auto cpu = make_cpu_ops({.threads = 1});
  const std::int64_t R = 256, C = 512;
  auto x = test::normal_values(static_cast<std::size_t>(R * C), 3, 1e-3f);
  x[1000] = 1000.0f;  // one outlier, 10^6 times the typical value
  // Per tensor: the outlier sets the one scale (448 / 1000); values of 1e-3 then fall below E4M3's
  // smallest subnormal (2^-9 after scaling) and are flushed or keep a bit or two.
  const float s = compute_scale(448.0f, 1000.0f, 0, 1.0f);
  const auto per_tensor = test::fake_quantize(x, s, Format::e4m3);
  const auto block = quantize(*cpu, x, R, C, ScalingMode::block_1x128).dequantized();
  auto error_without_outlier_block = [&](const std::vector<float>& q) {
    double num = 0, den = 0;
    for (std::int64_t i = 0; i < R * C; ++i) {
      if (i / C == 1000 / C && i % C / kBlock == 1000 % C / kBlock) continue;  // the outlier's 1x128 block
      num += (q[static_cast<std::size_t>(i)] - x[static_cast<std::size_t>(i)]) *
             double(q[static_cast<std::size_t>(i)] - x[static_cast<std::size_t>(i)]);
      den += x[static_cast<std::size_t>(i)] * double(x[static_cast<std::size_t>(i)]);
    }
    return std::sqrt(num / den);
  };
  const double e_tensor = error_without_outlier_block(per_tensor), e_block = error_without_outlier_block(block);
  INFO("relative error outside the outlier's block: per tensor " << e_tensor << ", 1x128 blocks " << e_block);
  CHECK(e_tensor > 0.3);
  CHECK(e_block < 0.04);
}

TEST_CASE("a block-scaled FP8 linear layer computes out, dx, dweight and dbias as the exact products within FP8's error") {
  auto cpu = make_cpu_ops({.threads = 2});
  for (const bool two_d : {false, true}) {  // the weight gradient's input in 1x128 or 128x128 blocks
    CAPTURE(two_d);
    fp8::Fp8Workspace ws(*cpu);
    fp8::BlockRecipe recipe;
    recipe.wgrad_input_2d = two_d;
    fp8::Fp8BlockLinear lin(*cpu, ws, recipe, "test");
    const int N = 200, IC = 300, OC = 136;
    auto x = test::normal_values(static_cast<std::size_t>(N * IC), 1), w = test::normal_values(static_cast<std::size_t>(OC * IC), 2, 0.05f),
         b = test::normal_values(static_cast<std::size_t>(OC), 3), dout = test::normal_values(static_cast<std::size_t>(N * OC), 4, 1e-3f);
    std::vector<float> out(static_cast<std::size_t>(N * OC)), dx(static_cast<std::size_t>(N * IC)),
        dw(static_cast<std::size_t>(OC * IC), 0.5f), db(static_cast<std::size_t>(OC), 0.25f);
    auto view = [](std::vector<float>& v, std::int64_t r, std::int64_t c) { return TensorView(v.data(), {r, c}, DType::f32, Device::cpu); };
    ops::LinearForward f{view(out, N, OC), {}, view(x, N, IC), view(w, OC, IC), TensorView(b.data(), {OC}, DType::f32, Device::cpu)};
    lin.forward(f, 1);
    ops::LinearBackward bw{view(dx, N, IC), view(dw, OC, IC), TensorView(db.data(), {OC}, DType::f32, Device::cpu),
                           view(dout, N, OC), view(x, N, IC), view(w, OC, IC)};
    lin.backward(bw);
    // References in double: out = x W^T + b, dx = dout W, dW = 0.5 + dout^T x, db = 0.25 + column sums of dout.
    auto want_out = test::matmul_nt(x, w, N, OC, IC);
    for (int n = 0; n < N; ++n)
      for (int o = 0; o < OC; ++o) want_out[static_cast<std::size_t>(n * OC + o)] += b[static_cast<std::size_t>(o)];
    const auto want_dx = test::matmul_nt(dout, test::transpose(w, OC, IC), N, IC, OC);
    auto want_dw = test::matmul_nt(test::transpose(dout, N, OC), test::transpose(x, N, IC), OC, IC, N);
    for (auto& v : want_dw) v += 0.5f;
    std::vector<float> want_db(static_cast<std::size_t>(OC), 0.25f);
    for (int n = 0; n < N; ++n)
      for (int o = 0; o < OC; ++o) want_db[static_cast<std::size_t>(o)] += dout[static_cast<std::size_t>(n * OC + o)];
    auto minus = [](std::vector<float> v, float c) { for (auto& e : v) e -= c; return v; };
    const double e_out = test::rel_error(out, want_out), e_dx = test::rel_error(dx, want_dx),
                 e_dw = test::rel_error(minus(dw, 0.5f), minus(want_dw, 0.5f)), e_db = test::rel_error(db, want_db);
    MESSAGE("relative errors: out " << e_out << ", dx " << e_dx << ", dweight " << e_dw << ", dbias " << e_db);
    // E4M3 keeps 3 mantissa bits: each operand ~2.5% relative rounding, products of K terms average it down.
    CHECK(e_out < 0.05);
    CHECK(e_dx < 0.05);
    CHECK(e_dw < 0.05);
    CHECK(e_db < 1e-6);
  }
}

TEST_CASE("a block-scaled FP8 linear layer given its operands through prologues equals the layer given their values") {
  auto cpu = make_cpu_ops({.threads = 2});
  const std::int64_t N = 136, IC = 200, OC = 144;
  auto view = [](std::vector<float>& v, std::int64_t r, std::int64_t c) {
    return TensorView(v.data(), {r, c}, DType::f32, Device::cpu);
  };
  auto w = test::normal_values(static_cast<std::size_t>(OC * IC), 2, 0.05f), b = test::normal_values(static_cast<std::size_t>(OC), 3);
  struct Result {
    std::vector<float> out, dx, dw, db, mean, rstd;
  };
  // One forward and backward of a fresh layer with the input and output gradient given as they are.
  auto run = [&](const ops::LinearInput& x, const ops::OutputGrad& dout) {
    fp8::Fp8Workspace ws(*cpu);
    fp8::Fp8BlockLinear lin(*cpu, ws, {}, "test");
    Result r{std::vector<float>(static_cast<std::size_t>(N * OC)), std::vector<float>(static_cast<std::size_t>(N * IC)),
             std::vector<float>(static_cast<std::size_t>(OC * IC), 0.5f), std::vector<float>(static_cast<std::size_t>(OC), 0.25f)};
    lin.forward({view(r.out, N, OC), {}, x, view(w, OC, IC), TensorView(b.data(), {OC}, DType::f32, Device::cpu)}, 1);
    lin.backward({view(r.dx, N, IC), view(r.dw, OC, IC), TensorView(r.db.data(), {OC}, DType::f32, Device::cpu), dout, x,
                  view(w, OC, IC)});
    return r;
  };
  auto same = [](const Result& a, const Result& b) {
    CHECK(test::same_bits(a.out, b.out));
    CHECK(test::same_bits(a.dx, b.dx));
    CHECK(test::same_bits(a.dw, b.dw));
    CHECK(test::same_bits(a.db, b.db));
  };
  auto dout = test::normal_values(static_cast<std::size_t>(N * OC), 4, 1e-2f);

  SUBCASE("the input as a LayerNorm's output, computed from the statistics the forward writes") {
    auto x = test::normal_values(static_cast<std::size_t>(N * IC), 5, 2.0f);
    auto lw = test::normal_values(static_cast<std::size_t>(IC), 6), lb = test::normal_values(static_cast<std::size_t>(IC), 7);
    std::vector<float> mean(static_cast<std::size_t>(N), -9.0f), rstd(static_cast<std::size_t>(N), -9.0f), y(x.size());
    for (std::int64_t n = 0; n < N; ++n) {
      float m = 0, s = 0;
      ops::layernorm_row_stats(x.data() + n * IC, IC, 1e-5f, m, s);
      for (std::int64_t c = 0; c < IC; ++c)
        y[static_cast<std::size_t>(n * IC + c)] = ops::layernorm_apply(x[static_cast<std::size_t>(n * IC + c)], m, s,
                                                                        lw[static_cast<std::size_t>(c)], lb[static_cast<std::size_t>(c)]);
    }
    const ops::LayerNormOnLoad ln{view(x, N, IC), TensorView(lw.data(), {IC}, DType::f32, Device::cpu),
                                  TensorView(lb.data(), {IC}, DType::f32, Device::cpu),
                                  TensorView(mean.data(), {N}, DType::f32, Device::cpu),
                                  TensorView(rstd.data(), {N}, DType::f32, Device::cpu)};
    same(run(ln, view(dout, N, OC)), run(view(y, N, IC), view(dout, N, OC)));
    CHECK(mean[0] != -9.0f);  // the forward wrote the statistics
  }
  SUBCASE("GELU on load, and the output gradient through the next GELU's backward") {
    auto pre = test::normal_values(static_cast<std::size_t>(N * IC), 8, 2.0f), opre = test::normal_values(static_cast<std::size_t>(N * OC), 9, 2.0f);
    std::vector<float> x(pre.size()), g(dout.size());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = ops::gelu(pre[i]);
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = dout[i] * ops::gelu_grad(opre[i]);
    same(run(ops::GeluOnLoad{view(pre, N, IC)}, ops::DgeluOnLoad{view(dout, N, OC), view(opre, N, OC)}),
         run(view(x, N, IC), view(g, N, OC)));
  }
  SUBCASE("SwiGLU on load, and the output gradient through the next SwiGLU's backward") {
    auto gate_up = test::normal_values(static_cast<std::size_t>(N * 2 * IC), 10, 1.5f),
         ogu = test::normal_values(static_cast<std::size_t>(N * OC), 11, 1.5f),
         dsw = test::normal_values(static_cast<std::size_t>(N * OC / 2), 12, 1e-2f);
    std::vector<float> x(static_cast<std::size_t>(N * IC)), g(static_cast<std::size_t>(N * OC));
    const std::int64_t F = OC / 2;
    for (std::int64_t n = 0; n < N; ++n) {
      for (std::int64_t c = 0; c < IC; ++c)
        x[static_cast<std::size_t>(n * IC + c)] =
            ops::swiglu(gate_up[static_cast<std::size_t>(n * 2 * IC + c)], gate_up[static_cast<std::size_t>(n * 2 * IC + IC + c)]);
      for (std::int64_t f = 0; f < F; ++f) {
        const float gt = ogu[static_cast<std::size_t>(n * OC + f)], up = ogu[static_cast<std::size_t>(n * OC + F + f)],
                    go = dsw[static_cast<std::size_t>(n * F + f)];
        g[static_cast<std::size_t>(n * OC + f)] = ops::dswiglu_gate(go, gt, up);
        g[static_cast<std::size_t>(n * OC + F + f)] = ops::dswiglu_up(go, gt);
      }
    }
    same(run(ops::SwigluOnLoad{view(gate_up, N, 2 * IC)}, ops::DswigluOnLoad{view(dsw, N, F), view(ogu, N, OC)}),
         run(view(x, N, IC), view(g, N, OC)));
  }
}

TEST_CASE("a 128x128-scaled weight quantised in parts with the tiles' agreed amaxes equals the whole weight quantised") {
  // FSDP's shards of a weight: flat ranges that start and end mid-row and mid-tile. Each part's tile
  // amaxes max-accumulated into one array (the ranks' all-reduce), the scales from it, each part's
  // codes: the whole weight's codes and scales, and its transpose's scales.
  auto cpu = make_cpu_ops({.threads = 1});
  for (auto [R, C] : {std::pair<std::int64_t, std::int64_t>{300, 200}, {256, 384}, {130, 129}})
    for (bool pow2 : {false, true}) {
      INFO(R << " x " << C << (pow2 ? " pow2" : ""));
      auto x = test::normal_values(static_cast<std::size_t>(R * C), 11, 0.05f);
      for (std::size_t i = 0; i < x.size(); i += 131) x[i] *= 40.0f;
      const BlockLayout l{ScalingMode::block_128x128, R, C}, tl{ScalingMode::block_128x128, C, R};
      std::vector<std::uint8_t> want(x.size()), want_t(x.size()), got(x.size(), 0xaa);
      std::vector<float> want_s(static_cast<std::size_t>(l.count()), -1.0f), want_ts(static_cast<std::size_t>(tl.count()), -1.0f);
      cpu->quantize_blocks({TensorView(x.data(), {R, C}, DType::f32, Device::cpu), ScalingMode::block_128x128, pow2,
                            TensorView(want.data(), {R, C}, DType::e4m3, Device::cpu), want_s.data(),
                            TensorView(want_t.data(), {C, R}, DType::e4m3, Device::cpu), want_ts.data()});
      std::vector<float> amax(static_cast<std::size_t>(l.count()), 0.0f), scale(amax.size()),
          row_si(amax.size(), -1.0f), col_si(static_cast<std::size_t>(tl.count()), -1.0f);
      const std::int64_t n = R * C, cuts[] = {0, n / 3 + 7, 2 * n / 3 - 5, n};
      for (int k = 0; k < 3; ++k)
        cpu->block_part_amax({x.data() + cuts[k], cuts[k + 1] - cuts[k], cuts[k], R, C}, amax.data());
      cpu->block_scales(amax.data(), R, C, Format::e4m3, pow2, scale.data(), row_si.data(), col_si.data());
      for (int k = 0; k < 3; ++k)
        cpu->quantize_block_part({x.data() + cuts[k], cuts[k + 1] - cuts[k], cuts[k], R, C}, scale.data(), Format::e4m3,
                                 got.data() + cuts[k]);
      CHECK(got == want);
      CHECK(test::same_bits(row_si, want_s));
      CHECK(test::same_bits(col_si, want_ts));
    }
}

TEST_CASE("a block-scaled FP8 linear backward calls dgrad_queued once dx is written, before the weight and bias gradients") {
  auto cpu = make_cpu_ops({.threads = 2});
  fp8::Fp8Workspace ws(*cpu);
  fp8::Fp8BlockLinear lin(*cpu, ws, {}, "test");
  const std::int64_t N = 136, IC = 200, OC = 144;
  auto view = [](std::vector<float>& v, std::int64_t r, std::int64_t c) {
    return TensorView(v.data(), {r, c}, DType::f32, Device::cpu);
  };
  auto x = test::normal_values(static_cast<std::size_t>(N * IC), 21), w = test::normal_values(static_cast<std::size_t>(OC * IC), 22, 0.05f),
       dout = test::normal_values(static_cast<std::size_t>(N * OC), 23, 1e-2f), pre = test::normal_values(static_cast<std::size_t>(N * IC), 24, 2.0f);
  std::vector<float> out(static_cast<std::size_t>(N * OC)), dx(static_cast<std::size_t>(N * IC), -7.0f),
      dw = test::normal_values(static_cast<std::size_t>(OC * IC), 25), db = test::normal_values(static_cast<std::size_t>(OC), 26);
  const auto dw0 = dw;
  lin.forward({view(out, N, OC), {}, view(x, N, IC), view(w, OC, IC), {}}, 1);
  test::DgradProbe probe{dx, dw};
  ops::LinearBackward bw{view(dx, N, IC), view(dw, OC, IC), TensorView(db.data(), {OC}, DType::f32, Device::cpu),
                         view(dout, N, OC), view(x, N, IC), view(w, OC, IC), view(pre, N, IC)};
  bw.dgrad_queued = probe.hook();
  lin.backward(bw);
  probe.check(dw0);
}
