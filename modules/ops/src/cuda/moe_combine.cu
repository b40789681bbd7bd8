// Each token's output from its experts' rows weighted by its gates, and the backward: dy row by
// row (one warp per choice, which also takes its gate's gradient as a dot product reduced in a fixed
// order), then zeros for the rows no choice maps to. Products and sums are explicitly rounded f32
// in the CPU's order where the CPU sums sequentially (combine, dy), so those match it bit for bit.
#include "common.cuh"
#include "kiln/ops/cuda/moe.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

constexpr int kLanes = 32, kRows = 8;  // blocks of (32 chunk lanes, 8 rows), chunks of 8 channels
constexpr int kThreads = 256;

// out[t] = sum over j of gates[t, j] * y[row_of[t, j]], in j order (dropped choices add nothing).
template <bool VEC>
__global__ void combine_kernel(bf16* out, const bf16* y, const float* gates, const std::int32_t* row_of, int N, int k,
                               int C, std::int64_t R) {
  const int chunks = (C + 7) / 8;
  for (int t = blockIdx.x * kRows + threadIdx.y; t < N; t += gridDim.x * kRows) {
    const std::int64_t first = static_cast<std::int64_t>(t) * k;
    for (int j = threadIdx.x; j < chunks; j += kLanes) {
      const int c = j * 8, valid = C - c;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int q = 0; q < k; ++q) {
        const std::int32_t r = row_of[first + q];
        if (r < 0 || r >= R) continue;
        const float g = gates[first + q];
        float v[8];
        load_chunk<VEC>(y + static_cast<std::int64_t>(r) * C + c, valid, v);
#pragma unroll
        for (int m = 0; m < 8; ++m) acc[m] = __fadd_rn(acc[m], __fmul_rn(g, v[m]));
      }
      store_chunk<VEC>(out + static_cast<std::int64_t>(t) * C + c, valid, acc);
    }
  }
}

// One warp per choice i = (t, j): dy[row] = gates[i] * dout[t], dgates[i] = dout[t] . y[row]
// (lane partial sums, then the butterfly: a fixed order), mark[row] = 1. Dropped: dgates[i] = 0.
template <bool VEC>
__global__ __launch_bounds__(kThreads) void combine_backward_kernel(bf16* dy, float* dgates, unsigned char* mark,
                                                                    const bf16* dout, const bf16* y,
                                                                    const float* gates, const std::int32_t* row_of,
                                                                    std::int64_t NK, int k, int C) {
  const int lane = threadIdx.x % kWarp, chunks = (C + 7) / 8;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; i < NK;
       i += warps) {
    const std::int32_t r = row_of[i];
    if (r < 0 || r >= NK) {
      if (lane == 0) dgates[i] = 0.0f;
      continue;
    }
    const float g = gates[i];
    const bf16* d = dout + (i / k) * C;
    const bf16* yr = y + static_cast<std::int64_t>(r) * C;
    bf16* o = dy + static_cast<std::int64_t>(r) * C;
    float dot = 0;
    for (int j = lane; j < chunks; j += kWarp) {
      const int c = j * 8, valid = C - c;
      float dv[8], yv[8], ov[8];
      load_chunk<VEC>(d + c, valid, dv);
      load_chunk<VEC>(yr + c, valid, yv);
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        ov[m] = __fmul_rn(g, dv[m]);
        dot += dv[m] * yv[m];
      }
      store_chunk<VEC>(o + c, valid, ov);
    }
    dot = warp_sum(dot);
    if (lane == 0) {
      dgates[i] = dot;
      mark[r] = 1;
    }
  }
}

// Zeros for the rows of dy that no choice maps to.
template <bool VEC>
__global__ void zero_unmapped_kernel(bf16* dy, const unsigned char* mark, std::int64_t R, int C) {
  const int chunks = (C + 7) / 8;
  const float zeros[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(kRows) + threadIdx.y; r < R;
       r += static_cast<std::int64_t>(gridDim.x) * kRows) {
    if (mark[r]) continue;
    for (int j = threadIdx.x; j < chunks; j += kLanes) store_chunk<VEC>(dy + r * C + j * 8, C - j * 8, zeros);
  }
}

}  // namespace

void moe_combine(bf16* out, const bf16* y, const float* gates, const std::int32_t* row_of, int N, int k, int C,
                 cudaStream_t s) {
  if (static_cast<std::int64_t>(N) * C == 0) return;
  const std::int64_t R = static_cast<std::int64_t>(N) * k;
  const dim3 block(kLanes, kRows);
  const unsigned blocks = grid_for(N, kRows);
  if (C % 8 == 0 && aligned16(out) && aligned16(y))
    combine_kernel<true><<<blocks, block, 0, s>>>(out, y, gates, row_of, N, k, C, R);
  else
    combine_kernel<false><<<blocks, block, 0, s>>>(out, y, gates, row_of, N, k, C, R);
  KILN_CUDA_LAUNCH_CHECK();
}

std::int64_t moe_combine_backward_scratch(int N, int k) { return ceil_div(static_cast<std::int64_t>(N) * k, 4); }

void moe_combine_backward(bf16* dy, float* dgates, float* scratch, const bf16* dout, const bf16* y,
                          const float* gates, const std::int32_t* row_of, int N, int k, int C, cudaStream_t s) {
  const std::int64_t NK = static_cast<std::int64_t>(N) * k;
  if (NK == 0) return;
  auto* mark = reinterpret_cast<unsigned char*>(scratch);
  KILN_CUDA_CHECK(cudaMemsetAsync(mark, 0, static_cast<std::size_t>(NK), s));
  const bool vec = C % 8 == 0 && aligned16(dy) && aligned16(dout) && aligned16(y);
  const unsigned warp_blocks = grid_for(NK, kThreads / kWarp);
  if (vec)
    combine_backward_kernel<true><<<warp_blocks, kThreads, 0, s>>>(dy, dgates, mark, dout, y, gates, row_of, NK, k, C);
  else
    combine_backward_kernel<false><<<warp_blocks, kThreads, 0, s>>>(dy, dgates, mark, dout, y, gates, row_of, NK, k,
                                                                    C);
  KILN_CUDA_LAUNCH_CHECK();
  if (C == 0) return;
  const dim3 block(kLanes, kRows);
  const unsigned row_blocks = grid_for(NK, kRows);
  if (vec)
    zero_unmapped_kernel<true><<<row_blocks, block, 0, s>>>(dy, mark, NK, C);
  else
    zero_unmapped_kernel<false><<<row_blocks, block, 0, s>>>(dy, mark, NK, C);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda
