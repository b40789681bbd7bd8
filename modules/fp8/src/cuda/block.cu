// Block quantisation (kiln/fp8/block.hpp) on the device: one warp per 1x128 block, one CTA per
// 128x128 tile; the amax, scale and codes as quantize_blocks_reference computes them, bit for bit.
#include <cuda_bf16.h>

#include "kiln/fp8/block.hpp"
#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::fp8::cuda {

namespace {

template <typename T>
__device__ __forceinline__ float load_value(const T* x, std::int64_t i) {
  if constexpr (sizeof(T) == 2) return __bfloat162float(x[i]);
  else return x[i];
}

// |x| as bits, max-reduced over a warp (non-negative floats order as their bits; NaN above all).
__device__ __forceinline__ std::uint32_t warp_max(std::uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block (32, 4): each warp one 1x128 block of a row; lane l covers columns c0 + l + 32 j, j < 4.
template <typename T>
__global__ void quantize_1x128_kernel(const T* __restrict__ x, std::uint8_t* __restrict__ codes,
                                      float* __restrict__ scale_inv, BlockLayout layout, Format f, bool pow2) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kBlock;
  if (r >= layout.rows) return;
  const std::int64_t C = layout.cols;
  float v[4];
  std::uint32_t amax = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const std::int64_t c = c0 + threadIdx.x + 32 * j;
    v[j] = c < C ? load_value(x, r * C + c) : 0.0f;
    amax = max(amax, abs_bits(v[j]));
  }
  amax = warp_max(amax);
  const float s = block_scale(max_value(f), bits_float(amax), pow2);
  if (threadIdx.x == 0) scale_inv[layout.index(r, c0)] = reciprocal(s);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const std::int64_t c = c0 + threadIdx.x + 32 * j;
    if (c < C) codes[r * C + c] = quantize(v[j], s, f);
  }
}

// One CTA of 256 threads per 128x128 tile: the amax over the tile, then its codes.
// With `transposed`, the codes of x's transpose ([cols, rows]) and the scale at its layout (the same
// tile, transposed): the weight's colwise copy, made once per weight version.
template <typename T>
__global__ void quantize_128x128_kernel(const T* __restrict__ x, std::uint8_t* __restrict__ codes,
                                        float* __restrict__ scale_inv, BlockLayout layout, Format f, bool pow2,
                                        bool transposed) {
  __shared__ std::uint32_t warp_amax[8];
  __shared__ float tile_scale;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kBlock, c0 = static_cast<std::int64_t>(blockIdx.x) * kBlock;
  const std::int64_t R = layout.rows, C = layout.cols;
  std::uint32_t amax = 0;
  for (int i = threadIdx.x; i < kBlock * kBlock; i += blockDim.x) {
    const std::int64_t r = r0 + i / kBlock, c = c0 + i % kBlock;
    if (r < R && c < C) amax = max(amax, abs_bits(load_value(x, r * C + c)));
  }
  amax = warp_max(amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    std::uint32_t a = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) a = max(a, warp_amax[w]);
    const float s = block_scale(max_value(f), bits_float(a), pow2);
    tile_scale = s;
    const BlockLayout t{layout.mode, C, R};
    scale_inv[transposed ? t.index(c0, r0) : layout.index(r0, c0)] = reciprocal(s);
  }
  __syncthreads();
  const float s = tile_scale;
  for (int i = threadIdx.x; i < kBlock * kBlock; i += blockDim.x) {
    // transposed: consecutive threads write consecutive codes of one output row (a column of x)
    const std::int64_t r = transposed ? r0 + i % kBlock : r0 + i / kBlock, c = transposed ? c0 + i / kBlock : c0 + i % kBlock;
    if (r < R && c < C) codes[transposed ? c * R + r : r * C + c] = quantize(load_value(x, r * C + c), s, f);
  }
}

