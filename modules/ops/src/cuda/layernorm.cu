// LayerNorm forward (a warp per row, fp32 statistics) and backward, which RMSNorm's backward shares
// (dx accumulated into bf16;
// dweight/dbias by a deterministic two-stage reduction: per-block partials, then a fixed-order sum).
#include "common.cuh"
#include "kiln/ops/cuda/layernorm_row.cuh"
#include "kiln/ops/formulas.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

constexpr int kFwdThreads = 256;  // 8 rows (warps) per block

// Fast path, C % 8 == 0 and C <= 256 * CPL: the row is held in registers as packed bf16 (CPL
// 16-byte chunks per lane), so x is read from memory once; the statistics are
// layernorm_row::stats_vec (two passes over the registers, like the CPU's two loops).
template <int CPL>
__global__ __launch_bounds__(kFwdThreads) void ln_forward_vec(bf16* out, float* mean, float* rstd, const bf16* x,
                                                             const bf16* weight, const bf16* bias, int N, int C,
                                                             float eps) {
  const int lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  const int chunks = C / 8;
  for (int row = blockIdx.x * warps + threadIdx.x / kWarp; row < N; row += gridDim.x * warps) {
    const bf16* xr = x + static_cast<std::int64_t>(row) * C;
    uint4 cache[CPL];
    layernorm_row::load_row(xr, C, lane, cache);
    float m = 0, s = 0;
    layernorm_row::stats_vec(cache, C, lane, eps, m, s);
    bf16* o = out + static_cast<std::int64_t>(row) * C;
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
      const int q = lane + j * kWarp;
      if (q >= chunks) continue;
      float f[8], w[8], b[8];
      unpack8(cache[j], f);
      load8(weight + q * 8, w);
      load8(bias + q * 8, b);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = ops::layernorm_apply(f[k], m, s, w[k], b[k]);
      store8(o + q * 8, f);
    }
    if (lane == 0) {
      mean[row] = m;
      rstd[row] = s;
    }
  }
}

// Any C: a warp per row, three passes over the row (the later ones hit L1/L2).
__global__ __launch_bounds__(kFwdThreads) void ln_forward_any(bf16* out, float* mean, float* rstd, const bf16* x,
                                                             const bf16* weight, const bf16* bias, int N, int C,
                                                             float eps) {
  const int lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  for (int row = blockIdx.x * warps + threadIdx.x / kWarp; row < N; row += gridDim.x * warps) {
    const bf16* xr = x + static_cast<std::int64_t>(row) * C;
    float m = 0, s = 0;
    layernorm_row::stats_any(xr, C, lane, eps, m, s);
    bf16* o = out + static_cast<std::int64_t>(row) * C;
    for (int c = lane; c < C; c += kWarp)
      o[c] = __float2bfloat16_rn(
          ops::layernorm_apply(__bfloat162float(xr[c]), m, s, __bfloat162float(weight[c]), __bfloat162float(bias[c])));
    if (lane == 0) {
      mean[row] = m;
      rstd[row] = s;
    }
  }
}

// ---- backward ----
// Block b owns rows [b * rows_per_block, ...): a function of N only, so the partial sums (and so
// the result bits) do not depend on the GPU. The block reduces kRowsAtOnce rows per iteration.
constexpr int kMaxBlocks = 512;
constexpr int kRowsAtOnce = 4;
constexpr int kMaxVecChunks = 512;  // fast path: one 8-channel chunk per thread, C <= 4096

int rows_per_block(int N) {
  const int rpb = static_cast<int>(ceil_div(std::max(N, 1), kMaxBlocks));
  return static_cast<int>(ceil_div(rpb, kRowsAtOnce) * kRowsAtOnce);
}
int backward_blocks(int N) { return static_cast<int>(ceil_div(std::max(N, 1), rows_per_block(N))); }

