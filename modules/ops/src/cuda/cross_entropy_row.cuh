#pragma once
// The row kernels of the softmax cross-entropy fused with its backward, one block per row. Pass 1
// keeps an online (max, sum of exp) over the first vocab_real logits; pass 2 overwrites the row
// with (softmax - onehot) * dloss in bf16 and zeros in the padding. cross_entropy.cu runs the
// streaming kernel (or the element-wise one); bench/cross_entropy_variants.cu compares it with the
// variants production does not run.
#include "common.cuh"
#include "online_softmax.cuh"

namespace kiln::cuda::ce {

__device__ __forceinline__ float grad(float x, int idx, int Vr, int t, float lse_l2, float dloss) {
  if (idx >= Vr) return 0.0f;
  const float prob = exp2f(fmaf(x, kLog2e, -lse_l2));
  return (prob - (idx == t ? 1.0f : 0.0f)) * dloss;
}

// Rows of ignored targets: loss 0, gradient 0, the logits are not read.
template <bool VEC>
__device__ void zero_row(float* losses, bf16* lr, std::int64_t row, int V) {
  if constexpr (VEC) {
    for (int q = threadIdx.x; q < V / 8; q += blockDim.x) store16(lr + q * 8, make_uint4(0, 0, 0, 0));
  } else {
    for (int v = threadIdx.x; v < V; v += blockDim.x) lr[v] = __float2bfloat16_rn(0.0f);
  }
  if (threadIdx.x == 0) losses[row] = 0;
}

// V % 8 == 0, any length: the row is read twice (the second read mostly from L2). Small blocks, so
// several rows are in flight per SM. Production runs it with 256 threads.
template <int THREADS>
__global__ __launch_bounds__(THREADS) void ce_stream(float* losses, bf16* logits, const std::int32_t* targets, int V,
                                                     int Vr, float dloss) {
  __shared__ Online sm[THREADS / kWarp];
  const std::int64_t row = blockIdx.x;
  bf16* lr = logits + row * V;
  const int t = targets[row];
  if (t < 0) return zero_row<true>(losses, lr, row, V);
  const int chunks = V / 8;
  const float xt = threadIdx.x == 0 ? __bfloat162float(lr[t]) : 0.0f;
  Online o;
#pragma unroll 4
  for (int q = threadIdx.x; q < chunks; q += blockDim.x) {
    float f[8];
    load8(lr + q * 8, f);
    add_chunk(o, f, q * 8, Vr);
  }
  o = block_combine(o, sm);
  const float lse = o.m + logf(o.s);
  if (threadIdx.x == 0) losses[row] = lse - xt;
  const float lse_l2 = lse * kLog2e;
#pragma unroll 4
  for (int q = threadIdx.x; q < chunks; q += blockDim.x) {
    float f[8];
    load8(lr + q * 8, f);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = grad(f[k], q * 8 + k, Vr, t, lse_l2, dloss);
    store8(lr + q * 8, f);
  }
}

// Any V (e.g. odd sizes): element by element.
constexpr int kScalarThreads = 256;
__global__ __launch_bounds__(kScalarThreads) void ce_scalar(float* losses, bf16* logits, const std::int32_t* targets,
                                                            int V, int Vr, float dloss) {
  __shared__ Online sm[kScalarThreads / kWarp];
  const std::int64_t row = blockIdx.x;
  bf16* lr = logits + row * V;
  const int t = targets[row];
  if (t < 0) return zero_row<false>(losses, lr, row, V);
  const float xt = threadIdx.x == 0 ? __bfloat162float(lr[t]) : 0.0f;
  Online o;
  for (int v = threadIdx.x; v < Vr; v += blockDim.x) combine(o, Online{__bfloat162float(lr[v]), 1.0f});
  o = block_combine(o, sm);
  const float lse = o.m + logf(o.s);
  if (threadIdx.x == 0) losses[row] = lse - xt;
  const float lse_l2 = lse * kLog2e;
  for (int v = threadIdx.x; v < V; v += blockDim.x)
    lr[v] = __float2bfloat16_rn(grad(__bfloat162float(lr[v]), v, Vr, t, lse_l2, dloss));
}

}  // namespace kiln::cuda::ce
