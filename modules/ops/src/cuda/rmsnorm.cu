// RMSNorm forward (a warp per row, fp32 sum of squares). The backward runs LayerNorm's kernels
// without the mean and the bias (layernorm.cu).
#include "common.cuh"
#include "kiln/ops/cuda/launchers.hpp"
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

}  // namespace

void rmsnorm_forward(bf16* out, float* rstd, const bf16* x, const bf16* weight, int N, int C, float eps,
                     cudaStream_t s) {
  if (N == 0) return;
  rms_forward<<<grid_for(N, kThreads / kWarp), kThreads, 0, s>>>(out, rstd, x, weight, N, C, eps);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda
