// dbias[o] += sum_n dout[n, o] by a deterministic two-stage reduction, and that second stage
// (reduce_partials), shared with layernorm_backward.
#include "common.cuh"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

// Stage 1: blocks of (32 column chunks of 8, 8 row groups) over a fixed range of rows. Row group g
// sums rows g, g + 8, ... of the range in order, then a fixed tree over the 8 groups gives the
// block's partial. The row ranges depend on N only.
constexpr int kLanes = 32, kGroups = 8;
constexpr int kMaxRowBlocks = 128, kMinRows = 32;

int rows_per_block(int N) {
  const std::int64_t r = std::max<std::int64_t>(kMinRows, ceil_div(std::max(N, 1), kMaxRowBlocks));
  return static_cast<int>(ceil_div(r, kGroups) * kGroups);
}
int row_blocks(int N) { return static_cast<int>(ceil_div(std::max(N, 1), rows_per_block(N))); }

template <bool VEC>
__global__ __launch_bounds__(kLanes* kGroups) void bias_grad_partials(float* partials, const bf16* dout, int N, int OC,
                                                                      int rpb) {
  __shared__ float sm[kGroups][kLanes * 8 + 4];
  const int tx = threadIdx.x, g = threadIdx.y;
  const int c = (blockIdx.x * kLanes + tx) * 8, valid = OC - c;
  const int r0 = blockIdx.y * rpb, r1 = min(N, r0 + rpb);
  float acc[8] = {};
  if (c < OC) {
    int r = r0 + g;
    // Four rows in flight per thread; the additions stay in row order.
    for (; r + 3 * kGroups < r1; r += 4 * kGroups) {
      float f[4][8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bf16* p = dout + static_cast<std::int64_t>(r + i * kGroups) * OC + c;
        if constexpr (VEC) {
          load8(p, f[i]);
        } else {
#pragma unroll
          for (int k = 0; k < 8; ++k) f[i][k] = k < valid ? __bfloat162float(p[k]) : 0.0f;
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] += f[i][k];
    }
    for (; r < r1; r += kGroups) {
      const bf16* p = dout + static_cast<std::int64_t>(r) * OC + c;
      float f[8];
      if constexpr (VEC) {
        load8(p, f);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] = k < valid ? __bfloat162float(p[k]) : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] += f[k];
    }
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) sm[g][tx * 8 + k] = acc[k];
  __syncthreads();
#pragma unroll
  for (int h = kGroups / 2; h > 0; h /= 2) {
    if (g < h)
#pragma unroll
      for (int k = 0; k < 8; ++k) sm[g][tx * 8 + k] += sm[g + h][tx * 8 + k];
    __syncthreads();
  }
  if (g == 0 && c < OC) {
    float* out = partials + static_cast<std::int64_t>(blockIdx.y) * OC + c;
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (k < valid) out[k] = sm[0][tx * 8 + k];
  }
}

// Stage 2: blocks of (8 columns, 32 groups); group g sums partials g, g + 32, ... in order, then a
// fixed tree over the groups; out[w] += the total. 8 consecutive floats fill a 32-byte sector.
constexpr int kCols = 8, kPGroups = 32;

__global__ __launch_bounds__(kCols* kPGroups) void reduce_partials_kernel(float* out, const float* partials, int P,
                                                                          int W, int ld) {
  __shared__ float sm[kPGroups][kCols];
  const int tx = threadIdx.x, g = threadIdx.y;
  const int w = blockIdx.x * kCols + tx;
  float s = 0;
  if (w < W) {
#pragma unroll 4
    for (int p = g; p < P; p += kPGroups) s += partials[static_cast<std::int64_t>(p) * ld + w];
  }
  sm[g][tx] = s;
  __syncthreads();
#pragma unroll
  for (int h = kPGroups / 2; h > 0; h /= 2) {
    if (g < h) sm[g][tx] += sm[g + h][tx];
    __syncthreads();
  }
  if (g == 0 && w < W) out[w] += sm[0][tx];
}

}  // namespace

void reduce_partials(float* out, const float* partials, int P, int W, int ld, cudaStream_t s) {
  if (W <= 0) return;
  reduce_partials_kernel<<<static_cast<unsigned>(ceil_div(W, kCols)), dim3(kCols, kPGroups), 0, s>>>(out, partials, P,
                                                                                                     W, ld);
  KILN_CUDA_LAUNCH_CHECK();
}

std::int64_t bias_grad_scratch(int N, int OC) {
  return static_cast<std::int64_t>(row_blocks(N)) * std::max(OC, 1);
}

void bias_grad(float* dbias, float* scratch, const bf16* dout, int N, int OC, cudaStream_t s) {
  if (N <= 0 || OC <= 0) return;
  const int rpb = rows_per_block(N), blocks = row_blocks(N);
  const dim3 grid(static_cast<unsigned>(ceil_div(ceil_div(OC, 8), kLanes)), static_cast<unsigned>(blocks));
  const dim3 block(kLanes, kGroups);
  if (OC % 8 == 0 && aligned16(dout))
    bias_grad_partials<true><<<grid, block, 0, s>>>(scratch, dout, N, OC, rpb);
  else
    bias_grad_partials<false><<<grid, block, 0, s>>>(scratch, dout, N, OC, rpb);
  KILN_CUDA_LAUNCH_CHECK();
  reduce_partials(dbias, scratch, blocks, OC, OC, s);
}

}  // namespace kiln::cuda
