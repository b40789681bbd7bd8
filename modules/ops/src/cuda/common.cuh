#pragma once
// Device helpers shared by kiln's CUDA kernels: 16-byte packs of 8 bf16, warp reductions, grid
// sizing, and the fixed-order column reduction used by the deterministic two-stage reductions.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "kiln/ops/cuda/device_basics.cuh"
#include "kiln/ops/cuda/launchers.hpp"
#include "kiln/tensor/alignment.hpp"

namespace kiln::cuda {

// ---- 8 bf16 <-> one 16-byte word (unpack8: device_basics.cuh) ----
// The entry of a table sorted by `work` (the pieces of a launch laid end to end) that holds work
// index w: the last whose work is <= w. The tables are tiny and read by every thread (L1).
template <class Entry>
__device__ __forceinline__ int entry_at_work(const Entry* table, int n, std::int64_t w) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(&table[mid].work) <= w)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // round to nearest even, like round_bf16()
  return *reinterpret_cast<unsigned*>(&h);
}

__device__ __forceinline__ uint4 pack8(const float f[8]) {
  return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}

__device__ __forceinline__ uint4 load16(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ void store16(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

__device__ __forceinline__ void load8(const bf16* p, float f[8]) { unpack8(load16(p), f); }
__device__ __forceinline__ void store8(bf16* p, const float f[8]) { store16(p, pack8(f)); }

// 8 f32 as two float4.
__device__ __forceinline__ void load8(const float* p, float f[8]) {
  float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
__device__ __forceinline__ void store8(float* p, const float f[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}

// Chunk [c, c + 8) of a row: 16-byte vector access with VEC, else element by element over the
// `valid` leading channels (loads fill the rest with zeros).
template <bool VEC, class T>
__device__ __forceinline__ void load_chunk(const T* p, int valid, float f[8]) {
  if constexpr (VEC) {
    load8(p, f);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if constexpr (sizeof(T) == 2) f[k] = k < valid ? __bfloat162float(p[k]) : 0.0f;
      else f[k] = k < valid ? p[k] : 0.0f;
    }
  }
}
template <bool VEC>
__device__ __forceinline__ void store_chunk(bf16* p, int valid, const float f[8]) {
  if constexpr (VEC) {
    store8(p, f);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (k < valid) p[k] = __float2bfloat16_rn(f[k]);
  }
}
template <bool VEC>
__device__ __forceinline__ void store_chunk(float* p, int valid, const float f[8]) {
  if constexpr (VEC) {
    store8(p, f);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (k < valid) p[k] = f[k];
  }
}

// A parameter gradient's element, f32 or bf16 (optim.grads = "bf16"): read as f32; stored as is,
// or rounded once to nearest even (round_bf16 on the host).
__device__ __forceinline__ float grad_load(const float* p) { return *p; }
__device__ __forceinline__ float grad_load(const bf16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void grad_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void grad_store(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

// ---- reductions (butterfly: every lane ends with the same, order-fixed result; warp_sum(float):
// device_basics.cuh) ----
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- host helpers ----

inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Blocks for a grid-stride loop over `work` items: enough to fill any current GPU many times over,
// few enough that each thread does a handful of iterations.
inline unsigned grid_for(std::int64_t work, int threads, std::int64_t cap = 16384) {
  return static_cast<unsigned>(std::clamp<std::int64_t>(ceil_div(work, threads), 1, cap));
}

// out[w] += sum over p < P of partials[p * ld + w] for w < W, always summed in the same order
// (strided sequential sums, then a fixed tree): the second stage of kiln's deterministic
// reductions. With out1, the next W1 columns the same way into out1[w - W], in the same launch
// (each column's sum unchanged). Defined in bias_grad.cu.
void reduce_partials(float* out, const float* partials, int P, int W, int ld, cudaStream_t s, float* out1 = nullptr,
                     int W1 = 0);
// The same into bf16 gradients: out[w] = round(float(out[w]) + the same f32 total).
void reduce_partials(bf16* out, const float* partials, int P, int W, int ld, cudaStream_t s, bf16* out1 = nullptr,
                     int W1 = 0);

}  // namespace kiln::cuda
