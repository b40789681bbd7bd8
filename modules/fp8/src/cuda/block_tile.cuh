#pragma once
// The 128 x 128 tile of block.cu's quantisation kernels: its layout in shared memory (swizzled for a
// bf16 tile's 1x128 codes), its staging from a source (block_sources.cuh) or its copy by cp.async,
// and the codes, scales and bias-gradient partial sums made from it (process_tile). Internal to
// kiln::fp8's CUDA sources, like tiles.cuh.
#include <cuda_bf16.h>

#include <cstdint>

#include "kiln/fp8/block.hpp"
#include "tiles.cuh"

namespace kiln::fp8::cuda {
namespace {

constexpr int kCtaThreads = 256, kWarps = kCtaThreads / 32;
// The staged tile holds the values as the source gives them: bf16 where every value is a bf16 (a
// bf16 tensor, or a prologue's values, which are rounded to bf16 as the unfused op stores them), f32
// otherwise (an f32 tensor, the optimizer's updated master). Its rows: 132 floats or 136 bf16 (16-byte
// aligned rows for vector access; a column's 32 consecutive rows fall on banks 4 or 2 apart, two
// threads' halves 64 rows apart on the same: 2-way). bf16 halves the shared memory (34 KB a CTA
// instead of 66 KB): twice the CTAs on an SM.
template <typename T>
constexpr int kRowOf = sizeof(T) == 4 ? kBlock + 4 : kBlock + 8;
template <typename T>
constexpr std::size_t kSmemOf = sizeof(T) * kBlock * kRowOf<T>;

__device__ __forceinline__ float tile_get(const float* p) { return *p; }
__device__ __forceinline__ float tile_get(const bf16* p) { return __bfloat162float(*p); }
// Four consecutive values (16-byte aligned for f32, 8-byte for bf16).
__device__ __forceinline__ float4 tile_get4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 tile_get4(const bf16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xffff0000u));
}
// Stores values the tile's type holds exactly (a bf16 value's f32 bits end in 16 zeros).
__device__ __forceinline__ void tile_put(float* p, float v) { *p = v; }
__device__ __forceinline__ void tile_put(bf16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void tile_put4(float* p, float a, float b, float c, float d) {
  *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}
__device__ __forceinline__ unsigned bf16_pair(float a, float b) {
  return __float_as_uint(a) >> 16 | (__float_as_uint(b) & 0xffff0000u);
}
// Eight values as one 16-byte store (p 16-byte aligned): a bf16 tile's staging.
__device__ __forceinline__ void tile_put8(bf16* p, const float* v) {
  *reinterpret_cast<uint4*>(p) =
      make_uint4(bf16_pair(v[0], v[1]), bf16_pair(v[2], v[3]), bf16_pair(v[4], v[5]), bf16_pair(v[6], v[7]));
}

// |x| as bits, max-reduced over a warp (non-negative floats order as their bits; NaN above all).
__device__ __forceinline__ std::uint32_t warp_max(std::uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The rows a launch quantises (or one group of a grouped launch) and their copies.
struct Rows {
  std::int64_t base = 0;  // the source's row of x's first
  std::int64_t R = 0;     // x's rows
  std::int64_t Rr = 0, Rc = 0;  // the rowwise codes' rows and the colwise codes' columns (>= R: zero rows appended)
  std::uint8_t* rowwise = nullptr;
  float* row_scale_inv = nullptr;
  std::uint8_t* colwise = nullptr;
  float* col_scale_inv = nullptr;
  bool vec_row = false, vec_col = false;  // 16-byte stores of the rowwise and colwise codes
};
struct Args : Rows {
  std::int64_t C = 0;  // x's columns
  ScalingMode mode = ScalingMode::block_1x128;
  Format f = Format::e4m3;
  bool pow2 = false;
  float* partial = nullptr;  // [row tiles, C] column sums, or null
};

// Where the staged value (rr, cc) lies in the tile. A swizzled tile (a bf16 tile for 1x128 codes)
// moves each row's 8-byte chunks of four values by 32 bytes times (rr / 16) % 4, so that the
// column reads of colwise_1x128, eight groups of 16 rows at once, fall on every bank twice (the least
// for their 256 bytes) instead of eight times on the same eight.
template <typename T>
__device__ __forceinline__ int tile_at(int rr, int cc, bool swz) {
  return rr * kRowOf<T> + (swz ? ((((cc >> 2) ^ (((rr >> 4) & 3) << 2)) << 2) | (cc & 3)) : cc);
}

// Stages the tile (rows r0.., cols c0..), zeros outside x: S::kVec values a load where `vec`.
template <bool Swz, class S, typename T = typename S::Tile>
__device__ void stage(T* tile, const S& src, const Args& a, std::int64_t r0, std::int64_t c0, bool vec) {
  constexpr int V = S::kVec, kUnroll = Swz ? 8 : 4;
  constexpr bool swz = Swz;
  if (vec) {
#pragma unroll kUnroll
    for (int i = threadIdx.x; i < kBlock * kBlock / V; i += kCtaThreads) {
      const int rr = i / (kBlock / V), cc = i % (kBlock / V) * V;
      const std::int64_t r = r0 + rr, c = c0 + cc;
      float v[V];
      if (r < a.R && c < a.C) {
        src.load(v, a.base + r, c);
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) v[k] = 0.0f;
      }
      if constexpr (sizeof(T) == 2 && V % 8 == 0) {  // 16 bytes a store: two chunks, adjacent in either layout
#pragma unroll
        for (int k = 0; k < V; k += 8) tile_put8(tile + tile_at<T>(rr, cc + k, swz), v + k);
      } else {
#pragma unroll
        for (int k = 0; k < V; k += 4) tile_put4(tile + tile_at<T>(rr, cc + k, swz), v[k], v[k + 1], v[k + 2], v[k + 3]);
      }
    }
  } else {
    for (int i = threadIdx.x; i < kBlock * kBlock; i += kCtaThreads) {
      const int rr = i / kBlock, cc = i % kBlock;
      const std::int64_t r = r0 + rr, c = c0 + cc;
      tile_put(tile + tile_at<T>(rr, cc, swz), r < a.R && c < a.C ? src.at(a.base + r, c) : 0.0f);
    }
  }
}

// n codes of src[i * step] * s (i < n <= 64) into dst, converted by the hardware
// (cvt.rn.satfinite, which encode() matches bit for bit): four 16-byte stores where `vec`.
template <Format F, typename T>
__device__ __forceinline__ void store_codes(std::uint8_t* dst, const T* src, int step, float s, int n, bool vec) {
  if (vec && n == 64) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      unsigned w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i = 16 * q + 4 * j;
        const float4 v = step == 1 ? tile_get4(src + i)
                                   : make_float4(tile_get(src + i * step), tile_get(src + (i + 1) * step),
                                                 tile_get(src + (i + 2) * step), tile_get(src + (i + 3) * step));
        w[j] = cvt2<F>(__fmul_rn(v.x, s), __fmul_rn(v.y, s)) | cvt2<F>(__fmul_rn(v.z, s), __fmul_rn(v.w, s)) << 16;
      }
      reinterpret_cast<uint4*>(dst)[q] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  } else {
    for (int i = 0; i < n; ++i) dst[i] = cvt1<F>(__fmul_rn(tile_get(src + i * step), s));
  }
}

