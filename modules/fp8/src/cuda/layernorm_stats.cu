// LayerNorm statistics for an FP8 layer that computes its LayerNorm input on load (Fp8Ops::
// layernorm_stats): a warp per row through the ops backend's own row statistics
// (kiln/ops/cuda/layernorm_row.cuh), taking the vectorised or plain path for the same C, so mean
// and rstd are bit-identical to what layernorm_forward writes. With an amax, the row's outputs
// act(layernorm_apply(...)) are formed in registers and only their max |y| leaves the kernel.
#include <algorithm>

#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/ops/cuda/layernorm_row.cuh"
#include "kiln/ops/formulas.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "tiles.cuh"

namespace kiln::fp8::cuda {

namespace {

namespace lnrow = ::kiln::cuda::layernorm_row;
using ::kiln::cuda::kWarp;
using ::kiln::cuda::unpack8;

__device__ __forceinline__ float act_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// C % 8 == 0, C <= 256 * CPL: the row in registers (CPL 16-byte chunks per lane).
template <int CPL, bool AMAX>
__global__ void __launch_bounds__(kThreads)
    ln_stats_vec(const bf16* __restrict__ x, const bf16* __restrict__ weight, const bf16* __restrict__ bias,
                 float* __restrict__ mean, float* __restrict__ rstd, float* amax, int N, int C, float eps) {
  const int lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  const int chunks = C / 8;
  unsigned local = 0;
  for (int row = blockIdx.x * warps + threadIdx.x / kWarp; row < N; row += gridDim.x * warps) {
    uint4 cache[CPL];
    lnrow::load_row(x + static_cast<std::int64_t>(row) * C, C, lane, cache);
    float m = 0, s = 0;
    lnrow::stats_vec(cache, C, lane, eps, m, s);
    if (AMAX)
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        const int q = lane + j * kWarp;
        if (q >= chunks) continue;
        float f[8], w[8], b[8];
        unpack8(cache[j], f);
        unpack8(*reinterpret_cast<const uint4*>(weight + q * 8), w);
        unpack8(*reinterpret_cast<const uint4*>(bias + q * 8), b);
#pragma unroll
        for (int k = 0; k < 8; ++k) local = max(local, abs_bits(act_round(ops::layernorm_apply(f[k], m, s, w[k], b[k]))));
      }
    if (lane == 0) {
      mean[row] = m;
      rstd[row] = s;
    }
  }
  if (AMAX) block_amax(local, amax);
}

// Any C: the statistics from memory, then (with an amax) a third pass.
template <bool AMAX>
__global__ void __launch_bounds__(kThreads)
    ln_stats_any(const bf16* __restrict__ x, const bf16* __restrict__ weight, const bf16* __restrict__ bias,
                 float* __restrict__ mean, float* __restrict__ rstd, float* amax, int N, int C, float eps) {
  const int lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  unsigned local = 0;
  for (int row = blockIdx.x * warps + threadIdx.x / kWarp; row < N; row += gridDim.x * warps) {
    const bf16* xr = x + static_cast<std::int64_t>(row) * C;
    float m = 0, s = 0;
    lnrow::stats_any(xr, C, lane, eps, m, s);
    if (AMAX)
      for (int c = lane; c < C; c += kWarp)
        local = max(local, abs_bits(act_round(ops::layernorm_apply(__bfloat162float(xr[c]), m, s,
                                                                   __bfloat162float(weight[c]),
                                                                   __bfloat162float(bias[c])))));
    if (lane == 0) {
      mean[row] = m;
      rstd[row] = s;
    }
  }
  if (AMAX) block_amax(local, amax);
}

template <int CPL>
void launch_vec(const LayerNormOfDev& ln, float* mean, float* rstd, float* amax, int N, int C, float eps, unsigned grid,
                cudaStream_t s) {
  if (amax)
    ln_stats_vec<CPL, true><<<grid, kThreads, 0, s>>>(ln.x, ln.weight, ln.bias, mean, rstd, amax, N, C, eps);
  else
    ln_stats_vec<CPL, false><<<grid, kThreads, 0, s>>>(ln.x, ln.weight, ln.bias, mean, rstd, amax, N, C, eps);
}

}  // namespace

void layernorm_stats(const LayerNormOfDev& ln, float* mean, float* rstd, float* amax, std::int64_t rows,
                     std::int64_t cols, float eps, cudaStream_t s) {
  KILN_CHECK(rows >= 0 && cols >= 0 && rows <= 0x7fffffff && cols <= 0x7fffffff && ln.x && ln.weight && ln.bias &&
                 mean && rstd,
             "fp8 layernorm_stats: [", rows, ",", cols, "]");
  if (rows == 0 || cols == 0) return;
  const int N = static_cast<int>(rows), C = static_cast<int>(cols);
  const unsigned grid = static_cast<unsigned>(std::clamp<std::int64_t>((rows + 7) / 8, 1, 1 << 20));  // 8 rows a block
  // The vectorised path where layernorm_forward takes it (its output aligned as well).
  const bool vec = C % 8 == 0 && aligned16(ln.x) && aligned16(ln.weight) && aligned16(ln.bias);
  const int cpl = (C / 8 + kWarp - 1) / kWarp;
  if (!vec || cpl > 16) {
    if (amax)
      ln_stats_any<true><<<grid, kThreads, 0, s>>>(ln.x, ln.weight, ln.bias, mean, rstd, amax, N, C, eps);
    else
      ln_stats_any<false><<<grid, kThreads, 0, s>>>(ln.x, ln.weight, ln.bias, mean, rstd, amax, N, C, eps);
  } else if (cpl <= 1) {
    launch_vec<1>(ln, mean, rstd, amax, N, C, eps, grid, s);
  } else if (cpl <= 2) {
    launch_vec<2>(ln, mean, rstd, amax, N, C, eps, grid, s);
  } else if (cpl <= 4) {
    launch_vec<4>(ln, mean, rstd, amax, N, C, eps, grid, s);
  } else if (cpl <= 8) {
    launch_vec<8>(ln, mean, rstd, amax, N, C, eps, grid, s);
  } else {
    launch_vec<16>(ln, mean, rstd, amax, N, C, eps, grid, s);
  }
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::fp8::cuda
