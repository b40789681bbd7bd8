// Block quantisation (kiln/fp8/block.hpp) on the device, bit for bit as quantize_blocks_reference:
// one CTA of 256 threads per 128 x 128 tile of x, staged once in shared memory (as f32), then
//  - 1x128: each row of the tile is a block of the rowwise codes and each column one of the
//    transpose's (colwise) codes: row and column amaxes over the staged tile;
//  - 128x128: the tile is one block of both: one amax;
// two threads per row (and per column), 64 values each: their amax, one shuffle, the codes as four
// 16-byte stores (a row of the codes, or of the transpose's).
#include <cuda_bf16.h>

#include "kiln/fp8/block.hpp"
#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "tiles.cuh"

namespace kiln::fp8::cuda {

namespace {

// The staged tile's rows: 132 floats (16-byte aligned rows for vector access; a column's 32
// consecutive rows fall on 8 banks 4 apart, two threads' halves 64 rows apart on the same: 2-way).
constexpr int kCtaThreads = 256, kWarps = kCtaThreads / 32, kRow = kBlock + 4;
constexpr std::size_t kSmemBytes = sizeof(float) * kBlock * kRow;

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (sizeof(T) == 2) return __bfloat162float(v);
  else return v;
}

// |x| as bits, max-reduced over a warp (non-negative floats order as their bits; NaN above all).
__device__ __forceinline__ std::uint32_t warp_max(std::uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

struct Args {
  std::int64_t R, C;
  ScalingMode mode;
  Format f;
  bool pow2;
  std::uint8_t* rowwise;
  float* row_scale_inv;
  std::uint8_t* colwise;
  float* col_scale_inv;
};

// Stages the tile (rows r0.., cols c0..) as f32, zeros outside x: 16-byte loads where `vec`.
template <typename T>
__device__ void stage(float* tile, const T* __restrict__ x, const Args& a, std::int64_t r0, std::int64_t c0, bool vec) {
  constexpr int kVec = 16 / sizeof(T);  // elements of a 16-byte load
  if (vec) {
    for (int i = threadIdx.x; i < kBlock * kBlock / kVec; i += kCtaThreads) {
      const int rr = i / (kBlock / kVec), cc = i % (kBlock / kVec) * kVec;
      const std::int64_t r = r0 + rr, c = c0 + cc;
      float* dst = tile + rr * kRow + cc;
      if (r < a.R && c + kVec <= a.C) {
        const uint4 raw = *reinterpret_cast<const uint4*>(x + r * a.C + c);
        const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < kVec; k += 4)
          *reinterpret_cast<float4*>(dst + k) = make_float4(to_float(v[k]), to_float(v[k + 1]), to_float(v[k + 2]),
                                                            to_float(v[k + 3]));
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) dst[k] = r < a.R && c + k < a.C ? to_float(x[r * a.C + c + k]) : 0.0f;
      }
    }
  } else {
    for (int i = threadIdx.x; i < kBlock * kBlock; i += kCtaThreads) {
      const int rr = i / kBlock, cc = i % kBlock;
      const std::int64_t r = r0 + rr, c = c0 + cc;
      tile[rr * kRow + cc] = r < a.R && c < a.C ? to_float(x[r * a.C + c]) : 0.0f;
    }
  }
}

// n codes of src[i * step] * s (i < n <= 64) into dst, converted by the hardware
// (cvt.rn.satfinite, which encode() matches bit for bit): four 16-byte stores where `vec`.
template <Format F>
__device__ __forceinline__ void store_codes(std::uint8_t* dst, const float* src, int step, float s, int n, bool vec) {
  if (vec && n == 64) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      unsigned w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i = 16 * q + 4 * j;
        const float4 v = step == 1 ? *reinterpret_cast<const float4*>(src + i)
                                   : make_float4(src[i * step], src[(i + 1) * step], src[(i + 2) * step],
                                                 src[(i + 3) * step]);
        w[j] = cvt2<F>(__fmul_rn(v.x, s), __fmul_rn(v.y, s)) | cvt2<F>(__fmul_rn(v.z, s), __fmul_rn(v.w, s)) << 16;
      }
      reinterpret_cast<uint4*>(dst)[q] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  } else {
    for (int i = 0; i < n; ++i) dst[i] = cvt1<F>(__fmul_rn(src[i * step], s));
  }
}

// max |v| of 64 staged values src[i * step] (zeros outside x change nothing), as bits; a row's
// (step 1, 16-byte aligned) four at a time.
__device__ __forceinline__ std::uint32_t amax64(const float* src, int step) {
  std::uint32_t m = 0;
  if (step == 1) {
#pragma unroll
    for (int i = 0; i < 64; i += 4) {
      const float4 v = *reinterpret_cast<const float4*>(src + i);
      m = max(m, max(max(abs_bits(v.x), abs_bits(v.y)), max(abs_bits(v.z), abs_bits(v.w))));
    }
    return m;
  }
#pragma unroll 16
  for (int i = 0; i < 64; ++i) m = max(m, abs_bits(src[i * step]));
  return m;
}