// max |v| of 64 staged values src[i * step] (zeros outside x change nothing), as bits; a row's
// (step 1, 16-byte aligned) four at a time.
template <typename T>
__device__ __forceinline__ std::uint32_t amax64(const T* src, int step) {
  std::uint32_t m = 0;
  if (step == 1) {
#pragma unroll
    for (int i = 0; i < 64; i += 4) {
      const float4 v = tile_get4(src + i);
      m = max(m, max(max(abs_bits(v.x), abs_bits(v.y)), max(abs_bits(v.z), abs_bits(v.w))));
    }
    return m;
  }
#pragma unroll 16
  for (int i = 0; i < 64; ++i) m = max(m, abs_bits(tile_get(src + i * step)));
  return m;
}

// Four bf16 values (an 8-byte chunk of the tile) as f32: element k of the chunk.
__device__ __forceinline__ float chunk_value(uint2 c, int k) {
  const unsigned w = k < 2 ? c.x : c.y;
  return __uint_as_float(k % 2 == 0 ? w << 16 : w & 0xffff0000u);
}
__device__ __forceinline__ std::uint32_t chunk_amax(uint2 c) {  // max |v| of its four values, as bits
  return max(max(abs_bits(chunk_value(c, 0)), abs_bits(chunk_value(c, 1))),
             max(abs_bits(chunk_value(c, 2)), abs_bits(chunk_value(c, 3))));
}

