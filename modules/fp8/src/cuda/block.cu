// Block quantisation (kiln/fp8/block.hpp) on the device, bit for bit as quantize_blocks_reference:
// one CTA of 256 threads per 128 x 128 tile of x, staged once in shared memory (bf16 or f32), then
//  - 1x128: each row of the tile is a block of the rowwise codes and each column one of the
//    transpose's (colwise) codes: row and column amaxes over the staged tile;
//  - 128x128: the tile is one block of both: one amax;
// two threads per row (and per column), 64 values each: their amax, one shuffle, the codes as four
// 16-byte stores (a row of the codes, or of the transpose's). A bf16 tile for 1x128 codes is staged
// swizzled and read once into registers: rows as two threads' 16-column pieces taken in turn (their
// stores 32 contiguous bytes), columns four at a time over 16 rows a thread (8-byte reads on every
// bank, a column's eight threads storing 128 contiguous bytes). The staged values are x's or what a
// prologue computes from its tensors as it loads them (loads.cuh: the values the unfused op would
// store); with dbias the same two threads per column also sum it, one partial sum per 128-row tile.
// A grouped quantisation (a mixture of experts' rows, one group per expert) is one launch: each row
// tile belongs to one group, found in the plan the kernel takes in its parameters. A bf16 x's 1x128
// codes (no prologue) come from a persistent kernel instead, its tiles copied by cp.async into two
// buffers, the next tile's copies in flight while a tile's codes are made.
#include <cuda_bf16.h>

#include <algorithm>
#include <span>
#include <type_traits>
#include <vector>

#include "kiln/fp8/block.hpp"
#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/ops/cuda/moments.cuh"
#include "kiln/ops/moments.hpp"
#include "kiln/tensor/alignment.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "adamw.cuh"
#include "loads.cuh"
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

// The sources of the staged values: load(v, r, c) gives kVec consecutive columns c.. of row r (c a
// multiple of kVec and c + kVec <= C: the vector path, each thread's kVec values 16 or 32 bytes of
// every tensor it reads, a warp's loads whole rows of the tile), at(r, c) one value.
template <typename T>
struct PlainSource {
  using Tile = T;
  static constexpr int kVec = 16 / sizeof(T);  // one 16-byte load
  const T* x;
  long long C;
  __device__ void load(float (&v)[kVec], long long r, long long c) const {
    const uint4 raw = *reinterpret_cast<const uint4*>(x + r * C + c);
    if constexpr (sizeof(T) == 2) {
      const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[2 * i] = __uint_as_float(w[i] << 16);  // bf16 -> f32 is exact
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      }
    } else {
      v[0] = __uint_as_float(raw.x), v[1] = __uint_as_float(raw.y), v[2] = __uint_as_float(raw.z),
      v[3] = __uint_as_float(raw.w);
    }
  }
  __device__ float at(long long r, long long c) const { return load1(x, r * C + c); }
};
// x's values through an elementwise load of loads.cuh (GELU, LayerNorm), 16 at a time as those take them.
template <class L>
struct OnX {
  using Tile = bf16;
  static constexpr int kVec = 16;
  const bf16* x;
  long long C;
  L l;
  __device__ void load(float (&v)[kVec], long long r, long long c) const {
    cuda::load16(x + r * C + c, v);
    l(v, static_cast<int>(r), static_cast<int>(c));
  }
  __device__ float at(long long r, long long c) const { return l(load1(x, r * C + c), r, c); }
};
// A load of loads.cuh that reads its own tensors (SwiGLU, dGELU).
template <class L>
struct Own {
  using Tile = bf16;
  static constexpr int kVec = 16;
  L l;
  __device__ void load(float (&v)[kVec], long long r, long long c) const { l.load(v, r, static_cast<int>(c)); }
  __device__ float at(long long r, long long c) const { return l.at(r, c); }
};
// swiglu_backward's [rows, 2 F]: the gate's gradient columns, then the up's (the vector path needs F
// to be a multiple of 16, so that 16 columns lie in one half), each half computed alone (the up's
// reads neither the up values nor computes the gate's gradient).
struct DswigluSource {
  using Tile = bf16;
  static constexpr int kVec = 16;
  DswigluLoad l;
  __device__ void load(float (&v)[kVec], long long r, long long c) const {
    if (c >= l.F)
      l.load_up(v, r, static_cast<int>(c - l.F));
    else
      l.load_gate(v, r, static_cast<int>(c));
  }
  __device__ float at(long long r, long long c) const { return l.at(r, c); }
};

// The optimizer's step of an f32 master weight, applied as its values are loaded (each element once):
// param, m and v updated in place, the updated param staged (the param as it was where the step is
// skipped). Its codes are then the block quantisation of the updated weight. M: the moments' storage
// (float, or std::uint16_t holding bf16 bits).
template <class M>
struct AdamWSource {
  using Tile = float;
  static constexpr int kVec = 4;  // one float4 of each f32 array, four moments
  float* param;
  const float* grad;
  M* m;
  M* v;
  long long C;
  Hyper h;
  __device__ void load(float (&out)[kVec], long long r, long long c) const {
    Hyper hh = h;
    const long long at = r * C + c;
    // All four loads issued before the step's numbers are known (a skipped step reads g, m, v for nothing).
    float4 p4 = *reinterpret_cast<const float4*>(param + at);
    const float4 g4 = *reinterpret_cast<const float4*>(grad + at);
    float m4[4], v4[4];
    kiln::cuda::load4(m + at, m4);
    kiln::cuda::load4(v + at, v4);
    if (step_numbers(hh)) {
      update4(p4, m4, v4, g4, hh);
      *reinterpret_cast<float4*>(param + at) = p4;
      kiln::cuda::store4(m + at, m4);
      kiln::cuda::store4(v + at, v4);
    }
    out[0] = p4.x, out[1] = p4.y, out[2] = p4.z, out[3] = p4.w;
  }
  __device__ float at(long long r, long long c) const {
    Hyper hh = h;
    const long long i = r * C + c;
    float p = param[i];
    if (step_numbers(hh)) {
      float mi = ops::moment_load(m, i), vi = ops::moment_load(v, i);
      update(p, mi, vi, grad[i], hh);
      param[i] = p;
      ops::moment_store(m, i, mi);
      ops::moment_store(v, i, vi);
    }
    return p;
  }
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
      unsigned w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint2 c = v[4 * q + k];
        w[k] = cvt2<F>(__fmul_rn(chunk_value(c, 0), s), __fmul_rn(chunk_value(c, 1), s)) |
               cvt2<F>(__fmul_rn(chunk_value(c, 2), s), __fmul_rn(chunk_value(c, 3), s)) << 16;
      }
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

template <class S, Format F, bool Swz>
__global__ void __launch_bounds__(kCtaThreads) quantize_blocks_kernel(S src, Args a, bool vec_in) {
  quantize_tile<S, F, Swz>(src, a, static_cast<std::int64_t>(blockIdx.y) * kBlock,
                      static_cast<std::int64_t>(blockIdx.x) * kBlock, vec_in);
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

// 1x128 codes of a bf16 x, persistent: CTA b takes tiles b, b + gridDim.x, ... (row-major over [row
// tiles, column tiles]) with two tile buffers, the next tile's copies (cp.async) in flight while this
// one's codes are made; the same codes and scales as quantize_blocks_kernel<PlainSource<bf16>, F, true>.
// (A load of loads.cuh applied in place to a copied tile ran slower than staging its values: 1,752
// against 2,114 GB/s for GELU on load, docs/PERF.md.)
template <Format F>
__global__ void __launch_bounds__(kCtaThreads, 3) quantize_blocks_copied_kernel(PlainSource<bf16> src, Args a,
                                                                                 int tiles_c, int tiles) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* const buf0 = reinterpret_cast<bf16*>(smem);
  bf16* const buf1 = buf0 + kBlock * kRowOf<bf16>;
  const auto r_of = [tiles_c](int t) { return static_cast<std::int64_t>(t / tiles_c) * kBlock; };
  const auto c_of = [tiles_c](int t) { return static_cast<std::int64_t>(t % tiles_c) * kBlock; };
  int t = static_cast<int>(blockIdx.x);
  if (t < tiles) copy_tile(buf0, src.x, a, r_of(t), c_of(t));
  cp_async_commit();
  for (int i = 0; t < tiles; t += static_cast<int>(gridDim.x), ++i) {
    bf16* const tile = i % 2 == 0 ? buf0 : buf1;
    const int next = t + static_cast<int>(gridDim.x);
    if (next < tiles) copy_tile(i % 2 == 0 ? buf1 : buf0, src.x, a, r_of(next), c_of(next));
    cp_async_commit();
    cp_async_wait_one();  // this thread's copies of tile t are in
    __syncthreads();      // and every thread's
    process_tile<bf16, F, true>(tile, a, r_of(t), c_of(t));
    __syncthreads();  // the tile read before the copies of iteration i + 1 go into it
  }
}

