#pragma once
// The smallest device helpers of kiln's CUDA kernels, public for other modules' kernels that must
// compute exactly as they do (kiln/ops/cuda/layernorm_row.cuh): the warp size, the butterfly warp
// sum (every lane ends with the same, order-fixed result), and 8 bf16 in one 16-byte word as f32.
// Include from .cu files only.
#include <cuda_bf16.h>

namespace kiln::cuda {

constexpr int kWarp = 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// bf16 -> f32 is exact: the bf16 bits are the high half of the float. Lowest address first.
__device__ __forceinline__ void unpack8(uint4 u, float f[8]) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

}  // namespace kiln::cuda