// The rowwise 1x128 codes of a swizzled bf16 tile: thread t takes half h = t % 2 of row t / 2, the
// 16-column pieces 2 q + h (q < 4), read once into registers (16 chunks); the row's amax with the other
// half's, then the codes, each piece one 16-byte word, the two threads' words of a q 32 contiguous bytes.
template <Format F>
__device__ __forceinline__ void rowwise_1x128(const bf16* tile, const Args& a, std::int64_t r0, std::int64_t c0,
                                              float fmax) {
  const int line = threadIdx.x / 2, h = threadIdx.x % 2;
  const auto col = [h](int q) { return 32 * q + 16 * h; };  // the first column of piece 2 q + h
  uint2 v[16];                                               // v[4 q + k]: columns col(q) + 4 k..
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int k = 0; k < 4; ++k)
      v[4 * q + k] = *reinterpret_cast<const uint2*>(tile + tile_at<bf16>(line, col(q) + 4 * k, true));
  std::uint32_t m = 0;
#pragma unroll
  for (int q = 0; q < 16; ++q) m = max(m, chunk_amax(v[q]));
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
  const std::int64_t r = r0 + line;
  if (r >= a.Rr) return;
  const float s = block_scale(fmax, bits_float(m), a.pow2);
  if (h == 0) a.row_scale_inv[BlockLayout{a.mode, a.Rr, a.C}.index(r, c0)] = reciprocal(s);
  std::uint8_t* dst = a.rowwise + r * a.C + c0;
  const bool whole = a.vec_row && c0 + kBlock <= a.C;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (whole) {
      float x[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = chunk_value(v[4 * q + i / 4], i % 4);
      std::uint32_t w[4];
      encode16<F>(x, s, w);
      *reinterpret_cast<uint4*>(dst + col(q)) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i)
        if (c0 + col(q) + i < a.C) dst[col(q) + i] = cvt1<F>(__fmul_rn(chunk_value(v[4 * q + i / 4], i % 4), s));
    }
  }
}

// The colwise (transpose's) 1x128 codes of a swizzled bf16 tile: lane l of warp w takes the four columns
// 4 (4 w + l % 4).. over the 16 rows 16 (l / 4).. (one 8-byte chunk a row, read once); a column's
// amax is the max over the eight lanes of its rows (three shuffles); each lane then stores its 16
// codes of each column as one 16-byte word, the eight lanes of a column 128 contiguous bytes.
template <Format F>
__device__ __forceinline__ void colwise_1x128(const bf16* tile, const Args& a, std::int64_t r0, std::int64_t c0,
                                              float fmax) {
  const int lane = static_cast<int>(threadIdx.x % 32), cq = 4 * static_cast<int>(threadIdx.x / 32) + lane % 4,
            rg = lane / 4;
  uint2 v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = *reinterpret_cast<const uint2*>(tile + tile_at<bf16>(16 * rg + i, 4 * cq, true));
  const std::int64_t left = a.Rc - (r0 + 16 * rg);
  const int n = left <= 0 ? 0 : left >= 16 ? 16 : static_cast<int>(left);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    std::uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) m = max(m, abs_bits(chunk_value(v[i], j)));
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    const std::int64_t c = c0 + 4 * cq + j;
    if (c >= a.C) continue;
    const float s = block_scale(fmax, bits_float(m), a.pow2);
    if (rg == 0) a.col_scale_inv[BlockLayout{a.mode, a.C, a.Rc}.index(c, r0)] = reciprocal(s);
    std::uint8_t* dst = a.colwise + c * a.Rc + r0 + 16 * rg;
    if (a.vec_col && n == 16) {
      float x[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = chunk_value(v[i], j);
      std::uint32_t w[4];
      encode16<F>(x, s, w);
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i)
        if (i < n) dst[i] = cvt1<F>(__fmul_rn(chunk_value(v[i], j), s));
    }
  }
}