// Rowwise 1x128 codes alone (no transpose, no column sums), C a multiple of 128 and every row of x
// coded: no tile to stage. Eight threads take a block (16 values each, loaded as the tile kernel
// stages them: the same values), its amax by three shuffles, and store its 128 codes as eight 16-byte
// words, contiguous; a CTA takes 32 blocks.
constexpr int kRowThreads = 8;
template <class S, Format F>
__global__ void __launch_bounds__(kCtaThreads) quantize_rows_kernel(S src, Args a) {
  constexpr int V = S::kVec, kPer = kBlock / kRowThreads;
  static_assert(kPer % V == 0, "a thread's values are whole loads");
  const std::int64_t blocks_c = a.C / kBlock;
  const std::int64_t g = (static_cast<std::int64_t>(blockIdx.x) * kCtaThreads + threadIdx.x) / kRowThreads;
  const bool valid = g < a.R * blocks_c;  // the warp's lanes all reach the shuffles
  const std::int64_t r = valid ? g / blocks_c : 0, c0 = valid ? g % blocks_c * kBlock : 0,
                     c = c0 + threadIdx.x % kRowThreads * kPer;
  float v[kPer];
  std::uint32_t m = 0;
  if (valid) {
#pragma unroll
    for (int k = 0; k < kPer; k += V) {
      float t[V];
      src.load(t, a.base + r, c + k);
#pragma unroll
      for (int i = 0; i < V; ++i) v[k + i] = t[i];
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) m = max(m, abs_bits(v[i]));
  }
#pragma unroll
  for (int o = 1; o < kRowThreads; o <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (!valid) return;
  const float s = block_scale(max_value(a.f), bits_float(m), a.pow2);
  if (threadIdx.x % kRowThreads == 0) a.row_scale_inv[BlockLayout{a.mode, a.Rr, a.C}.index(r, c0)] = reciprocal(s);
  std::uint32_t w[4];
  encode16<F>(v, s, w);
  *reinterpret_cast<uint4*>(a.rowwise + r * a.C + c) = make_uint4(w[0], w[1], w[2], w[3]);
}

// A grouped quantisation's groups (up to kPlanGroups a launch), in the kernel's parameters: group g's
// row tiles are blockIdx.y in [tile[g], tile[g + 1]), its Args are the launch's with part[g]'s Rows.
constexpr int kPlanGroups = 64;
struct GroupPlan {
  int n = 0;
  int tile[kPlanGroups + 1] = {};
  Rows part[kPlanGroups] = {};
};

// The group of row tile t (blockIdx.y of a grouped launch): its rows, copies and scales into a; the
// first row of the tile within the group.
__device__ __forceinline__ std::int64_t select_group(Args& a, const GroupPlan& plan, int t) {
  int g = 0;
  while (g + 1 < plan.n && plan.tile[g + 1] <= t) ++g;
  static_cast<Rows&>(a) = plan.part[g];
  return static_cast<std::int64_t>(t - plan.tile[g]) * kBlock;
}

template <class S, Format F, bool Swz>
__global__ void __launch_bounds__(kCtaThreads) quantize_blocks_grouped_kernel(S src, Args a,
                                                                           const __grid_constant__ GroupPlan plan,
                                                                           bool vec_in) {
  const std::int64_t r0 = select_group(a, plan, static_cast<int>(blockIdx.y));
  quantize_tile<S, F, Swz>(src, a, r0, static_cast<std::int64_t>(blockIdx.x) * kBlock, vec_in);
}

// Rows [base, base + R) of x [.., C] into copies of Rr rows and Rc columns: 16-byte stores where the
// rows of the codes are multiples of 16 bytes and they are aligned.
Rows rows_of(std::int64_t base, std::int64_t R, std::int64_t Rr, std::int64_t Rc, std::uint8_t* rowwise,
             float* row_scale_inv, std::uint8_t* colwise, float* col_scale_inv, std::int64_t C) {
  return {base, R, Rr, Rc, rowwise, row_scale_inv, colwise, col_scale_inv,
          C % 16 == 0 && aligned16(rowwise), Rc % 16 == 0 && aligned16(colwise)};
}

Args args_of(const BlockCast& k, const Rows& r, float* partial) {
  Args a;
  static_cast<Rows&>(a) = r;
  a.C = k.cols;
  a.mode = k.mode;
  a.f = k.format;
  a.pow2 = k.pow2;
  a.partial = partial;
  return a;
}

std::int64_t row_tiles(const Rows& r) { return blocks_of(std::max(r.R, std::max(r.Rr, r.Rc))); }

// More than the default 48 KB of dynamic shared memory (set at each launch: a host-side call).
template <class K>
std::size_t allow_smem(K kernel, std::size_t bytes) {
  KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  return bytes;
}

// The tile kernel over x, or over the groups' tiles.
template <class S, Format F, bool Swz>
void launch_tiles(const S& src, const Args& a, std::span<const Rows> groups, bool vec_in, cudaStream_t s) {
  const std::int64_t tiles_c = blocks_of(a.C);
  constexpr std::size_t kSmem = kSmemOf<typename S::Tile>;
  if (groups.empty()) {
    const std::int64_t tiles_r = row_tiles(a);
    KILN_CHECK(tiles_c <= 0x7fffffff && tiles_r <= 65535, "fp8 quantize_blocks: [", a.R, ", ", a.C,
               "] is too large for one launch");
    quantize_blocks_kernel<S, F, Swz><<<dim3(static_cast<unsigned>(tiles_c), static_cast<unsigned>(tiles_r)),
                                        kCtaThreads, allow_smem(quantize_blocks_kernel<S, F, Swz>, kSmem), s>>>(src, a,
                                                                                                              vec_in);
    KILN_CUDA_LAUNCH_CHECK();
    return;
  }
  for (std::size_t at = 0; at < groups.size(); at += kPlanGroups) {
    GroupPlan plan;
    for (std::size_t i = at; i < groups.size() && plan.n < kPlanGroups; ++i) {
      const Rows& p = groups[i];
      const std::int64_t tiles = row_tiles(p);
      KILN_CHECK(plan.tile[plan.n] + tiles <= 65535 && tiles_c <= 0x7fffffff,
                 "fp8 quantize_blocks_grouped: too many tiles for one launch");
      plan.part[plan.n] = p;
      plan.tile[plan.n + 1] = plan.tile[plan.n] + static_cast<int>(tiles);
      ++plan.n;
    }
    if (plan.tile[plan.n] == 0) continue;
    quantize_blocks_grouped_kernel<S, F, Swz>
        <<<dim3(static_cast<unsigned>(tiles_c), static_cast<unsigned>(plan.tile[plan.n])), kCtaThreads,
           allow_smem(quantize_blocks_grouped_kernel<S, F, Swz>, kSmem), s>>>(src, a, plan, vec_in);
    KILN_CUDA_LAUNCH_CHECK();
  }
}

// quantize_blocks_copied_kernel over x: as many CTAs as run at once (two tile buffers each), at most
// one a tile.
template <Format F>
void launch_copied(const PlainSource<bf16>& src, const Args& a, cudaStream_t s) {
  const std::int64_t tiles_c = blocks_of(a.C), tiles = row_tiles(a) * tiles_c;
  KILN_CHECK(tiles <= 0x7fffffff, "fp8 quantize_blocks: [", a.R, ", ", a.C, "] is too large for one launch");
  const auto kernel = quantize_blocks_copied_kernel<F>;
  const std::size_t smem = allow_smem(kernel, 2 * kSmemOf<bf16>);
  int device = 0, sms = 0, per_sm = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kCtaThreads, smem));
  const std::int64_t ctas = std::max<std::int64_t>(1, std::min<std::int64_t>(tiles, std::int64_t{sms} * per_sm));
  kernel<<<static_cast<unsigned>(ctas), kCtaThreads, smem, s>>>(src, a, static_cast<int>(tiles_c),
                                                                static_cast<int>(tiles));
  KILN_CUDA_LAUNCH_CHECK();
}

