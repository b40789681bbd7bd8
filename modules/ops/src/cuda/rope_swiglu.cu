// Llama's elementwise ops: rotary position embeddings (in place on the fused QKV's query and key
// heads) and SwiGLU forward and backward.
#include "common.cuh"
#include "kiln/ops/cuda/launchers.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per (position, pair i, rotated head); the angle is the CPU's f32 pos * inv_freq.
__global__ __launch_bounds__(kThreads) void rope_kernel(bf16* x, std::int64_t positions, int T, int heads,
                                                        int rotated, int D, float theta, std::int64_t pos_offset,
                                                        float sign) {
  const int half = D / 2;
  const std::int64_t work = positions * half * rotated;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; idx < work;
       idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int h = static_cast<int>(idx % rotated);
    const int i = static_cast<int>((idx / rotated) % half);
    const std::int64_t p = idx / (static_cast<std::int64_t>(rotated) * half);
    const float pos = static_cast<float>(pos_offset + p % T);
    const float angle = pos * ops::rope_inv_freq(i, D, theta);
    float sn, c;
    sincosf(angle, &sn, &c);
    sn *= sign;
    bf16* head = x + (p * heads + h) * D;
    const float x0 = __bfloat162float(head[i]), x1 = __bfloat162float(head[i + half]);
    head[i] = __float2bfloat16_rn(x0 * c - x1 * sn);
    head[i + half] = __float2bfloat16_rn(x1 * c + x0 * sn);
  }
}

__global__ __launch_bounds__(kThreads) void swiglu_fwd(bf16* out, const bf16* x, std::int64_t N, int F) {
  const std::int64_t work = N * F;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; idx < work;
       idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t n = idx / F, f = idx % F;
    const float g = __bfloat162float(x[n * 2 * F + f]), u = __bfloat162float(x[n * 2 * F + F + f]);
    out[idx] = __float2bfloat16_rn(ops::silu(g) * u);
  }
}

__global__ __launch_bounds__(kThreads) void swiglu_bwd(bf16* dx, const bf16* dout, const bf16* x, std::int64_t N,
                                                       int F) {
  const std::int64_t work = N * F;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; idx < work;
       idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t n = idx / F, f = idx % F;
    const float g = __bfloat162float(x[n * 2 * F + f]), u = __bfloat162float(x[n * 2 * F + F + f]);
    const float go = __bfloat162float(dout[idx]);
    dx[n * 2 * F + f] = __float2bfloat16_rn(go * u * ops::silu_grad(g));
    dx[n * 2 * F + F + f] = __float2bfloat16_rn(go * ops::silu(g));
  }
}

}  // namespace

void rope(bf16* x, int B, int T, int heads, int rotated, int D, float theta, std::int64_t pos_offset, bool inverse,
          cudaStream_t s) {
  const std::int64_t positions = static_cast<std::int64_t>(B) * T, work = positions * (D / 2) * rotated;
  if (work == 0) return;
  rope_kernel<<<grid_for(work, kThreads), kThreads, 0, s>>>(x, positions, T, heads, rotated, D, theta, pos_offset,
                                                             inverse ? -1.0f : 1.0f);
  KILN_CUDA_LAUNCH_CHECK();
}

void swiglu_forward(bf16* out, const bf16* x, std::int64_t N, int F, cudaStream_t s) {
  if (N * F == 0) return;
  swiglu_fwd<<<grid_for(N * F, kThreads), kThreads, 0, s>>>(out, x, N, F);
  KILN_CUDA_LAUNCH_CHECK();
}

void swiglu_backward(bf16* dx, const bf16* dout, const bf16* x, std::int64_t N, int F, cudaStream_t s) {
  if (N * F == 0) return;
  swiglu_bwd<<<grid_for(N * F, kThreads), kThreads, 0, s>>>(dx, dout, x, N, F);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda
