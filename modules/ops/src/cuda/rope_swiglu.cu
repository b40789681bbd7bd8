// Llama's elementwise ops: rotary position embeddings (in place on the fused QKV's query and key
// heads) and SwiGLU forward and backward.
#include "common.cuh"
#include "kiln/ops/cuda/launchers.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per (position, rotated head, pair i), i fastest: a warp reads and writes the two
// contiguous halves of a head. The angle is the CPU's f32 pos * inv_freq.
__global__ __launch_bounds__(kThreads) void rope_kernel(bf16* x, std::int64_t positions, int T, int heads,
                                                        int rotated, int D, float theta, ops::RopeScaling scaling,
                                                        std::int64_t pos_offset, float sign) {
  const int half = D / 2;
  const std::int64_t work = positions * half * rotated;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; idx < work;
       idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(idx % half);
    const std::int64_t ph = idx / half;
    const int h = static_cast<int>(ph % rotated);
    const std::int64_t p = ph / rotated;
    const float pos = static_cast<float>(pos_offset + p % T);
    const float angle = pos * ops::rope_inv_freq(i, D, theta, scaling);
    float sn, c;
    sincosf(angle, &sn, &c);
    sn *= sign;
    bf16* head = x + (p * heads + h) * D;
    const float x0 = __bfloat162float(head[i]), x1 = __bfloat162float(head[i + half]);
    head[i] = __float2bfloat16_rn(x0 * c - x1 * sn);
    head[i + half] = __float2bfloat16_rn(x1 * c + x0 * sn);
  }
}

// The same with 8 pairs of up to kRopeHeads heads per thread (D / 2 % 8 == 0, 16-byte aligned):
// the 8 angles' sines and cosines computed once for the thread's heads, 16-byte loads and stores of
// both halves of each head. Consecutive threads take consecutive 8-pair chunks of a head.
constexpr int kRopeHeads = 8;
// rope_kernel8's threads: one per position, 8-pair chunk and group of up to kRopeHeads heads.
__host__ __device__ std::int64_t rope8_work(std::int64_t positions, int D, int rotated) {
  return positions * (D / 16) * ((rotated + kRopeHeads - 1) / kRopeHeads);
}
__global__ __launch_bounds__(kThreads) void rope_kernel8(bf16* x, std::int64_t positions, int T, int heads,
                                                         int rotated, int D, float theta, ops::RopeScaling scaling,
                                                         std::int64_t pos_offset, float sign) {
  const int half = D / 2, chunks = half / 8, groups = (rotated + kRopeHeads - 1) / kRopeHeads;
  const std::int64_t work = rope8_work(positions, D, rotated);
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; idx < work;
       idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int i0 = static_cast<int>(idx % chunks) * 8;
    const std::int64_t pg = idx / chunks;
    const int h0 = static_cast<int>(pg % groups) * kRopeHeads;
    const std::int64_t p = pg / groups;
    const float pos = static_cast<float>(pos_offset + p % T);
    float c[8], sn[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      sincosf(pos * ops::rope_inv_freq(i0 + k, D, theta, scaling), &sn[k], &c[k]);
      sn[k] *= sign;
    }
    const int h_end = min(rotated, h0 + kRopeHeads);
    for (int h = h0; h < h_end; ++h) {
      bf16* head = x + (p * heads + h) * D;
      float a[8], b[8];
      load8(head + i0, a);
      load8(head + i0 + half, b);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float x0 = a[k], x1 = b[k];
        a[k] = x0 * c[k] - x1 * sn[k];
        b[k] = x1 * c[k] + x0 * sn[k];
      }
      store8(head + i0, a);
      store8(head + i0 + half, b);
    }
  }
}