// Sums `vals` (NV per thread) over the block in a fixed order: butterfly within each warp, then
// warp 0, 1, ... in order. `red` is double-buffered by the caller so one barrier per use suffices.
template <int NV>
__device__ __forceinline__ void block_sum(float (&vals)[NV], float* red) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
#pragma unroll
  for (int i = 0; i < NV; ++i) vals[i] = warp_sum(vals[i]);
  if (lane == 0)
#pragma unroll
    for (int i = 0; i < NV; ++i) red[warp * NV + i] = vals[i];
  __syncthreads();
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    float t = 0;
    for (int w = 0; w < warps; ++w) t += red[w * NV + i];
    vals[i] = t;
  }
}

// Fast path: thread t owns channels [8t, 8t + 8) (C % 8 == 0, C / 8 <= blockDim.x), keeps its
// dweight/dbias partial sums in registers and writes them to partials[block][0:C | C:2C].
// kRms: RMSNorm's backward (no mean, no bias: xhat = x * rstd, dx = rstd (w g - xhat mean(w g xhat))).
template <bool kRms>
__global__ __launch_bounds__(kMaxVecChunks) void ln_backward_vec(bf16* dx, float* partials, const bf16* dout,
                                                                  const bf16* x, const bf16* weight, const float* mean,
                                                                  const float* rstd, int N, int C, int rpb) {
  __shared__ float red[2][kMaxVecChunks / kWarp * 2 * kRowsAtOnce];
  const int c = threadIdx.x * 8;
  const bool active = c < C;
  float w[8], dw[8] = {}, db[8] = {};
  if (active) load8(weight + c, w);
  const int r0 = blockIdx.x * rpb, r1 = min(N, r0 + rpb);
  int buf = 0;
  for (int r = r0; r < r1; r += kRowsAtOnce, buf ^= 1) {
    // Issue every load of the kRowsAtOnce rows first.
    uint4 xv[kRowsAtOnce], gv[kRowsAtOnce], dv[kRowsAtOnce];
    float mu[kRowsAtOnce], rs[kRowsAtOnce];
#pragma unroll
    for (int i = 0; i < kRowsAtOnce; ++i) {
      const bool ok = active && r + i < r1;
      const std::int64_t off = static_cast<std::int64_t>(r + i) * C + c;
      xv[i] = ok ? load16(x + off) : make_uint4(0, 0, 0, 0);
      gv[i] = ok ? load16(dout + off) : make_uint4(0, 0, 0, 0);
      dv[i] = ok ? load16(dx + off) : make_uint4(0, 0, 0, 0);
      mu[i] = !kRms && r + i < r1 ? mean[r + i] : 0.0f;
      rs[i] = r + i < r1 ? rstd[r + i] : 0.0f;
    }
    float sums[2 * kRowsAtOnce];  // per row: sum(dnorm), sum(dnorm * xhat)
#pragma unroll
    for (int i = 0; i < kRowsAtOnce; ++i) {
      float xf[8], g[8];
      unpack8(xv[i], xf);
      unpack8(gv[i], g);
      float s1 = 0, s2 = 0;
      const bool ok = active && r + i < r1;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float xhat = (xf[k] - mu[i]) * rs[i];
        const float dn = w[k] * g[k];
        s1 += dn;
        s2 += dn * xhat;
        if (ok) {
          dw[k] += g[k] * xhat;
          db[k] += g[k];
        }
      }
      sums[2 * i] = ok ? s1 : 0.0f;
      sums[2 * i + 1] = ok ? s2 : 0.0f;
    }
    block_sum(sums, red[buf]);
#pragma unroll
    for (int i = 0; i < kRowsAtOnce; ++i) {
      if (!active || r + i >= r1) continue;
      const float dn_mean = kRms ? 0.0f : sums[2 * i] / static_cast<float>(C),
                  dnx_mean = sums[2 * i + 1] / static_cast<float>(C);
      float xf[8], g[8], d[8];
      unpack8(xv[i], xf);
      unpack8(gv[i], g);
      unpack8(dv[i], d);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float xhat = (xf[k] - mu[i]) * rs[i];
        d[k] += (w[k] * g[k] - dn_mean - xhat * dnx_mean) * rs[i];
      }
      store8(dx + static_cast<std::int64_t>(r + i) * C + c, d);
    }
  }
  if (active) {
    float* p = partials + static_cast<std::int64_t>(blockIdx.x) * 2 * C;
    store8(p + c, dw);
    if (!kRms) store8(p + C + c, db);
  }
}

// Any C: threads stride over channels; the dweight/dbias partials accumulate in the block's own
// row of `partials` (each channel owned by one thread, so no races and a fixed order).
constexpr int kAnyThreads = 256;
template <bool kRms>
__global__ __launch_bounds__(kAnyThreads) void ln_backward_any(bf16* dx, float* partials, const bf16* dout,
                                                              const bf16* x, const bf16* weight, const float* mean,
                                                              const float* rstd, int N, int C, int rpb) {
  __shared__ float red[2][kAnyThreads / kWarp * 2];
  float* pw = partials + static_cast<std::int64_t>(blockIdx.x) * 2 * C;
  float* pb = pw + C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) pw[c] = pb[c] = 0.0f;
  const int r0 = blockIdx.x * rpb, r1 = min(N, r0 + rpb);
  int buf = 0;
  for (int r = r0; r < r1; ++r, buf ^= 1) {
    const std::int64_t off = static_cast<std::int64_t>(r) * C;
    const float mu = kRms ? 0.0f : mean[r], rs = rstd[r];
    float sums[2] = {0, 0};
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float g = __bfloat162float(dout[off + c]);
      const float xhat = (__bfloat162float(x[off + c]) - mu) * rs;
      const float dn = __bfloat162float(weight[c]) * g;
      sums[0] += dn;
      sums[1] += dn * xhat;
      pw[c] += g * xhat;
      pb[c] += g;
    }
    block_sum(sums, red[buf]);
    const float dn_mean = kRms ? 0.0f : sums[0] / static_cast<float>(C), dnx_mean = sums[1] / static_cast<float>(C);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float g = __bfloat162float(dout[off + c]);
      const float xhat = (__bfloat162float(x[off + c]) - mu) * rs;
      const float d = (__bfloat162float(weight[c]) * g - dn_mean - xhat * dnx_mean) * rs;
      dx[off + c] = __float2bfloat16_rn(__bfloat162float(dx[off + c]) + d);
    }
  }
}

template <int CPL>
void launch_forward(bf16* out, float* mean, float* rstd, const bf16* x, const bf16* w, const bf16* b, int N, int C,
                    float eps, cudaStream_t s) {
  ln_forward_vec<CPL><<<grid_for(N, kFwdThreads / kWarp, 1 << 20), kFwdThreads, 0, s>>>(out, mean, rstd, x, w, b, N,
                                                                                         C, eps);
}

}  // namespace

void layernorm_forward(bf16* out, float* mean, float* rstd, const bf16* x, const bf16* weight, const bf16* bias, int N,
                       int C, float eps, cudaStream_t s) {
  if (N <= 0 || C <= 0) return;
  const bool vec = C % 8 == 0 && aligned16(out) && aligned16(x) && aligned16(weight) && aligned16(bias);
  const int cpl = static_cast<int>(ceil_div(C / 8, kWarp));  // 16-byte chunks per lane
  if (!vec || cpl > 16) {
    ln_forward_any<<<grid_for(N, kFwdThreads / kWarp, 1 << 20), kFwdThreads, 0, s>>>(out, mean, rstd, x, weight, bias,
                                                                                     N, C, eps);
  } else if (cpl <= 1) {
    launch_forward<1>(out, mean, rstd, x, weight, bias, N, C, eps, s);
  } else if (cpl <= 2) {
    launch_forward<2>(out, mean, rstd, x, weight, bias, N, C, eps, s);
  } else if (cpl <= 3) {
    launch_forward<3>(out, mean, rstd, x, weight, bias, N, C, eps, s);
  } else if (cpl <= 4) {
    launch_forward<4>(out, mean, rstd, x, weight, bias, N, C, eps, s);
  } else if (cpl <= 6) {
    launch_forward<6>(out, mean, rstd, x, weight, bias, N, C, eps, s);
  } else if (cpl <= 8) {
    launch_forward<8>(out, mean, rstd, x, weight, bias, N, C, eps, s);
  } else if (cpl <= 12) {
    launch_forward<12>(out, mean, rstd, x, weight, bias, N, C, eps, s);
  } else {
    launch_forward<16>(out, mean, rstd, x, weight, bias, N, C, eps, s);
  }
  KILN_CUDA_LAUNCH_CHECK();
}

