// Token + position embedding, forward and a deterministic backward (no float atomics).
#include "common.cuh"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

// Blocks of (32 chunk lanes, 8 rows): each thread handles chunks of 8 channels of one row at a
// time, so no index division is needed. VEC: C % 8 == 0 and 16-byte aligned bases.
constexpr int kLanes = 32, kRows = 8;

// Tokens outside [begin, begin + V) (another rank's rows of a vocabulary-parallel table) read zeros.
template <bool VEC>
__global__ void embedding_forward_kernel(bf16* out, const std::int32_t* tokens, const bf16* wte, const bf16* wpe,
                                         int N, int T, int C, std::int64_t begin, int V, bool positions) {
  const int chunks = (C + 7) / 8;
  for (int n = blockIdx.x * kRows + threadIdx.y; n < N; n += gridDim.x * kRows) {
    const std::int64_t row = tokens[n] - begin;
    const bf16* e = row >= 0 && row < V ? wte + row * C : nullptr;
    const bf16* p = wpe + static_cast<std::int64_t>(n % T) * C;
    bf16* o = out + static_cast<std::int64_t>(n) * C;
    for (int j = threadIdx.x; j < chunks; j += kLanes) {
      const int c = j * 8, valid = C - c;
      float a[8] = {}, b[8] = {};
      if (e) load_chunk<VEC>(e + c, valid, a);
      if (positions) load_chunk<VEC>(p + c, valid, b);
#pragma unroll
      for (int k = 0; k < 8; ++k) a[k] += b[k];
      store_chunk<VEC>(o + c, valid, a);
    }
  }
}

// dwte: one thread per (unique token, chunk). It starts from dwte's value and adds the token's rows
// in position order (the buckets are stable-sorted), exactly the CPU's order of additions. Rows are
// loaded 4 at a time to keep several loads in flight; the additions stay in order.
template <bool VEC>
__global__ void embedding_backward_wte_kernel(float* dwte, const bf16* dout, const std::int32_t* order,
                                              const std::int32_t* bucket_start, const std::int32_t* bucket_token,
                                              int U, int C) {
  const int u = blockIdx.x * kRows + threadIdx.y;
  const int j = blockIdx.y * kLanes + threadIdx.x;
  const int c = j * 8, valid = C - c;
  if (u >= U || c >= C) return;
  const int beg = bucket_start[u], end = bucket_start[u + 1];
  float* dst = dwte + static_cast<std::int64_t>(bucket_token[u]) * C + c;
  float acc[8];
  load_chunk<VEC>(dst, valid, acc);
  int i = beg;
  for (; i + 4 <= end; i += 4) {
    float g[4][8];
#pragma unroll
    for (int r = 0; r < 4; ++r) load_chunk<VEC>(dout + static_cast<std::int64_t>(order[i + r]) * C + c, valid, g[r]);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] += g[r][k];
  }
  for (; i < end; ++i) {
    float g[8];
    load_chunk<VEC>(dout + static_cast<std::int64_t>(order[i]) * C + c, valid, g);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] += g[k];
  }
  store_chunk<VEC>(dst, valid, acc);
}

// dwpe[t] += dout[b*T + t] for b = 0, 1, ... in order (the CPU's order), one thread per (t, chunk).
template <bool VEC>
__global__ void embedding_backward_wpe_kernel(float* dwpe, const bf16* dout, int B, int T, int C) {
  const int t = blockIdx.x * kRows + threadIdx.y;
  const int j = blockIdx.y * kLanes + threadIdx.x;
  const int c = j * 8, valid = C - c;
  if (t >= T || c >= C) return;
  float* dst = dwpe + static_cast<std::int64_t>(t) * C + c;
  const std::int64_t step = static_cast<std::int64_t>(T) * C;
  const bf16* src = dout + static_cast<std::int64_t>(t) * C + c;
  float acc[8];
  load_chunk<VEC>(dst, valid, acc);
  int b = 0;
  for (; b + 4 <= B; b += 4) {
    float g[4][8];
#pragma unroll
    for (int r = 0; r < 4; ++r) load_chunk<VEC>(src + (b + r) * step, valid, g[r]);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] += g[r][k];
  }
  for (; b < B; ++b) {
    float g[8];
    load_chunk<VEC>(src + b * step, valid, g);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] += g[k];
  }
  store_chunk<VEC>(dst, valid, acc);
}

}  // namespace

void embedding_forward(bf16* out, const std::int32_t* tokens, const bf16* wte, const bf16* wpe, int N, int T, int C,
                       std::int64_t vocab_begin, int V, bool positions, cudaStream_t s) {
  if (N <= 0 || C <= 0) return;
  KILN_CHECK(T > 0, "embedding_forward: T = ", T);
  const dim3 block(kLanes, kRows);
  const unsigned grid = grid_for(N, kRows, 65535);
  if (C % 8 == 0 && aligned16(out) && aligned16(wte) && aligned16(wpe))
    embedding_forward_kernel<true><<<grid, block, 0, s>>>(out, tokens, wte, wpe, N, T, C, vocab_begin, V, positions);
  else
    embedding_forward_kernel<false><<<grid, block, 0, s>>>(out, tokens, wte, wpe, N, T, C, vocab_begin, V, positions);
  KILN_CUDA_LAUNCH_CHECK();
}

void embedding_backward(float* dwte, float* dwpe, const bf16* dout, const std::int32_t* order,
                        const std::int32_t* bucket_start, const std::int32_t* bucket_token, int U, int N, int T,
                        int C, cudaStream_t s) {
  if (N <= 0 || C <= 0) return;
  KILN_CHECK(T > 0 && N % T == 0, "embedding_backward: N = ", N, " is not a multiple of T = ", T);
  const bool vec = C % 8 == 0 && aligned16(dwte) && (!dwpe || aligned16(dwpe)) && aligned16(dout);
  const dim3 block(kLanes, kRows);
  const unsigned chunk_blocks = static_cast<unsigned>(ceil_div(ceil_div(C, 8), kLanes));
  if (U > 0) {
    const dim3 grid(static_cast<unsigned>(ceil_div(U, kRows)), chunk_blocks);
    if (vec)
      embedding_backward_wte_kernel<true><<<grid, block, 0, s>>>(dwte, dout, order, bucket_start, bucket_token, U, C);
    else
      embedding_backward_wte_kernel<false><<<grid, block, 0, s>>>(dwte, dout, order, bucket_start, bucket_token, U, C);
    KILN_CUDA_LAUNCH_CHECK();
  }
  if (!dwpe) return;  // no position table
  const dim3 grid(static_cast<unsigned>(ceil_div(T, kRows)), chunk_blocks);
  if (vec)
    embedding_backward_wpe_kernel<true><<<grid, block, 0, s>>>(dwpe, dout, N / T, T, C);
  else
    embedding_backward_wpe_kernel<false><<<grid, block, 0, s>>>(dwpe, dout, N / T, T, C);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda
