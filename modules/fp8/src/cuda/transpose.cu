// One-byte codes transposed through a shared tile (the colwise copy of a gathered FP8 weight).
#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::fp8::cuda {

namespace {

constexpr int kTileDim = 32, kRowsPerPass = 8;

// Block (32, 8) moves one 32 x 32 tile: reads rows coalesced, writes the transposed rows coalesced.
__global__ void transpose_bytes_kernel(std::uint8_t* __restrict__ out, const std::uint8_t* __restrict__ in,
                                       std::int64_t rows, std::int64_t cols) {
  __shared__ std::uint8_t tile[kTileDim][kTileDim + 4];
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kTileDim, c0 = static_cast<std::int64_t>(blockIdx.x) * kTileDim;
  for (int k = threadIdx.y; k < kTileDim; k += kRowsPerPass) {
    const std::int64_t r = r0 + k, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[k][threadIdx.x] = in[r * cols + c];
  }
  __syncthreads();
  for (int k = threadIdx.y; k < kTileDim; k += kRowsPerPass) {
    const std::int64_t c = c0 + k, r = r0 + threadIdx.x;  // out row c, column r
    if (c < cols && r < rows) out[c * rows + r] = tile[threadIdx.x][k];
  }
}

}  // namespace

void transpose_bytes(std::uint8_t* out, const std::uint8_t* in, std::int64_t rows, std::int64_t cols, cudaStream_t s) {
  if (rows <= 0 || cols <= 0) return;
  const std::int64_t tiles_r = (rows + kTileDim - 1) / kTileDim, tiles_c = (cols + kTileDim - 1) / kTileDim;
  KILN_CHECK(tiles_r <= 65535, "fp8 transpose: ", rows, " rows are too many");
  const dim3 grid(static_cast<unsigned>(tiles_c), static_cast<unsigned>(tiles_r)), block(kTileDim, kRowsPerPass);
  transpose_bytes_kernel<<<grid, block, 0, s>>>(out, in, rows, cols);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::fp8::cuda
