// out = residual + dropout(x), and dropout's backward. The masks are the CPU's, bit for bit:
// element (r, c) draws Philox element (row_offset + r) * cols_total + col_offset + c.
#include "common.cuh"
#include "kiln/rng/philox.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

constexpr int kLanes = 32, kRows = 8;  // blocks of (32 chunk lanes, 8 rows), chunks of 8 channels

struct Drop {
  rng::PhiloxArgs rng;
  std::int64_t row_offset, col_offset, cols_total;
  std::uint32_t threshold;
  float scale;  // 1 / (1 - p), computed on the host as the CPU does
};

Drop make_drop(const ops::DropoutArgs& d, int C) {
  return Drop{d.rng, d.row_offset, d.col_offset, d.cols_total ? d.cols_total : C, rng::dropout_threshold(d.p),
              1.0f / (1.0f - d.p)};
}

// The 32-bit words of elements e0 .. e0 + 7 of the draw: 2 Philox blocks, or 3 when e0 % 4 != 0.
// The window is picked with selects (not a dynamic index) so everything stays in registers.
__device__ __forceinline__ void words8(const Drop& d, std::uint64_t start, std::uint64_t e0, std::uint32_t u[8]) {
  const std::uint64_t blk = start + e0 / 4;
  const unsigned shift = static_cast<unsigned>(e0 % 4);
  const rng::Philox4 a = rng::philox_block(d.rng.seed, blk), b = rng::philox_block(d.rng.seed, blk + 1);
  const rng::Philox4 c = shift ? rng::philox_block(d.rng.seed, blk + 2) : b;
  const std::uint32_t w[12] = {a.v[0], a.v[1], a.v[2], a.v[3], b.v[0], b.v[1],
                               b.v[2], b.v[3], c.v[0], c.v[1], c.v[2], c.v[3]};
#pragma unroll
  for (int k = 0; k < 8; ++k)
    u[k] = shift == 0 ? w[k] : shift == 1 ? w[k + 1] : shift == 2 ? w[k + 2] : w[k + 3];
}

// dropout(v) for the 8 elements of a chunk; explicitly rounded multiply, as the CPU computes it.
__device__ __forceinline__ void apply_dropout(const Drop& d, std::uint64_t start, int r, int c, float v[8]) {
  std::uint32_t u[8];
  words8(d, start, static_cast<std::uint64_t>((d.row_offset + r) * d.cols_total + d.col_offset + c), u);
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = rng::dropout_keep(u[k], d.threshold) ? rng::mul_rn(v[k], d.scale) : 0.0f;
}

// out may alias residual: each thread reads its chunk before writing it, and no other thread
// touches that chunk.
template <bool VEC, bool DROP>
__global__ void residual_kernel(bf16* out, const bf16* residual, const bf16* x, int N, int C, Drop d) {
  const std::uint64_t start = DROP ? d.rng.start() : 0;
  const int chunks = (C + 7) / 8;
  for (int r = blockIdx.x * kRows + threadIdx.y; r < N; r += gridDim.x * kRows) {
    const std::int64_t row = static_cast<std::int64_t>(r) * C;
    for (int j = threadIdx.x; j < chunks; j += kLanes) {
      const int c = j * 8, valid = C - c;
      float a[8], v[8];
      load_chunk<VEC>(residual + row + c, valid, a);
      load_chunk<VEC>(x + row + c, valid, v);
      if (DROP) apply_dropout(d, start, r, c, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) a[k] = rng::add_rn(a[k], v[k]);
      store_chunk<VEC>(out + row + c, valid, a);
    }
  }
}

template <bool VEC>
__global__ void dropout_backward_kernel(bf16* dx, const bf16* dout, int N, int C, Drop d) {
  const std::uint64_t start = d.rng.start();
  const int chunks = (C + 7) / 8;
  for (int r = blockIdx.x * kRows + threadIdx.y; r < N; r += gridDim.x * kRows) {
    const std::int64_t row = static_cast<std::int64_t>(r) * C;
    for (int j = threadIdx.x; j < chunks; j += kLanes) {
      const int c = j * 8, valid = C - c;
      float v[8];
      load_chunk<VEC>(dout + row + c, valid, v);
      apply_dropout(d, start, r, c, v);
      store_chunk<VEC>(dx + row + c, valid, v);
    }
  }
}

}  // namespace

void residual_forward(bf16* out, const bf16* residual, const bf16* x, int N, int C, const ops::DropoutArgs& d,
                      cudaStream_t s) {
  if (N <= 0 || C <= 0) return;
  const Drop drop = make_drop(d, C);
  const bool vec = C % 8 == 0 && aligned16(out) && aligned16(residual) && aligned16(x);
  const bool dropout = d.p > 0;
  const dim3 block(kLanes, kRows);
  const unsigned grid = grid_for(N, kRows, 65535);
  if (vec && dropout) residual_kernel<true, true><<<grid, block, 0, s>>>(out, residual, x, N, C, drop);
  else if (vec) residual_kernel<true, false><<<grid, block, 0, s>>>(out, residual, x, N, C, drop);
  else if (dropout) residual_kernel<false, true><<<grid, block, 0, s>>>(out, residual, x, N, C, drop);
  else residual_kernel<false, false><<<grid, block, 0, s>>>(out, residual, x, N, C, drop);
  KILN_CUDA_LAUNCH_CHECK();
}

void dropout_backward(bf16* dx, const bf16* dout, int N, int C, const ops::DropoutArgs& d, cudaStream_t s) {
  if (N <= 0 || C <= 0) return;
  if (!(d.p > 0)) {  // no dropout: the gradient passes through
    if (dx != dout)
      KILN_CUDA_CHECK(cudaMemcpyAsync(dx, dout, static_cast<std::size_t>(N) * C * sizeof(bf16), cudaMemcpyDeviceToDevice, s));
    return;
  }
  const Drop drop = make_drop(d, C);
  const dim3 block(kLanes, kRows);
  const unsigned grid = grid_for(N, kRows, 65535);
  if (C % 8 == 0 && aligned16(dx) && aligned16(dout))
    dropout_backward_kernel<true><<<grid, block, 0, s>>>(dx, dout, N, C, drop);
  else
    dropout_backward_kernel<false><<<grid, block, 0, s>>>(dx, dout, N, C, drop);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda
