// dbias[o] += sum_n dout[n, o] by a deterministic reduction in one launch, and reduce_partials (the
// second stage of layernorm_backward's reduction).
#include "common.cuh"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

// One launch. Blocks of (32 column chunks of 8, 8 row groups) each sum a fixed range of rows: row
// group g sums rows g, g + 8, ... of the range in order, a fixed tree over the 8 groups gives the
// block's partial. The last block of a column strip to finish (an atomic ticket) then adds the
// partials of every row range in index order: the result does not depend on which block finished
// last. Row ranges depend on N, the columns and the SM count, so a GPU model always sums the same way.
constexpr int kLanes = 32, kGroups = 8;

struct Split {
  int rows_per_block, row_blocks;
};
Split split_rows(int N, int OC, int sms) {
  const int col_blocks = static_cast<int>(ceil_div(ceil_div(std::max(OC, 1), 8), kLanes));
  // About four blocks per SM in all, each thread summing at least 8 rows.
  const std::int64_t want = std::max<std::int64_t>(1, ceil_div(4 * sms, col_blocks));
  std::int64_t rpb = std::max<std::int64_t>(8 * kGroups, ceil_div(std::max(N, 1), want));
  rpb = ceil_div(rpb, kGroups) * kGroups;
  return {static_cast<int>(rpb), static_cast<int>(ceil_div(std::max(N, 1), rpb))};
}

// G: the gradient's type, float or bf16 (the total added in f32 and stored once).
template <bool VEC, class G>
__global__ __launch_bounds__(kLanes* kGroups) void bias_grad_kernel(G* dbias, float* partials, unsigned* tickets,
                                                                    const bf16* dout, int N, int OC, int rpb,
                                                                    int row_blocks) {
  __shared__ float sm[kGroups][kLanes * 8 + 4];
  __shared__ bool last;
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
  // Publish the partial, then take a ticket; the block holding the last one finishes the strip.
  __threadfence();
  __syncthreads();
  const int tid = g * kLanes + tx;
  if (tid == 0) last = atomicAdd(&tickets[blockIdx.x], 1u) == static_cast<unsigned>(row_blocks - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int col = blockIdx.x * kLanes * 8 + tid;  // 256 threads, one column each
  if (col < OC) {
    float sum = 0;
    for (int p = 0; p < row_blocks; ++p) sum += __ldcg(partials + static_cast<std::int64_t>(p) * OC + col);
    grad_store(dbias + col, grad_load(dbias + col) + sum);
  }
  if (tid == 0) tickets[blockIdx.x] = 0;  // ready for the next call
}

// Stage 2: blocks of (8 columns, 32 groups); group g sums partials g, g + 32, ... in order, then a
// fixed tree over the groups; out[w] += the total, for columns w < W (out1[w - W] += for the next W1
// columns: LayerNorm's weight and bias gradients in one launch). 8 consecutive floats fill a 32-byte
// sector.
constexpr int kCols = 8, kPGroups = 32;

template <class G>
__global__ __launch_bounds__(kCols* kPGroups) void reduce_partials_kernel(G* out, G* out1, const float* partials, int P,
                                                                          int W, int W1, int ld) {
  __shared__ float sm[kPGroups][kCols];
  const int tx = threadIdx.x, g = threadIdx.y;
  const int w = blockIdx.x * kCols + tx;
  float s = 0;
  if (w < W + W1) {
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
  if (g == 0 && w < W) grad_store(out + w, grad_load(out + w) + sm[0][tx]);
  if (g == 0 && w >= W && w < W + W1) grad_store(out1 + (w - W), grad_load(out1 + (w - W)) + sm[0][tx]);
}

template <class G>
void launch_reduce_partials(G* out, const float* partials, int P, int W, int ld, cudaStream_t s, G* out1, int W1) {
  if (W + W1 <= 0) return;
  reduce_partials_kernel<G><<<static_cast<unsigned>(ceil_div(W + W1, kCols)), dim3(kCols, kPGroups), 0, s>>>(
      out, out1, partials, P, W, W1, ld);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace

void reduce_partials(float* out, const float* partials, int P, int W, int ld, cudaStream_t s, float* out1, int W1) {
  launch_reduce_partials(out, partials, P, W, ld, s, out1, W1);
}

void reduce_partials(bf16* out, const float* partials, int P, int W, int ld, cudaStream_t s, bf16* out1, int W1) {
  launch_reduce_partials(out, partials, P, W, ld, s, out1, W1);
}

namespace {
int sm_count() {
  int device = 0, sms = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}
}  // namespace

std::int64_t bias_grad_scratch(int N, int OC) {
  return static_cast<std::int64_t>(split_rows(N, OC, sm_count()).row_blocks) * std::max(OC, 1);
}

std::int64_t bias_grad_tickets(int OC) { return ceil_div(ceil_div(std::max(OC, 1), 8), kLanes); }

namespace {
template <class G>
void launch_bias_grad(G* dbias, float* scratch, unsigned* tickets, const bf16* dout, int N, int OC, cudaStream_t s) {
  if (N <= 0 || OC <= 0) return;
  const Split sp = split_rows(N, OC, sm_count());
  const dim3 grid(static_cast<unsigned>(bias_grad_tickets(OC)), static_cast<unsigned>(sp.row_blocks));
  const dim3 block(kLanes, kGroups);
  if (OC % 8 == 0 && aligned16(dout))
    bias_grad_kernel<true, G><<<grid, block, 0, s>>>(dbias, scratch, tickets, dout, N, OC, sp.rows_per_block,
                                                     sp.row_blocks);
  else
    bias_grad_kernel<false, G><<<grid, block, 0, s>>>(dbias, scratch, tickets, dout, N, OC, sp.rows_per_block,
                                                      sp.row_blocks);
  KILN_CUDA_LAUNCH_CHECK();
}
}  // namespace

void bias_grad(float* dbias, float* scratch, unsigned* tickets, const bf16* dout, int N, int OC, cudaStream_t s) {
  launch_bias_grad(dbias, scratch, tickets, dout, N, OC, s);
}

void bias_grad(bf16* dbias, float* scratch, unsigned* tickets, const bf16* dout, int N, int OC, cudaStream_t s) {
  launch_bias_grad(dbias, scratch, tickets, dout, N, OC, s);
}

}  // namespace kiln::cuda
