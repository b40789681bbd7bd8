#pragma once
// The row statistics of the CUDA LayerNorm forward (a warp per row), as device functions, so that
// kernels of other modules that compute a LayerNorm themselves (the fp8 module's LayerNorm-on-load)
// get mean and rstd bit for bit as layernorm_forward writes them. Include from .cu files only.
//
// Vectorised rows (C % 8 == 0, 16-byte aligned, C <= 256 * CPL): lane l holds 16-byte chunks
// l, l + 32, ... in registers; sums per lane in chunk order, then a butterfly over the warp; the
// variance a second pass over the registers (like the CPU's two loops). Other rows: per lane over a
// stride of 32 elements, in the same two passes.
#include <cuda_bf16.h>

#include <cstdint>

#include "kiln/ops/cuda/device_basics.cuh"

namespace kiln::cuda::layernorm_row {

// Lane `lane`'s chunks of row xr (C / 8 chunks); the chunks past the row are zeros.
template <int CPL>
__device__ __forceinline__ void load_row(const __nv_bfloat16* xr, int C, int lane, uint4 (&cache)[CPL]) {
  const int chunks = C / 8;
#pragma unroll
  for (int j = 0; j < CPL; ++j) {
    const int q = lane + j * kWarp;
    cache[j] = q < chunks ? *reinterpret_cast<const uint4*>(xr + q * 8) : make_uint4(0, 0, 0, 0);
  }
}

// Mean and rstd = 1 / sqrt(var + eps) of a row held by load_row (every lane gets both).
template <int CPL>
__device__ __forceinline__ void stats_vec(const uint4 (&cache)[CPL], int C, int lane, float eps, float& mean,
                                          float& rstd) {
  const int chunks = C / 8;
  float sum = 0;
#pragma unroll
  for (int j = 0; j < CPL; ++j) {
    float f[8];
    unpack8(cache[j], f);  // padding chunks are zeros and add nothing
#pragma unroll
    for (int k = 0; k < 8; ++k) sum += f[k];
  }
  const float m = warp_sum(sum) / static_cast<float>(C);
  float var = 0;
#pragma unroll
  for (int j = 0; j < CPL; ++j) {
    if (lane + j * kWarp >= chunks) continue;
    float f[8];
    unpack8(cache[j], f);
#pragma unroll
    for (int k = 0; k < 8; ++k) var += (f[k] - m) * (f[k] - m);
  }
  var = warp_sum(var) / static_cast<float>(C);
  mean = m;
  rstd = 1.0f / sqrtf(var + eps);
}

// The same for any row, read from memory (two passes; the second hits L1/L2).
__device__ __forceinline__ void stats_any(const __nv_bfloat16* xr, int C, int lane, float eps, float& mean,
                                          float& rstd) {
  float sum = 0;
  for (int c = lane; c < C; c += kWarp) sum += __bfloat162float(xr[c]);
  const float m = warp_sum(sum) / static_cast<float>(C);
  float var = 0;
  for (int c = lane; c < C; c += kWarp) {
    const float d = __bfloat162float(xr[c]) - m;
    var += d * d;
  }
  var = warp_sum(var) / static_cast<float>(C);
  mean = m;
  rstd = 1.0f / sqrtf(var + eps);
}

}  // namespace kiln::cuda::layernorm_row
