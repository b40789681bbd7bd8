// The CPU references of block scaling (kiln/fp8/block.hpp): the quantisation the CUDA kernels match
// bit for bit, and the block-scaled product cuBLASLt's computes up to f32 rounding.
#include "kiln/fp8/block.hpp"

#include <omp.h>

#include <vector>

#include "kiln/core/error.hpp"

namespace kiln::fp8 {

void quantize_blocks_reference(const float* x, const BlockLayout& l, Format f, bool pow2, std::uint8_t* codes,
                               float* scale_inv) {
  KILN_CHECK(l.mode == ScalingMode::block_1x128 || l.mode == ScalingMode::block_128x128,
             "quantize_blocks: a block scaling mode is needed");
  const std::int64_t R = l.rows, C = l.cols;
  const std::int64_t row_step = l.mode == ScalingMode::block_1x128 ? 1 : kBlock;
  const float fmax = max_value(f);
  for (std::int64_t r0 = 0; r0 < R; r0 += row_step)
    for (std::int64_t c0 = 0; c0 < C; c0 += kBlock) {
      const std::int64_t r1 = std::min(R, r0 + row_step), c1 = std::min(C, c0 + kBlock);
      float amax = 0.0f;
      for (std::int64_t r = r0; r < r1; ++r)
        for (std::int64_t c = c0; c < c1; ++c) amax = amax_max(amax, bits_float(abs_bits(x[r * C + c])));
      const float s = block_scale(fmax, amax, pow2);
      scale_inv[l.index(r0, c0)] = reciprocal(s);
      for (std::int64_t r = r0; r < r1; ++r)
        for (std::int64_t c = c0; c < c1; ++c) codes[r * C + c] = quantize(x[r * C + c], s, f);
    }
}

void block_part_amax_reference(const BlockPart& p, float* tile_amax) {
  const BlockLayout l{ScalingMode::block_128x128, p.rows, p.cols};
  for (std::int64_t i = 0; i < p.n; ++i) {
    const std::int64_t at = p.first + i, t = l.index(at / p.cols, at % p.cols);
    tile_amax[t] = amax_max(tile_amax[t], bits_float(abs_bits(p.values[i])));
  }
}

void block_scales_reference(const float* tile_amax, std::int64_t rows, std::int64_t cols, Format f, bool pow2,
                            float* scale, float* row_scale_inv, float* col_scale_inv) {
  const BlockLayout l{ScalingMode::block_128x128, rows, cols}, t{ScalingMode::block_128x128, cols, rows};
  const float fmax = max_value(f);
  for (std::int64_t r0 = 0; r0 < rows; r0 += kBlock)
    for (std::int64_t c0 = 0; c0 < cols; c0 += kBlock) {
      const std::int64_t i = l.index(r0, c0);
      const float s = block_scale(fmax, tile_amax[i], pow2);
      scale[i] = s;
      row_scale_inv[i] = reciprocal(s);
      col_scale_inv[t.index(c0, r0)] = reciprocal(s);
    }
}

void quantize_block_part_reference(const BlockPart& p, const float* scale, Format f, std::uint8_t* codes) {
  const BlockLayout l{ScalingMode::block_128x128, p.rows, p.cols};
  for (std::int64_t i = 0; i < p.n; ++i) {
    const std::int64_t at = p.first + i;
    codes[i] = quantize(p.values[i], scale[l.index(at / p.cols, at % p.cols)], f);
  }
}

void block_gemm_reference(const std::uint8_t* x, Format fx, const float* x_scale_inv, ScalingMode x_mode,
                          const std::uint8_t* y, Format fy, const float* y_scale_inv, ScalingMode y_mode, std::int64_t M,
                          std::int64_t N, std::int64_t K, float* d, int threads) {
  const BlockLayout lx{x_mode, M, K}, ly{y_mode, N, K};
  std::vector<float> xd(static_cast<std::size_t>(M * K)), yd(static_cast<std::size_t>(N * K));
  for (std::int64_t i = 0; i < M * K; ++i) xd[static_cast<std::size_t>(i)] = decode(x[i], fx);
  for (std::int64_t i = 0; i < N * K; ++i) yd[static_cast<std::size_t>(i)] = decode(y[i], fy);
#pragma omp parallel for num_threads(threads) schedule(static) if (M * N * K >= (1 << 15))
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (std::int64_t k0 = 0; k0 < K; k0 += kBlock) {
        float part = 0.0f;
        for (std::int64_t k = k0; k < std::min(K, k0 + kBlock); ++k)
          part += xd[static_cast<std::size_t>(m * K + k)] * yd[static_cast<std::size_t>(n * K + k)];
        acc += part * (x_scale_inv[lx.index(m, k0)] * y_scale_inv[ly.index(n, k0)]);
      }
      d[m * N + n] = acc;
    }
}

}  // namespace kiln::fp8