// The transpose's 1x128 blocks (x's 128x1 columns of blocks): block (32, 8) stages a 128 x 32 tile
// of x in shared memory; warp w then takes columns w, w + 8, ...: lane l their rows l + 32 j, the
// amax over the warp, and writes the column's 128 codes as one contiguous run of the output row.
template <typename T>
__global__ void quantize_1x128_transposed_kernel(const T* __restrict__ x, std::uint8_t* __restrict__ codes,
                                                 float* __restrict__ scale_inv, BlockLayout layout, Format f,
                                                 bool pow2) {
  __shared__ float tile[kBlock][33];
  const std::int64_t R = layout.cols, C = layout.rows;  // x is [R, C]; the layout is its transpose's
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kBlock, c0 = static_cast<std::int64_t>(blockIdx.x) * 32;
  for (int rr = threadIdx.y; rr < kBlock; rr += 8) {
    const std::int64_t r = r0 + rr, c = c0 + threadIdx.x;
    tile[rr][threadIdx.x] = r < R && c < C ? load_value(x, r * C + c) : 0.0f;
  }
  __syncthreads();
  for (int cc = threadIdx.y; cc < 32; cc += 8) {
    const std::int64_t c = c0 + cc;
    if (c >= C) break;
    float v[4];
    std::uint32_t amax = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[j] = tile[threadIdx.x + 32 * j][cc];
      amax = max(amax, abs_bits(v[j]));
    }
    amax = warp_max(amax);
    const float s = block_scale(max_value(f), bits_float(amax), pow2);
    if (threadIdx.x == 0) scale_inv[layout.index(c, r0)] = reciprocal(s);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::int64_t r = r0 + threadIdx.x + 32 * j;
      if (r < R) codes[c * R + r] = quantize(v[j], s, f);
    }
  }
}

// x [l.rows, l.cols], or with `transposed` x [l.cols, l.rows] into its transpose's codes and the
// scales in l (the transpose's layout).
template <typename T>
void launch(const T* x, std::uint8_t* codes, float* scale_inv, const BlockLayout& l, Format f, bool pow2,
            bool transposed, cudaStream_t s) {
  if (transposed && l.mode == ScalingMode::block_1x128) {
    const std::int64_t R = l.cols, C = l.rows;
    KILN_CHECK(blocks_of(R) <= 65535 && (C + 31) / 32 <= 0x7fffffff, "fp8 quantize_blocks_transposed: [", R, ", ", C,
               "] is too large for one launch");
    quantize_1x128_transposed_kernel<T>
        <<<dim3(static_cast<unsigned>((C + 31) / 32), static_cast<unsigned>(blocks_of(R))), dim3(32, 8), 0, s>>>(
            x, codes, scale_inv, l, f, pow2);
    KILN_CUDA_LAUNCH_CHECK();
    return;
  }
  if (transposed) {  // 128x128: the tiles of x, written transposed
    const BlockLayout xl{l.mode, l.cols, l.rows};
    KILN_CHECK(blocks_of(xl.cols) <= 0x7fffffff && blocks_of(xl.rows) <= 65535, "fp8 quantize_blocks_transposed: [",
               xl.rows, ", ", xl.cols, "] is too large");
    quantize_128x128_kernel<T>
        <<<dim3(static_cast<unsigned>(blocks_of(xl.cols)), static_cast<unsigned>(blocks_of(xl.rows))), 256, 0, s>>>(
            x, codes, scale_inv, xl, f, pow2, true);
    KILN_CUDA_LAUNCH_CHECK();
    return;
  }
  const std::int64_t kb = blocks_of(l.cols);
  if (l.mode == ScalingMode::block_1x128) {
    const std::int64_t row_groups = (l.rows + 3) / 4;
    KILN_CHECK(kb <= 0x7fffffff && row_groups <= 65535, "fp8 quantize_blocks: [", l.rows, ", ", l.cols,
               "] is too large for one launch");
    quantize_1x128_kernel<T><<<dim3(static_cast<unsigned>(kb), static_cast<unsigned>(row_groups)), dim3(32, 4), 0, s>>>(
        x, codes, scale_inv, l, f, pow2);
  } else {
    const std::int64_t rb = blocks_of(l.rows);
    KILN_CHECK(kb <= 0x7fffffff && rb <= 65535, "fp8 quantize_blocks: [", l.rows, ", ", l.cols, "] is too large");
    quantize_128x128_kernel<T><<<dim3(static_cast<unsigned>(kb), static_cast<unsigned>(rb)), 256, 0, s>>>(
        x, codes, scale_inv, l, f, pow2, false);
  }
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace

void quantize_blocks(const void* x, DType x_dtype, std::uint8_t* codes, float* scale_inv, const BlockLayout& layout,
                     Format f, bool pow2, bool transposed, cudaStream_t s) {
  KILN_CHECK(layout.mode == ScalingMode::block_1x128 || layout.mode == ScalingMode::block_128x128,
             "fp8 quantize_blocks: a block scaling mode is needed");
  if (layout.rows <= 0 || layout.cols <= 0) return;
  if (x_dtype == DType::bf16)
    launch(static_cast<const __nv_bfloat16*>(x), codes, scale_inv, layout, f, pow2, transposed, s);
  else
    launch(static_cast<const float*>(x), codes, scale_inv, layout, f, pow2, transposed, s);
}

}  // namespace kiln::fp8::cuda
