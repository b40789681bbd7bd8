// RMSNorm forward (a warp per row, fp32 sum of squares; the row held in registers where C % 8 == 0).
// The backward runs LayerNorm's kernels
// without the mean and the bias (layernorm.cu).
#include "common.cuh"
#include "kiln/ops/cuda/launchers.hpp"
#include "kiln/ops/cuda/layernorm_row.cuh"
#include "kiln/ops/formulas.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;  // 8 rows (warps) per block

__global__ __launch_bounds__(kThreads) void rms_forward(bf16* out, float* rstd, const bf16* x, const bf16* weight,
                                                        int N, int C, float eps) {
  const int lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  for (int row = blockIdx.x * warps + threadIdx.x / kWarp; row < N; row += gridDim.x * warps) {
    const bf16* xr = x + static_cast<std::int64_t>(row) * C;
    float ss = 0;
    for (int c = lane; c < C; c += kWarp) {
      const float v = __bfloat162float(xr[c]);
      ss += v * v;
    }
    const float r = rsqrtf(warp_sum(ss) / static_cast<float>(C) + eps);
    bf16* o = out + static_cast<std::int64_t>(row) * C;
    for (int c = lane; c < C; c += kWarp)
      o[c] = __float2bfloat16_rn(__bfloat162float(xr[c]) * r * __bfloat162float(weight[c]));
    if (lane == 0) rstd[row] = r;
  }
}

// Fast path, C % 8 == 0 and C <= 256 * CPL (16-byte aligned rows): the row is held in registers as
// packed bf16 (CPL 16-byte chunks per lane) and read from memory once.
template <int CPL>
__global__ __launch_bounds__(kThreads) void rms_forward_vec(bf16* out, float* rstd, const bf16* x, const bf16* weight,
                                                            int N, int C, float eps) {
  const int lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  const int chunks = C / 8;
  for (int row = blockIdx.x * warps + threadIdx.x / kWarp; row < N; row += gridDim.x * warps) {
    uint4 cache[CPL];
    layernorm_row::load_row(x + static_cast<std::int64_t>(row) * C, C, lane, cache);
    float ss = 0;
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
      float f[8];
      unpack8(cache[j], f);  // padding chunks are zeros
#pragma unroll
      for (int k = 0; k < 8; ++k) ss += f[k] * f[k];
    }
    const float r = rsqrtf(warp_sum(ss) / static_cast<float>(C) + eps);
    bf16* o = out + static_cast<std::int64_t>(row) * C;
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
      const int q = lane + j * kWarp;
      if (q >= chunks) continue;
      float f[8], w[8];
      unpack8(cache[j], f);
      load8(weight + q * 8, w);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = f[k] * r * w[k];
      store8(o + q * 8, f);
    }
    if (lane == 0) rstd[row] = r;
  }
}

template <int CPL>
void launch_vec(bf16* out, float* rstd, const bf16* x, const bf16* weight, int N, int C, float eps, cudaStream_t s) {
  rms_forward_vec<CPL><<<grid_for(N, kThreads / kWarp), kThreads, 0, s>>>(out, rstd, x, weight, N, C, eps);
}

}  // namespace

void rmsnorm_forward(bf16* out, float* rstd, const bf16* x, const bf16* weight, int N, int C, float eps,
                     cudaStream_t s) {
  if (N == 0) return;
  const int cpl = static_cast<int>(ceil_div(C / 8, kWarp));  // 16-byte chunks per lane
  const bool vec = C % 8 == 0 && aligned16(out) && aligned16(x) && aligned16(weight);
  if (!vec || cpl > 16)
    rms_forward<<<grid_for(N, kThreads / kWarp), kThreads, 0, s>>>(out, rstd, x, weight, N, C, eps);
  else if (cpl <= 2)
    launch_vec<2>(out, rstd, x, weight, N, C, eps, s);
  else if (cpl <= 4)
    launch_vec<4>(out, rstd, x, weight, N, C, eps, s);
  else if (cpl <= 8)
    launch_vec<8>(out, rstd, x, weight, N, C, eps, s);
  else
    launch_vec<16>(out, rstd, x, weight, N, C, eps, s);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda
