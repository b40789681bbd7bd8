// Dropout on grouped rows, in place: row r's element c keeps with the Philox word at
// ids[r] * cols_total + col_offset + c (the row's (token, expert) id in the step's global batch), so
// the masks are the CPU's, bit for bit, wherever the row sits.
#include "common.cuh"
#include "kiln/ops/cuda/moe.hpp"
#include "kiln/rng/philox.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

constexpr int kLanes = 32, kRows = 8;  // blocks of (32 chunk lanes, 8 rows), chunks of 8 channels

// The 32-bit words of elements n0 .. n0 + 7 of the draw starting at block `start`: 2 Philox blocks,
// or 3 when n0 % 4 != 0 (selects rather than a dynamic index keep them in registers).
__device__ __forceinline__ void words8(std::uint64_t seed, std::uint64_t start, std::uint64_t n0, std::uint32_t u[8]) {
  const std::uint64_t blk = start + n0 / 4;
  const unsigned shift = static_cast<unsigned>(n0 % 4);
  const rng::Philox4 a = rng::philox_block(seed, blk), b = rng::philox_block(seed, blk + 1);
  const rng::Philox4 c = shift ? rng::philox_block(seed, blk + 2) : b;
  const std::uint32_t w[12] = {a.v[0], a.v[1], a.v[2], a.v[3], b.v[0], b.v[1],
                               b.v[2], b.v[3], c.v[0], c.v[1], c.v[2], c.v[3]};
#pragma unroll
  for (int q = 0; q < 8; ++q) u[q] = shift == 0 ? w[q] : shift == 1 ? w[q + 1] : shift == 2 ? w[q + 2] : w[q + 3];
}

template <bool VEC>
__global__ void moe_dropout_kernel(bf16* x, const std::int32_t* ids, std::int64_t rows, int F, std::int64_t cols,
                                   std::int64_t col_offset, rng::PhiloxArgs r, std::uint32_t threshold,
                                   float scale) {
  const std::uint64_t start = r.start();  // on the device: reads offset_ptr in graph-safe mode
  const int chunks = (F + 7) / 8;
  for (std::int64_t row = blockIdx.x * static_cast<std::int64_t>(kRows) + threadIdx.y; row < rows;
       row += static_cast<std::int64_t>(gridDim.x) * kRows) {
    // The CPU's element index: ids[r] * cols + (col_offset + c), in unsigned 64-bit arithmetic.
    const std::uint64_t base = static_cast<std::uint64_t>(ids[row]) * static_cast<std::uint64_t>(cols) +
                               static_cast<std::uint64_t>(col_offset);
    bf16* xr = x + row * F;
    for (int j = threadIdx.x; j < chunks; j += kLanes) {
      const int c = j * 8, valid = F - c;
      float v[8];
      std::uint32_t u[8];
      load_chunk<VEC>(xr + c, valid, v);
      words8(r.seed, start, base + static_cast<std::uint64_t>(c), u);
#pragma unroll
      for (int q = 0; q < 8; ++q) v[q] = rng::dropout_keep(u[q], threshold) ? __fmul_rn(v[q], scale) : 0.0f;
      store_chunk<VEC>(xr + c, valid, v);
    }
  }
}

}  // namespace

void moe_dropout(bf16* x, const std::int32_t* ids, std::int64_t rows, int F, float p, rng::PhiloxArgs rng,
                 std::int64_t col_offset, std::int64_t cols_total, cudaStream_t s) {
  if (rows <= 0 || F <= 0) return;
  const std::int64_t cols = cols_total > 0 ? cols_total : F;
  const std::uint32_t threshold = rng::dropout_threshold(p);
  const float scale = 1.0f / (1.0f - p);  // as the CPU computes it
  const dim3 block(kLanes, kRows);
  const unsigned blocks = grid_for(rows, kRows);
  if (F % 8 == 0 && aligned16(x))
    moe_dropout_kernel<true><<<blocks, block, 0, s>>>(x, ids, rows, F, cols, col_offset, rng, threshold, scale);
  else
    moe_dropout_kernel<false><<<blocks, block, 0, s>>>(x, ids, rows, F, cols, col_offset, rng, threshold, scale);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda
