#pragma once
// FP8 block scaling (the 1x128 / 128x128 recipe DeepSeek-V3 trained with; TransformerEngine's
// Float8BlockScaling): one f32 scale per 1x128 tile of a tensor along its reduction dimension, or
// per 128x128 tile, so that one outlier costs the precision of its block only. Hopper's cuBLASLt
// (12.9 and later) multiplies such operands natively: CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F for
// 1x128 and BLK128x128_32F for 128x128.
//
// A [rows, cols] operand is quantised along cols (K, the GEMM's reduction dimension, contiguous as
// Hopper's FP8 GEMMs take it). Its scales are f32 matrices laid out as cuBLASLt reads them (found
// by test_cuda_fp8_block's probe on an H100 with CUDA 13.0's cuBLASLt, the documentation giving
// them in prose only): the leading dimension rounded up to 4 floats (16 bytes), and
//   1x128:   the K blocks outermost, the rows contiguous:
//            scale_inv[kb * ld + r],  ld = round_up(rows, 4),               kb < ceil(cols / 128)
//   128x128: the row blocks outermost, the K blocks contiguous:
//            scale_inv[rb * ld + kb], ld = round_up(ceil(cols / 128), 4),  rb < ceil(rows / 128)
// Partial tiles (rows or cols not multiples of 128) have their own scales over what they hold.
//
// Each block's scale is fp8_max / amax of the block (compute_scale with margin 0; a block of zeros,
// or one with a non-finite amax, keeps scale 1), optionally rounded down to a power of two (TE's
// force_pow_2_scales: the scaled values are then exact multiples of the inputs' exponents). The
// codes are encode(x * scale), as the per-tensor recipes round them; scale_inv = 1 / scale.
#include <cmath>
#include <cstdint>

#include "kiln/fp8/format.hpp"
#include "kiln/fp8/tensor.hpp"

namespace kiln::fp8 {

inline constexpr int kBlock = 128;

constexpr KILN_HD std::int64_t blocks_of(std::int64_t n) { return (n + kBlock - 1) / kBlock; }

// Where a [rows, cols] operand's block scales are (see above).
struct BlockLayout {
  ScalingMode mode = ScalingMode::block_1x128;
  std::int64_t rows = 0, cols = 0;

  constexpr KILN_HD bool rowwise() const { return mode == ScalingMode::block_1x128; }
  // Scales along the rows: one per row (1x128) or per 128 rows (128x128).
  constexpr KILN_HD std::int64_t row_entries() const { return rowwise() ? rows : blocks_of(rows); }
  constexpr KILN_HD std::int64_t ld() const { return ((rowwise() ? rows : blocks_of(cols)) + 3) / 4 * 4; }
  // Floats the scales take (with the padding of the leading dimension).
  constexpr KILN_HD std::int64_t count() const { return ld() * (rowwise() ? blocks_of(cols) : blocks_of(rows)); }
  // The scale of element (r, c).
  constexpr KILN_HD std::int64_t index(std::int64_t r, std::int64_t c) const {
    return rowwise() ? (c / kBlock) * ld() + r : (r / kBlock) * ld() + c / kBlock;
  }
};

// A block's scale from its amax (see above).
KILN_HD float block_scale(float fp8_max, float amax, bool pow2) {
  float s = compute_scale(fp8_max, amax, 0, 1.0f);
  if (pow2) {
    // Round down to a power of two: keep the exponent, drop the mantissa (s is finite and > 0).
    s = bits_float(float_bits(s) & 0x7f800000u);
    if (s == 0.0f) s = detail::pow2(-126);  // a subnormal scale: the smallest normal power of two
  }
  return s;
}

// The CPU reference of block quantisation, shared by the CPU emulation and the tests: x [rows,
// cols] f32 (already rounded to the activation dtype where it comes from one) into codes [rows,
// cols] and scale_inv (layout.count() floats; the padding is left as it is).
void quantize_blocks_reference(const float* x, const BlockLayout& layout, Format f, bool pow2, std::uint8_t* codes,
                               float* scale_inv);

// A part of a 128x128-scaled weight [rows, cols]: its flat elements first..first + n (an FSDP shard of
// the f32 master), whose codes are gathered. The ranks agree on each tile's amax (the maximum of
// their parts'), so every part is quantised exactly as quantize_blocks_reference quantises the
// whole weight. The CPU references (shared by the CPU emulation and the tests):
//   tile_amax[BlockLayout{128x128, rows, cols}.index(r, c)] max= |w[r, c]| over the part;
//   per tile: scale = block_scale(fp8_max, amax, pow2), row_scale_inv (the weight's layout) and
//     col_scale_inv (its transpose's, BlockLayout{128x128, cols, rows}) = 1 / scale;
//   codes[i - first] = quantize(w[i], scale of i's tile) over the part.
struct BlockPart {
  const float* values = nullptr;  // the part's n values
  std::int64_t n = 0, first = 0, rows = 0, cols = 0;
};
void block_part_amax_reference(const BlockPart& p, float* tile_amax);
void block_scales_reference(const float* tile_amax, std::int64_t rows, std::int64_t cols, Format f, bool pow2,
                            float* scale, float* row_scale_inv, float* col_scale_inv);
void quantize_block_part_reference(const BlockPart& p, const float* scale, Format f, std::uint8_t* codes);

// The CPU reference of a block-scaled product: d[M, N] (f32) = sum over the K blocks kb of
// (sum over k in kb of decode(x[m, k]) * decode(y[n, k])) * x_scale_inv(m, kb) * y_scale_inv(n, kb),
// each block's partial sum in f32 and promoted into an f32 accumulator as Hopper's block-scaled
// kernels do (the value equals the product of the dequantised operands up to f32 rounding).
void block_gemm_reference(const std::uint8_t* x, Format fx, const float* x_scale_inv, ScalingMode x_mode,
                          const std::uint8_t* y, Format fy, const float* y_scale_inv, ScalingMode y_mode, std::int64_t M,
                          std::int64_t N, std::int64_t K, float* d, int threads = 1);

}  // namespace kiln::fp8
