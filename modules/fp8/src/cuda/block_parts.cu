// A part of a 128x128-scaled weight (kiln/fp8/block.hpp's BlockPart: an FSDP shard of the f32 master,
// the flat elements first..first + n), bit for bit as the references in block.cpp: one CTA per tile of
// the weight (blockIdx.x its column of tiles, blockIdx.y its row), returning at once where the part
// misses the tile; 256 threads, a tile row's 128 values read by four warps (coalesced), two rows a pass.
#include <cuda_bf16.h>

#include "kiln/fp8/block.hpp"
#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "tiles.cuh"

namespace kiln::fp8::cuda {

namespace {

constexpr int kThreadsPart = 256;

// The rows of tile (r0, c0) the part touches, [lo, hi): empty where it misses the tile.
__device__ __forceinline__ bool tile_rows(const BlockPart& p, long long r0, long long c0, long long& lo, long long& hi) {
  const long long last = p.first + p.n - 1, first = p.first, cols = p.cols, rows = p.rows;  // (last: the part's)
  lo = max(r0, first / cols);
  hi = min(min(r0 + static_cast<long long>(kBlock), rows), last / cols + 1);
  if (lo >= hi) return false;
  // The first and last rows may hold the part only past (or before) the tile's columns.
  if (lo == p.first / p.cols && p.first % p.cols >= c0 + kBlock) ++lo;
  if (hi - 1 == last / p.cols && last % p.cols < c0) --hi;
  return lo < hi;
}

__global__ void __launch_bounds__(kThreadsPart) part_amax_kernel(BlockPart p, float* tile_amax) {
  const long long r0 = static_cast<long long>(blockIdx.y) * kBlock, c0 = static_cast<long long>(blockIdx.x) * kBlock;
  long long lo = 0, hi = 0;
  if (!tile_rows(p, r0, c0, lo, hi)) return;
  const long long c = c0 + threadIdx.x % kBlock;
  std::uint32_t m = 0;
  if (c < p.cols)
    for (long long r = lo + threadIdx.x / kBlock; r < hi; r += kThreadsPart / kBlock) {
      const long long i = r * p.cols + c - p.first;
      if (i >= 0 && i < p.n) m = max(m, abs_bits(p.values[i]));
    }
  __shared__ std::uint32_t warp_max[kThreadsPart / 32];
  m = __reduce_max_sync(0xffffffffu, m);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreadsPart / 32; ++w) m = max(m, warp_max[w]);
    float* t = tile_amax + BlockLayout{ScalingMode::block_128x128, p.rows, p.cols}.index(r0, c0);
    *t = amax_max(*t, bits_float(m));  // one CTA per tile: no other writer on this rank
  }
}

__global__ void scales_kernel(const float* tile_amax, long long rows, long long cols, float fmax, bool pow2,
                              float* scale, float* row_scale_inv, float* col_scale_inv) {
  const long long tiles_c = blocks_of(cols), t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= blocks_of(rows) * tiles_c) return;
  const long long r0 = t / tiles_c * kBlock, c0 = t % tiles_c * kBlock;
  const BlockLayout l{ScalingMode::block_128x128, rows, cols}, tl{ScalingMode::block_128x128, cols, rows};
  const long long i = l.index(r0, c0);
  const float s = block_scale(fmax, tile_amax[i], pow2);
  scale[i] = s;
  row_scale_inv[i] = reciprocal(s);
  col_scale_inv[tl.index(c0, r0)] = reciprocal(s);
}

template <Format F>
__global__ void __launch_bounds__(kThreadsPart) part_quantize_kernel(BlockPart p, const float* scale, std::uint8_t* codes) {
  const long long r0 = static_cast<long long>(blockIdx.y) * kBlock, c0 = static_cast<long long>(blockIdx.x) * kBlock;
  long long lo = 0, hi = 0;
  if (!tile_rows(p, r0, c0, lo, hi)) return;
  const float s = scale[BlockLayout{ScalingMode::block_128x128, p.rows, p.cols}.index(r0, c0)];
  const long long c = c0 + threadIdx.x % kBlock;
  if (c >= p.cols) return;
  for (long long r = lo + threadIdx.x / kBlock; r < hi; r += kThreadsPart / kBlock) {
    const long long i = r * p.cols + c - p.first;
    if (i >= 0 && i < p.n) codes[i] = cvt1<F>(__fmul_rn(p.values[i], s));
  }
}

dim3 tiles_of(const BlockPart& p, const char* what) {
  const std::int64_t tc = blocks_of(p.cols), tr = blocks_of(p.rows);
  KILN_CHECK(p.rows > 0 && p.cols > 0 && p.first >= 0 && p.n >= 0 && p.first + p.n <= p.rows * p.cols && tc <= 0x7fffffff &&
                 tr <= 65535,
             what, ": a part of ", p.n, " elements from ", p.first, " of a [", p.rows, ", ", p.cols, "] weight");
  return dim3(static_cast<unsigned>(tc), static_cast<unsigned>(tr));
}

}  // namespace

void block_part_amax(const BlockPart& p, float* tile_amax, cudaStream_t s) {
  const dim3 grid = tiles_of(p, "fp8 block_part_amax");
  if (p.n == 0) return;
  part_amax_kernel<<<grid, kThreadsPart, 0, s>>>(p, tile_amax);
  KILN_CUDA_LAUNCH_CHECK();
}

void block_scales(const float* tile_amax, std::int64_t rows, std::int64_t cols, Format f, bool pow2, float* scale,
                  float* row_scale_inv, float* col_scale_inv, cudaStream_t s) {
  const std::int64_t tiles = blocks_of(rows) * blocks_of(cols);
  if (tiles == 0) return;
  scales_kernel<<<static_cast<unsigned>((tiles + 127) / 128), 128, 0, s>>>(tile_amax, rows, cols, max_value(f), pow2,
                                                                           scale, row_scale_inv, col_scale_inv);
  KILN_CUDA_LAUNCH_CHECK();
}

void quantize_block_part(const BlockPart& p, const float* scale, Format f, std::uint8_t* codes, cudaStream_t s) {
  const dim3 grid = tiles_of(p, "fp8 quantize_block_part");
  if (p.n == 0) return;
  if (f == Format::e4m3)
    part_quantize_kernel<Format::e4m3><<<grid, kThreadsPart, 0, s>>>(p, scale, codes);
  else
    part_quantize_kernel<Format::e5m2><<<grid, kThreadsPart, 0, s>>>(p, scale, codes);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::fp8::cuda
