#pragma once
// The building blocks of the tiled FP8 kernels (cast_transpose.cu, adamw_quantize.cu): 256 threads
// per block over 64 x 64 tiles; in the load phase thread t handles 16 consecutive elements of tile
// row t / 4; the codes go out rowwise as one 16-byte word and through a shared tile colwise.
// Internal to kiln::fp8's CUDA sources (an anonymous namespace: each file gets its own copy).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kiln/fp8/format.hpp"
#include "kiln/tensor/alignment.hpp"

namespace kiln::fp8::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kTile = 64;
constexpr int kThreads = 256;
constexpr int kStride = kTile + 4;  // bytes per row of the shared tile: word-aligned, rows on different banks
constexpr unsigned kMaxBlocks = 8192;

template <Format F>
__device__ __forceinline__ std::uint32_t cvt2(float lo, float hi) {  // lo in the low byte
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, F == Format::e4m3 ? __NV_E4M3 : __NV_E5M2);
}
template <Format F>
__device__ __forceinline__ std::uint8_t cvt1(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, F == Format::e4m3 ? __NV_E4M3 : __NV_E5M2);
}

__device__ __forceinline__ void load16(const bf16* p, float v[16]) {
  const uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
  const unsigned w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);  // bf16 -> f32 is exact
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void load16(const float* p, float v[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 f = reinterpret_cast<const float4*>(p)[i];
    v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
  }
}
__device__ __forceinline__ float load1(const bf16* p, long long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float load1(const float* p, long long i) { return p[i]; }

// Max over the block of every thread's `local`, then one atomicMax into *amax. blockDim = kThreads.
__device__ void block_amax(unsigned local, float* amax) {
  __shared__ unsigned warp_max[kThreads / 32];
  local = __reduce_max_sync(0xffffffffu, local);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned m = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) m = max(m, warp_max[w]);
    if (m) atomicMax(reinterpret_cast<unsigned*>(amax), m);
  }
}

// 16 values -> 16 codes of encode(v * scale), packed four to a word, lowest column first.
template <Format F>
__device__ __forceinline__ void encode16(const float v[16], float scale, std::uint32_t w[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
    w[j] = cvt2<F>(__fmul_rn(v[4 * j], scale), __fmul_rn(v[4 * j + 1], scale)) |
           (cvt2<F>(__fmul_rn(v[4 * j + 2], scale), __fmul_rn(v[4 * j + 3], scale)) << 16);
}

// End of the load phase for the colwise copy: thread t's four code words (tile row t / 4, columns
// 16 (t % 4) ..) into the shared tile.
__device__ __forceinline__ void stage_codes(std::uint8_t* tile, const std::uint32_t w[4]) {
  auto* dst = reinterpret_cast<std::uint32_t*>(tile + (threadIdx.x / 4) * kStride + (threadIdx.x % 4) * 16);
#pragma unroll
  for (int j = 0; j < 4; ++j) dst[j] = w[j];
}

// Tile rows 16 tv .. + 15 of tile column tc as one 16-byte word (the colwise copy's bytes).
__device__ __forceinline__ uint4 transposed_word(const std::uint8_t* tile, int tc, int tv) {
  std::uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const std::uint8_t* p = tile + (tv * 16 + 4 * j) * kStride + tc;
    w[j] = static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[kStride]) << 8) |
           (static_cast<std::uint32_t>(p[2 * kStride]) << 16) | (static_cast<std::uint32_t>(p[3 * kStride]) << 24);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Transpose phase of a tile whose codes sit in `tile`: thread (tc, tv) writes rows
// r0 + 16 tv .. + 15 of column c0 + tc as one 16-byte word of the colwise copy.
__device__ __forceinline__ void store_transposed(const std::uint8_t* tile, std::uint8_t* col, int r0, int c0, int rows,
                                                 int cols) {
  const int tc = threadIdx.x / 4, tv = threadIdx.x % 4;
  const int oc = c0 + tc, orow = r0 + tv * 16;
  if (oc >= cols || orow >= rows) return;  // rows % 16 == 0: all 16 rows exist
  *reinterpret_cast<uint4*>(col + static_cast<size_t>(oc) * rows + orow) = transposed_word(tile, tc, tv);
}


}  // namespace
}  // namespace kiln::fp8::cuda