// The tile of x at rows r0.., columns c0..: each thread t takes half t % 2 (64 elements) of tile line
// t / 2, a row for the rowwise codes, a column for the transpose's. Both threads of a line are
// neighbours in a warp.
// Swz: a bf16 tile for 1x128 codes (swizzled, read into registers); its own instances, so that the
// others keep their fewer registers (more CTAs an SM).
template <class T, Format F, bool Swz>
__device__ __forceinline__ void process_tile(const T* tile, const Args& a, std::int64_t r0, std::int64_t c0) {
  constexpr int kRow = kRowOf<T>;
  __shared__ std::uint32_t warp_amax[kWarps];
  __shared__ float tile_scale;
  const bool vec_row = a.vec_row, vec_col = a.vec_col;
  static_assert(!Swz || sizeof(T) == 2, "a swizzled tile is a bf16 one");
  constexpr bool swz = Swz;
  const int line = threadIdx.x / 2, half = threadIdx.x % 2, first = 64 * half;
  if (a.partial) {  // column `line`'s sum over the tile's rows: each half's 64 in order, then half 0 + half 1
    float sum = 0.0f;
#pragma unroll 16
    for (int i = 0; i < 64; ++i) sum += tile_get(tile + tile_at<T>(first + i, line, swz));
    const float other = __shfl_xor_sync(0xffffffffu, sum, 1);
    if (half == 0 && c0 + line < a.C) a.partial[(r0 / kBlock) * a.C + c0 + line] = sum + other;
  }
  const float fmax = max_value(a.f);
  const T* row_src = tile + line * kRow + first;  // row `line`, columns first..
  const T* col_src = tile + first * kRow + line;  // column `line`, rows first..
  const std::int64_t r = r0 + line, c = c0 + line;
  const std::int64_t row_left = a.C - (c0 + first), col_left = a.Rc - (r0 + first);  // values of the codes in the half
  const int row_n = row_left <= 0 ? 0 : row_left >= 64 ? 64 : static_cast<int>(row_left);
  const int col_n = col_left <= 0 ? 0 : col_left >= 64 ? 64 : static_cast<int>(col_left);
  if (a.mode == ScalingMode::block_1x128) {
    if constexpr (Swz) {  // the swizzled tile, read once into registers
      if (a.rowwise) rowwise_1x128<F>(tile, a, r0, c0, fmax);
      if (a.colwise) colwise_1x128<F>(tile, a, r0, c0, fmax);
      return;
    }
    if (a.rowwise) {
      std::uint32_t m = amax64(row_src, 1);
      m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
      const float s = block_scale(fmax, bits_float(m), a.pow2);
      if (r < a.Rr) {
        if (half == 0) a.row_scale_inv[BlockLayout{a.mode, a.Rr, a.C}.index(r, c0)] = reciprocal(s);
        store_codes<F>(a.rowwise + r * a.C + c0 + first, row_src, 1, s, row_n, vec_row);
      }
    }
    if (a.colwise) {
      std::uint32_t m = amax64(col_src, kRow);
      m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
      const float s = block_scale(fmax, bits_float(m), a.pow2);
      if (c < a.C) {
        if (half == 0) a.col_scale_inv[BlockLayout{a.mode, a.C, a.Rc}.index(c, r0)] = reciprocal(s);
        store_codes<F>(a.colwise + c * a.Rc + r0 + first, col_src, kRow, s, col_n, vec_col);
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
    if (a.rowwise && r0 < a.Rr) a.row_scale_inv[BlockLayout{a.mode, a.Rr, a.C}.index(r0, c0)] = reciprocal(s);
    if (a.colwise && r0 < a.Rc) a.col_scale_inv[BlockLayout{a.mode, a.C, a.Rc}.index(c0, r0)] = reciprocal(s);
  }
  __syncthreads();
  const float s = tile_scale;
  if (a.rowwise && r < a.Rr) store_codes<F>(a.rowwise + r * a.C + c0 + first, row_src, 1, s, row_n, vec_row);
  if (a.colwise && c < a.C) store_codes<F>(a.colwise + c * a.Rc + r0 + first, col_src, kRow, s, col_n, vec_col);
}

// The tile staged from src, then its codes (process_tile).
template <class S, Format F, bool Swz>
__device__ __forceinline__ void quantize_tile(const S& src, const Args& a, std::int64_t r0, std::int64_t c0,
                                              bool vec_in) {
  using T = typename S::Tile;
  extern __shared__ __align__(16) unsigned char smem[];
  T* tile = reinterpret_cast<T*>(smem);
  stage<Swz>(tile, src, a, r0, c0, vec_in);
  __syncthreads();
  process_tile<T, F, Swz>(tile, a, r0, c0);
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool in) {  // zeros where !in
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                   static_cast<std::uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(in ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

// Tile (r0, c0) of x (rows a.base + r, C % 8 == 0) copied into a swizzled bf16 tile, 16 bytes a copy,
// zeros outside x: what stage<true> of a PlainSource<bf16> stores.
__device__ __forceinline__ void copy_tile(bf16* tile, const bf16* x, const Args& a, std::int64_t r0, std::int64_t c0) {
#pragma unroll
  for (int i = threadIdx.x; i < kBlock * kBlock / 8; i += kCtaThreads) {
    const int rr = i / (kBlock / 8), cc = i % (kBlock / 8) * 8;
    const std::int64_t r = r0 + rr, c = c0 + cc;
    const bool in = r < a.R && c < a.C;
    cp_async16(tile + tile_at<bf16>(rr, cc, true), in ? x + (a.base + r) * a.C + c : x, in);
  }
}

}  // namespace
}  // namespace kiln::fp8::cuda
