// Vocabulary-parallel cross-entropy: per-rank row statistics, then (after the caller's all-gather
// of them) the loss and the gradient from every rank's statistics. One block per row.
#include "common.cuh"
#include "kiln/ops/formulas.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "online_softmax.cuh"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;

// stats[row] = {max, sum exp(x - max) over this rank's real columns [0, Vr), target logit or 0}. VEC
// (V % 8 == 0, rows 16-byte aligned): eight columns a load, each chunk's max first (add_chunk, the
// fused loss's first pass over a row); else a column at a time.
template <bool VEC>
__global__ __launch_bounds__(kThreads) void ce_stats_kernel(float* stats, const bf16* logits,
                                                            const std::int32_t* targets, int V, int Vr,
                                                            std::int64_t begin) {
  __shared__ Online sm[kThreads / kWarp];
  const std::int64_t row = blockIdx.x;
  const bf16* lr = logits + row * V;
  Online o;
  if constexpr (VEC) {
#pragma unroll 4
    for (int q = threadIdx.x; q < V / 8; q += blockDim.x) {
      float f[8];
      load8(lr + q * 8, f);
      add_chunk(o, f, q * 8, Vr);
    }
  } else {
    for (int v = threadIdx.x; v < Vr; v += blockDim.x) {
      const float x = __bfloat162float(lr[v]);
      if (x > o.m) {
        o.s = o.s * exp2f((o.m - x) * kLog2e) + 1.0f;
        o.m = x;
      } else {
        o.s += exp2f((x - o.m) * kLog2e);
      }
    }
  }
  const Online r = block_combine(o, sm);
  if (threadIdx.x == 0) {
    const std::int64_t t = static_cast<std::int64_t>(targets[row]) - begin;
    stats[row * 3 + 0] = r.m;
    stats[row * 3 + 1] = r.s;
    stats[row * 3 + 2] = targets[row] >= 0 && t >= 0 && t < Vr ? __bfloat162float(lr[t]) : 0.0f;
  }
}

// Combines the R ranks' statistics in rank order (the CPU's order), then writes the loss and the
// row's gradient (softmax - onehot) * dloss, zeros in the padded columns.
__global__ __launch_bounds__(kThreads) void ce_finish_kernel(float* losses, float* lse_out, bf16* logits,
                                                             const std::int32_t* targets, const float* all, int R,
                                                             int N, int V, int Vr, std::int64_t begin, float dloss,
                                                             bool write_dlogits) {
  __shared__ float lse_row;
  const std::int64_t row = blockIdx.x;
  bf16* lr = logits + row * V;
  const int t = targets[row];
  if (t < 0) {
    if (write_dlogits)
      for (int v = threadIdx.x; v < V; v += blockDim.x) lr[v] = __float2bfloat16_rn(0.0f);
    if (threadIdx.x == 0) {
      losses[row] = 0;
      if (lse_out) lse_out[row] = 0;
    }
    return;
  }
  if (threadIdx.x == 0) {
    float mx = -INFINITY, sum = 0, target = 0;
    for (int r = 0; r < R; ++r) mx = fmaxf(mx, all[(static_cast<std::int64_t>(r) * N + row) * 3]);
    for (int r = 0; r < R; ++r) {
      const float* s = all + (static_cast<std::int64_t>(r) * N + row) * 3;
      if (s[1] > 0) sum += s[1] * expf(s[0] - mx);
      target += s[2];
    }
    const float lse = mx + logf(sum);
    losses[row] = lse - target;
    if (lse_out) lse_out[row] = lse;
    lse_row = lse;
  }
  if (!write_dlogits) return;
  __syncthreads();
  const std::int64_t tl = static_cast<std::int64_t>(t) - begin;
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    const float g = v < Vr ? ops::xent_grad(__bfloat162float(lr[v]), lse_row, v == tl, dloss) : 0.0f;
    lr[v] = __float2bfloat16_rn(g);
  }
}

int real_columns(int V, int vocab_real, std::int64_t begin) {
  const std::int64_t r = vocab_real - begin;
  return static_cast<int>(r < 0 ? 0 : (r > V ? V : r));
}

}  // namespace

void cross_entropy_stats(float* stats, const bf16* logits, const std::int32_t* targets, int N, int V, int vocab_real,
                         std::int64_t begin, cudaStream_t s) {
  if (N <= 0) return;
  const int Vr = real_columns(V, vocab_real, begin);
  if (V % 8 == 0 && aligned16(logits))
    ce_stats_kernel<true><<<N, kThreads, 0, s>>>(stats, logits, targets, V, Vr, begin);
  else
    ce_stats_kernel<false><<<N, kThreads, 0, s>>>(stats, logits, targets, V, Vr, begin);
  KILN_CUDA_LAUNCH_CHECK();
}

void cross_entropy_finish(float* losses, float* lse, bf16* logits, const std::int32_t* targets, const float* all_stats,
                          int R, int N, int V, int vocab_real, std::int64_t begin, float dloss, bool write_dlogits,
                          cudaStream_t s) {
  if (N <= 0) return;
  ce_finish_kernel<<<N, kThreads, 0, s>>>(losses, lse, logits, targets, all_stats, R, N, V,
                                          real_columns(V, vocab_real, begin), begin, dloss, write_dlogits);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda
