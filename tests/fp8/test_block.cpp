// FP8 block scaling on the CPU (kiln/fp8/block.hpp): the scales' layout, the quantisation of 1x128
// and 128x128 blocks (partial ones included), and block-scaled products against products of the
// dequantised operands; and why the recipe exists: an outlier costs its own block only.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "fp8_test_util.hpp"
#include "kiln/fp8/block.hpp"
#include "kiln/fp8/ops.hpp"

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
  ops.quantize_blocks(TensorView(in.data(), {R, C}, DType::f32, Device::cpu),
                      TensorView(q.codes.data(), {R, C}, dtype_of(f), Device::cpu), q.scale_inv.data(), mode, pow2);
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