// Each thread t takes half t % 2 (64 elements) of tile line t / 2: a row for the rowwise codes, a
// column for the transpose's. Both threads of a line are neighbours in a warp.
template <typename T, Format F>
__global__ void __launch_bounds__(kCtaThreads) quantize_blocks_kernel(const T* __restrict__ x, Args a, bool vec_in,
                                                                   bool vec_row, bool vec_col) {
  extern __shared__ float tile[];
  __shared__ std::uint32_t warp_amax[kWarps];
  __shared__ float tile_scale;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kBlock, c0 = static_cast<std::int64_t>(blockIdx.x) * kBlock;
  stage(tile, x, a, r0, c0, vec_in);
  __syncthreads();
  const int line = threadIdx.x / 2, half = threadIdx.x % 2, first = 64 * half;
  const float fmax = max_value(a.f);
  const float* row_src = tile + line * kRow + first;      // row `line`, columns first..
  const float* col_src = tile + first * kRow + line;      // column `line`, rows first..
  const std::int64_t r = r0 + line, c = c0 + line;
  const std::int64_t row_left = a.C - (c0 + first), col_left = a.R - (r0 + first);  // values of x in the half
  const int row_n = row_left <= 0 ? 0 : row_left >= 64 ? 64 : static_cast<int>(row_left);
  const int col_n = col_left <= 0 ? 0 : col_left >= 64 ? 64 : static_cast<int>(col_left);
  if (a.mode == ScalingMode::block_1x128) {
    if (a.rowwise) {
      std::uint32_t m = amax64(row_src, 1);
      m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
      const float s = block_scale(fmax, bits_float(m), a.pow2);
      if (r < a.R) {
        if (half == 0) a.row_scale_inv[BlockLayout{a.mode, a.R, a.C}.index(r, c0)] = reciprocal(s);
        store_codes<F>(a.rowwise + r * a.C + c0 + first, row_src, 1, s, row_n, vec_row);
      }
    }
    if (a.colwise) {
      std::uint32_t m = amax64(col_src, kRow);
      m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
      const float s = block_scale(fmax, bits_float(m), a.pow2);
      if (c < a.C) {
        if (half == 0) a.col_scale_inv[BlockLayout{a.mode, a.C, a.R}.index(c, r0)] = reciprocal(s);
        store_codes<F>(a.colwise + c * a.R + r0 + first, col_src, kRow, s, col_n, vec_col);
      }
    }
    return;
  }
  // 128x128: one amax over the tile.
  std::uint32_t m = warp_max(amax64(row_src, 1));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    std::uint32_t t = 0;
    for (int w = 0; w < kWarps; ++w) t = max(t, warp_amax[w]);
    const float s = block_scale(fmax, bits_float(t), a.pow2);
    tile_scale = s;
    if (a.rowwise) a.row_scale_inv[BlockLayout{a.mode, a.R, a.C}.index(r0, c0)] = reciprocal(s);
    if (a.colwise) a.col_scale_inv[BlockLayout{a.mode, a.C, a.R}.index(c0, r0)] = reciprocal(s);
  }
  __syncthreads();
  const float s = tile_scale;
  if (a.rowwise && r < a.R) store_codes<F>(a.rowwise + r * a.C + c0 + first, row_src, 1, s, row_n, vec_row);
  if (a.colwise && c < a.C) store_codes<F>(a.colwise + c * a.R + r0 + first, col_src, kRow, s, col_n, vec_col);
}

template <typename T, Format F>
void launch(const BlockCast& k, const Args& a, cudaStream_t s) {
  const std::int64_t tiles_c = blocks_of(a.C), tiles_r = blocks_of(a.R);
  KILN_CHECK(tiles_c <= 0x7fffffff && tiles_r <= 65535, "fp8 quantize_blocks: [", a.R, ", ", a.C,
             "] is too large for one launch");
  // More than the default 48 KB of dynamic shared memory (set at each launch: a host-side call).
  KILN_CUDA_CHECK(cudaFuncSetAttribute(quantize_blocks_kernel<T, F>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kSmemBytes)));
  const bool vec_in = a.C % (16 / sizeof(T)) == 0 && reinterpret_cast<std::uintptr_t>(k.x) % 16 == 0;
  const bool vec_row = a.C % 16 == 0 && reinterpret_cast<std::uintptr_t>(a.rowwise) % 16 == 0;
  const bool vec_col = a.R % 16 == 0 && reinterpret_cast<std::uintptr_t>(a.colwise) % 16 == 0;
  quantize_blocks_kernel<T, F><<<dim3(static_cast<unsigned>(tiles_c), static_cast<unsigned>(tiles_r)), kCtaThreads,
                                  kSmemBytes, s>>>(static_cast<const T*>(k.x), a, vec_in, vec_row, vec_col);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace

void quantize_blocks(const BlockCast& k, cudaStream_t s) {
  KILN_CHECK(k.mode == ScalingMode::block_1x128 || k.mode == ScalingMode::block_128x128,
             "fp8 quantize_blocks: a block scaling mode is needed");
  KILN_CHECK(!k.rowwise == !k.row_scale_inv && !k.colwise == !k.col_scale_inv,
             "fp8 quantize_blocks: codes without scales, or scales without codes");
  if (k.rows <= 0 || k.cols <= 0 || (!k.rowwise && !k.colwise)) return;
  const Args a{k.rows, k.cols, k.mode, k.format, k.pow2, k.rowwise, k.row_scale_inv, k.colwise, k.col_scale_inv};
  const bool e4 = k.format == Format::e4m3;
  if (k.x_dtype == DType::bf16)
    e4 ? launch<__nv_bfloat16, Format::e4m3>(k, a, s) : launch<__nv_bfloat16, Format::e5m2>(k, a, s);
  else
    e4 ? launch<float, Format::e4m3>(k, a, s) : launch<float, Format::e5m2>(k, a, s);
}

}  // namespace kiln::fp8::cuda