std::int64_t layernorm_backward_scratch(int N, int C) {
  return static_cast<std::int64_t>(backward_blocks(N)) * 2 * std::max(C, 1);
}

namespace {
// G: the gradients' type, float or bf16 (only the final store differs: reduce_partials).
template <bool kRms, class G>
void norm_backward(bf16* dx, G* dweight, G* dbias, float* scratch, const bf16* dout, const bf16* x,
                   const bf16* weight, const float* mean, const float* rstd, int N, int C, cudaStream_t s) {
  if (N <= 0 || C <= 0) return;
  const int rpb = rows_per_block(N), blocks = backward_blocks(N);
  const int chunks = C / 8;
  const bool vec = C % 8 == 0 && chunks <= kMaxVecChunks && aligned16(dx) && aligned16(scratch) && aligned16(dout) &&
                   aligned16(x) && aligned16(weight);
  if (vec) {
    const int threads = static_cast<int>(ceil_div(chunks, kWarp) * kWarp);
    ln_backward_vec<kRms><<<blocks, threads, 0, s>>>(dx, scratch, dout, x, weight, mean, rstd, N, C, rpb);
  } else {
    ln_backward_any<kRms><<<blocks, kAnyThreads, 0, s>>>(dx, scratch, dout, x, weight, mean, rstd, N, C, rpb);
  }
  KILN_CUDA_LAUNCH_CHECK();
  // The weight's and the bias's gradients (columns C.. of the partials) in one launch.
  reduce_partials(dweight, scratch, blocks, C, 2 * C, s, kRms ? nullptr : dbias, kRms ? 0 : C);
}
}  // namespace

void layernorm_backward(bf16* dx, float* dweight, float* dbias, float* scratch, const bf16* dout, const bf16* x,
                        const bf16* weight, const float* mean, const float* rstd, int N, int C, cudaStream_t s) {
  norm_backward<false>(dx, dweight, dbias, scratch, dout, x, weight, mean, rstd, N, C, s);
}

void layernorm_backward(bf16* dx, bf16* dweight, bf16* dbias, float* scratch, const bf16* dout, const bf16* x,
                        const bf16* weight, const float* mean, const float* rstd, int N, int C, cudaStream_t s) {
  norm_backward<false>(dx, dweight, dbias, scratch, dout, x, weight, mean, rstd, N, C, s);
}

// RMSNorm's backward shares LayerNorm's kernels (no mean, no bias); its scratch is LayerNorm's.
std::int64_t rmsnorm_backward_scratch(int N, int C) { return layernorm_backward_scratch(N, C); }

void rmsnorm_backward(bf16* dx, float* dweight, float* scratch, const bf16* dout, const bf16* x, const bf16* weight,
                      const float* rstd, int N, int C, cudaStream_t s) {
  norm_backward<true, float>(dx, dweight, nullptr, scratch, dout, x, weight, nullptr, rstd, N, C, s);
}

void rmsnorm_backward(bf16* dx, bf16* dweight, float* scratch, const bf16* dout, const bf16* x, const bf16* weight,
                      const float* rstd, int N, int C, cudaStream_t s) {
  norm_backward<true, bf16>(dx, dweight, nullptr, scratch, dout, x, weight, nullptr, rstd, N, C, s);
}

}  // namespace kiln::cuda