// One launch over x (no groups), or over the groups' tiles: rowwise codes alone without a tile where
// they can, else the tile kernel (its swizzled instances for a bf16 tile's 1x128 codes).
template <class S, Format F>
void launch(const S& src, const Args& a, std::span<const Rows> groups, bool vec_in, cudaStream_t s) {
  if (groups.empty() && a.mode == ScalingMode::block_1x128 && a.rowwise && !a.colwise && !a.partial && vec_in &&
      a.vec_row && a.C % kBlock == 0 && a.Rr == a.R) {
    const std::int64_t ctas = (a.R * (a.C / kBlock) * kRowThreads + kCtaThreads - 1) / kCtaThreads;
    KILN_CHECK(ctas <= 0x7fffffff, "fp8 quantize_blocks: [", a.R, ", ", a.C, "] is too large for one launch");
    quantize_rows_kernel<S, F><<<static_cast<unsigned>(ctas), kCtaThreads, 0, s>>>(src, a);
    KILN_CUDA_LAUNCH_CHECK();
    return;
  }
  if constexpr (std::is_same_v<S, PlainSource<bf16>>) {
    if (groups.empty() && a.mode == ScalingMode::block_1x128 && vec_in) return launch_copied<F>(src, a, s);
  }
  if constexpr (sizeof(typename S::Tile) == 2) {
    if (a.mode == ScalingMode::block_1x128) return launch_tiles<S, F, true>(src, a, groups, vec_in, s);
  }
  launch_tiles<S, F, false>(src, a, groups, vec_in, s);
}

template <class S>
void with_format(const S& src, const Args& a, std::span<const Rows> groups, bool vec_in, cudaStream_t s) {
  if (a.f == Format::e4m3)
    launch<S, Format::e4m3>(src, a, groups, vec_in, s);
  else
    launch<S, Format::e5m2>(src, a, groups, vec_in, s);
}

}  // namespace

namespace {

void check_cast(const BlockCast& k, const char* what) {
  KILN_CHECK(k.mode == ScalingMode::block_1x128 || k.mode == ScalingMode::block_128x128, what,
             ": a block scaling mode is needed");
  KILN_CHECK(k.source == ops::Prologue::plain || k.x_dtype == DType::bf16, what, ": a prologue's tensors are bf16");
}

// The groups' parts, checked: padded copies at least the group's rows, every group the same copies.
std::vector<Rows> parts_of(const BlockCast& k, std::span<const BlockCastGroup> groups, bool padded,
                                const char* what) {
  std::vector<Rows> parts;
  int copies = -1;
  for (const BlockCastGroup& g : groups) {
    if (g.rows <= 0) continue;
    const std::int64_t Rr = g.row_rows ? g.row_rows : g.rows, Rc = g.col_cols ? g.col_cols : g.rows;
    KILN_CHECK(g.first >= 0 && g.first + g.rows <= k.rows, what, ": group rows ", g.first, "..", g.first + g.rows,
               " of ", k.rows);
    KILN_CHECK(Rr >= g.rows && Rc >= g.rows && (padded || (Rr == g.rows && Rc == g.rows)), what, ": copies of ", Rr,
               " rows and ", Rc, " columns for a group of ", g.rows, " rows");
    KILN_CHECK(!g.rowwise == !g.row_scale_inv && !g.colwise == !g.col_scale_inv && (g.rowwise || g.colwise), what,
               ": each group's copies with their scales");
    const int c = (g.rowwise ? 1 : 0) | (g.colwise ? 2 : 0);
    KILN_CHECK(copies < 0 || copies == c, what, ": every group with the same copies");
    copies = c;
    parts.push_back(rows_of(g.first, g.rows, Rr, Rc, g.rowwise, g.row_scale_inv, g.colwise, g.col_scale_inv, k.cols));
  }
  return parts;
}

// The launch of k's source (its values on load) over x, or over the groups' parts.
void dispatch(const BlockCast& k, const Args& a, std::span<const Rows> parts, cudaStream_t s) {
  const long long C = k.cols;
  const bool cols16 = C % 16 == 0 && aligned16(k.x);
  const auto* x = static_cast<const bf16*>(k.x);
  const auto* aux = static_cast<const bf16*>(k.aux);
  switch (k.source) {
    case ops::Prologue::plain:
      if (k.x_dtype == DType::bf16)
        with_format(PlainSource<bf16>{x, C}, a, parts, C % PlainSource<bf16>::kVec == 0 && aligned16(k.x), s);
      else
        with_format(PlainSource<float>{static_cast<const float*>(k.x), C}, a, parts,
                    C % PlainSource<float>::kVec == 0 && aligned16(k.x), s);
      break;
    case ops::Prologue::layernorm:
      with_format(OnX<LayerNormLoad>{x, C, {k.mean, k.rstd, static_cast<const bf16*>(k.ln_weight),
                                            static_cast<const bf16*>(k.ln_bias)}},
                  a, parts, cols16 && aligned16(k.ln_weight) && aligned16(k.ln_bias), s);
      break;
    case ops::Prologue::gelu: with_format(OnX<GeluLoad>{x, C, {}}, a, parts, cols16, s); break;
    case ops::Prologue::swiglu: with_format(Own<SwigluLoad>{{x, C}}, a, parts, cols16, s); break;
    case ops::Prologue::dgelu: with_format(Own<DgeluLoad>{{x, aux, C}}, a, parts, cols16 && aligned16(aux), s); break;
    case ops::Prologue::dswiglu:
      with_format(DswigluSource{{x, aux, C / 2}}, a, parts, C % 32 == 0 && aligned16(k.x) && aligned16(aux), s);
      break;
  }
}

void adamw_dispatch(const BlockCast& k, const AdamWQuantizeDev& u, const Args& a, std::span<const Rows> parts,
                    cudaStream_t s) {
  ops::with_moments(u.bf16_moments, u.m, u.v, [&]<class M>(M* m, M* v) {
    const AdamWSource<M> src{u.param, u.grad, m, v, k.cols,
                             hyper_of(u.lr, u.beta1, u.beta2, u.eps, u.weight_decay, u.grad_scale, u.step, u.scalars)};
    const bool vec = k.cols % AdamWSource<M>::kVec == 0 && aligned16(u.param) && aligned16(u.grad) && aligned16(m) &&
                     aligned16(v);
    with_format(src, a, parts, vec, s);
  });
}

}  // namespace

void quantize_blocks_adamw(const BlockCast& k, const AdamWQuantizeDev& u, cudaStream_t s) {
  check_cast(k, "fp8 quantize_blocks_adamw");
  KILN_CHECK(!k.rowwise == !k.row_scale_inv && !k.colwise == !k.col_scale_inv && (k.rowwise || k.colwise),
             "fp8 quantize_blocks_adamw: a copy with its scales");
  KILN_CHECK(u.param && u.grad && u.m && u.v && u.batch == 1 && u.rows == k.rows && u.cols == k.cols,
             "fp8 quantize_blocks_adamw: an f32 master [", u.rows, ",", u.cols, "] for codes [", k.rows, ",", k.cols, "]");
  if (k.rows <= 0 || k.cols <= 0) return;
  KILN_CHECK((k.row_rows == 0 || k.row_rows == k.rows) && (k.col_cols == 0 || k.col_cols == k.rows),
             "fp8 quantize_blocks_adamw: no padded copies");
  const Args a =
      args_of(k, rows_of(0, k.rows, k.rows, k.rows, k.rowwise, k.row_scale_inv, k.colwise, k.col_scale_inv, k.cols), nullptr);
  adamw_dispatch(k, u, a, {}, s);
}

void quantize_blocks_adamw_grouped(const BlockCast& k, const AdamWQuantizeDev& u,
                                   std::span<const BlockCastGroup> groups, cudaStream_t s) {
  check_cast(k, "fp8 quantize_blocks_adamw_grouped");
  KILN_CHECK(u.param && u.grad && u.m && u.v && u.batch == 1 && u.rows == k.rows && u.cols == k.cols,
             "fp8 quantize_blocks_adamw_grouped: an f32 master [", u.rows, ",", u.cols, "] for [", k.rows, ",", k.cols,
             "]");
  if (k.rows <= 0 || k.cols <= 0) return;
  const std::vector<Rows> parts = parts_of(k, groups, false, "fp8 quantize_blocks_adamw_grouped");
  std::int64_t next = 0;
  for (const Rows& p : parts) {
    KILN_CHECK(p.base == next, "fp8 quantize_blocks_adamw_grouped: the groups must cover the weight's rows in order, "
                               "group at row ", p.base, " after ", next);
    next = p.base + p.R;
  }
  KILN_CHECK(next == k.rows, "fp8 quantize_blocks_adamw_grouped: groups of ", next, " rows for a weight of ", k.rows);
  adamw_dispatch(k, u, args_of(k, {}, nullptr), parts, s);
}

std::int64_t block_partials(std::int64_t rows, std::int64_t cols) { return blocks_of(rows) * cols; }

void quantize_blocks(const BlockCast& k, cudaStream_t s) {
  check_cast(k, "fp8 quantize_blocks");
  KILN_CHECK(!k.rowwise == !k.row_scale_inv && !k.colwise == !k.col_scale_inv,
             "fp8 quantize_blocks: codes without scales, or scales without codes");
  KILN_CHECK(!k.dbias || k.partial, "fp8 quantize_blocks: dbias without partial-sum scratch");
  const std::int64_t Rr = k.row_rows ? k.row_rows : k.rows, Rc = k.col_cols ? k.col_cols : k.rows;
  if (std::max(k.rows, std::max(Rr, Rc)) <= 0 || k.cols <= 0 || (!k.rowwise && !k.colwise && !k.dbias)) return;
  KILN_CHECK(Rr >= k.rows && Rc >= k.rows && (!k.dbias || (Rr == k.rows && Rc == k.rows)),
             "fp8 quantize_blocks: padded copies of ", Rr, " rows and ", Rc, " columns for ", k.rows, " rows",
             k.dbias ? " with dbias" : "");
  const Args a = args_of(k, rows_of(0, k.rows, Rr, Rc, k.rowwise, k.row_scale_inv, k.colwise, k.col_scale_inv, k.cols),
                         k.dbias ? k.partial : nullptr);
  dispatch(k, a, {}, s);
  if (k.dbias) bias_from_partials(k.dbias, k.partial, blocks_of(k.rows), k.cols, s);
}

void quantize_blocks_grouped(const BlockCast& k, std::span<const BlockCastGroup> groups, cudaStream_t s) {
  check_cast(k, "fp8 quantize_blocks_grouped");
  KILN_CHECK(!k.dbias, "fp8 quantize_blocks_grouped: no bias gradient");
  if (k.cols <= 0) return;
  const std::vector<Rows> parts = parts_of(k, groups, true, "fp8 quantize_blocks_grouped");
  if (parts.empty()) return;
  dispatch(k, args_of(k, {}, nullptr), parts, s);
}

}  // namespace kiln::fp8::cuda