// SwiGLU with 8 channels per thread (F % 8 == 0, 16-byte aligned rows): one 16-byte load of the
// gate's and of the up projection's channels, one store.
__global__ __launch_bounds__(kThreads) void swiglu_fwd8(bf16* out, const bf16* x, std::int64_t N, int F) {
  const int chunks = F / 8;
  const std::int64_t work = N * chunks;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; idx < work;
       idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t n = idx / chunks;
    const int f = static_cast<int>(idx % chunks) * 8;
    float g[8], u[8], o[8];
    load8(x + n * 2 * F + f, g);
    load8(x + n * 2 * F + F + f, u);
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = ops::swiglu(g[k], u[k]);
    store8(out + n * F + f, o);
  }
}

__global__ __launch_bounds__(kThreads) void swiglu_bwd8(bf16* dx, const bf16* dout, const bf16* x, std::int64_t N,
                                                        int F) {
  const int chunks = F / 8;
  const std::int64_t work = N * chunks;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; idx < work;
       idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t n = idx / chunks;
    const int f = static_cast<int>(idx % chunks) * 8;
    float g[8], u[8], go[8], dg[8], du[8];
    load8(x + n * 2 * F + f, g);
    load8(x + n * 2 * F + F + f, u);
    load8(dout + n * F + f, go);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      dg[k] = ops::dswiglu_gate(go[k], g[k], u[k]);
      du[k] = ops::dswiglu_up(go[k], g[k]);
    }
    store8(dx + n * 2 * F + f, dg);
    store8(dx + n * 2 * F + F + f, du);
  }
}

__global__ __launch_bounds__(kThreads) void swiglu_fwd(bf16* out, const bf16* x, std::int64_t N, int F) {
  const std::int64_t work = N * F;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; idx < work;
       idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t n = idx / F, f = idx % F;
    const float g = __bfloat162float(x[n * 2 * F + f]), u = __bfloat162float(x[n * 2 * F + F + f]);
    out[idx] = __float2bfloat16_rn(ops::swiglu(g, u));
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
    dx[n * 2 * F + f] = __float2bfloat16_rn(ops::dswiglu_gate(go, g, u));
    dx[n * 2 * F + F + f] = __float2bfloat16_rn(ops::dswiglu_up(go, g));
  }
}

}  // namespace

void rope(bf16* x, int B, int T, int heads, int rotated, int D, float theta, const ops::RopeScaling& scaling,
          std::int64_t pos_offset, bool inverse, cudaStream_t s) {
  const std::int64_t positions = static_cast<std::int64_t>(B) * T, work = positions * (D / 2) * rotated;
  if (work == 0) return;
  const float sign = inverse ? -1.0f : 1.0f;
  if ((D / 2) % 8 == 0 && aligned16(x))
    rope_kernel8<<<grid_for(rope8_work(positions, D, rotated), kThreads), kThreads, 0, s>>>(
        x, positions, T, heads, rotated, D, theta, scaling, pos_offset, sign);
  else
    rope_kernel<<<grid_for(work, kThreads), kThreads, 0, s>>>(x, positions, T, heads, rotated, D, theta, scaling,
                                                               pos_offset, sign);
  KILN_CUDA_LAUNCH_CHECK();
}

void swiglu_forward(bf16* out, const bf16* x, std::int64_t N, int F, cudaStream_t s) {
  if (N * F == 0) return;
  if (F % 8 == 0 && aligned16(out) && aligned16(x))
    swiglu_fwd8<<<grid_for(N * F / 8, kThreads), kThreads, 0, s>>>(out, x, N, F);
  else
    swiglu_fwd<<<grid_for(N * F, kThreads), kThreads, 0, s>>>(out, x, N, F);
  KILN_CUDA_LAUNCH_CHECK();
}

void swiglu_backward(bf16* dx, const bf16* dout, const bf16* x, std::int64_t N, int F, cudaStream_t s) {
  if (N * F == 0) return;
  if (F % 8 == 0 && aligned16(dx) && aligned16(dout) && aligned16(x))
    swiglu_bwd8<<<grid_for(N * F / 8, kThreads), kThreads, 0, s>>>(dx, dout, x, N, F);
  else
    swiglu_bwd<<<grid_for(N * F, kThreads), kThreads, 0, s>>>(dx, dout, x, N, F);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda
