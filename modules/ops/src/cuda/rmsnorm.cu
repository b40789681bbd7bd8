// RMSNorm forward (a warp per row, fp32 sum of squares) and backward (dx accumulated into bf16;
// dweight by a deterministic two-stage reduction: each block's partial sums over its fixed rows,
// then reduce_partials' fixed-order sum).
#include "common.cuh"
#include "kiln/ops/cuda/launchers.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;  // 8 rows (warps) per block
constexpr int kMaxBlocks = 512;

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

// dx: a warp per row. dweight: block b sums rows [b * rpb, (b + 1) * rpb) per channel into its row
// of `partials` (each channel owned by one thread: a fixed order).
__global__ __launch_bounds__(kThreads) void rms_backward_dx(bf16* dx, const bf16* dout, const bf16* x,
                                                            const bf16* weight, const float* rstd, int N, int C) {
  const int lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  for (int row = blockIdx.x * warps + threadIdx.x / kWarp; row < N; row += gridDim.x * warps) {
    const std::int64_t off = static_cast<std::int64_t>(row) * C;
    const float r = rstd[row];
    float dot = 0;
    for (int c = lane; c < C; c += kWarp)
      dot += __bfloat162float(dout[off + c]) * __bfloat162float(weight[c]) * __bfloat162float(x[off + c]);
    const float k = warp_sum(dot) * r * r * r / static_cast<float>(C);
    for (int c = lane; c < C; c += kWarp) {
      const float g = __bfloat162float(dout[off + c]), w = __bfloat162float(weight[c]);
      const float d = r * w * g - __bfloat162float(x[off + c]) * k;
      dx[off + c] = __float2bfloat16_rn(__bfloat162float(dx[off + c]) + d);
    }
  }
}

__global__ __launch_bounds__(kThreads) void rms_backward_dw(float* partials, const bf16* dout, const bf16* x,
                                                            const float* rstd, int N, int C, int rpb) {
  const int r0 = blockIdx.x * rpb, r1 = min(N, r0 + rpb);
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float s = 0;
    for (int r = r0; r < r1; ++r) {
      const std::int64_t off = static_cast<std::int64_t>(r) * C + c;
      s += __bfloat162float(dout[off]) * __bfloat162float(x[off]) * rstd[r];
    }
    partials[static_cast<std::int64_t>(blockIdx.x) * C + c] = s;
  }
}

int rows_per_block(int N) { return static_cast<int>(ceil_div(std::max(N, 1), kMaxBlocks)); }

}  // namespace

void rmsnorm_forward(bf16* out, float* rstd, const bf16* x, const bf16* weight, int N, int C, float eps,
                     cudaStream_t s) {
  if (N == 0) return;
  rms_forward<<<grid_for(N, kThreads / kWarp), kThreads, 0, s>>>(out, rstd, x, weight, N, C, eps);
  KILN_CUDA_LAUNCH_CHECK();
}

std::int64_t rmsnorm_backward_scratch(int N, int C) {
  return ceil_div(std::max(N, 1), rows_per_block(N)) * static_cast<std::int64_t>(C);
}

void rmsnorm_backward(bf16* dx, float* dweight, float* scratch, const bf16* dout, const bf16* x, const bf16* weight,
                      const float* rstd, int N, int C, cudaStream_t s) {
  if (N == 0) return;
  rms_backward_dx<<<grid_for(N, kThreads / kWarp), kThreads, 0, s>>>(dx, dout, x, weight, rstd, N, C);
  KILN_CUDA_LAUNCH_CHECK();
  const int rpb = rows_per_block(N), blocks = static_cast<int>(ceil_div(N, rpb));
  rms_backward_dw<<<blocks, kThreads, 0, s>>>(scratch, dout, x, rstd, N, C, rpb);
  KILN_CUDA_LAUNCH_CHECK();
  reduce_partials(dweight, scratch, blocks, C, C, s);
}

}  // namespace kiln::cuda
