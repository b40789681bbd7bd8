// One-byte codes transposed through a shared tile (the colwise copy of a gathered FP8 weight, or of
// one held as its rowwise codes alone). Where both dimensions are multiples of 16 and the codes
// 16-byte aligned (every FP8 weight on CUDA), 64 x 64 tiles move 16 bytes a thread each way
// (tiles.cuh's store_transposed); else 32 x 32 tiles a byte at a time.
#include <algorithm>

#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "tiles.cuh"

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

// rows % 16 == 0, cols % 16 == 0, 16-byte aligned: thread t loads 16 bytes of tile row t / 4 into
// the shared tile, then writes 16 rows of one tile column as one 16-byte word.
__global__ void __launch_bounds__(kThreads)
    transpose_bytes_tiled(std::uint8_t* __restrict__ out, const std::uint8_t* __restrict__ in, int rows, int cols) {
  __shared__ __align__(16) std::uint8_t tile[kTile * kStride];
  const int tiles_c = (cols + kTile - 1) / kTile;
  const long long tiles = static_cast<long long>((rows + kTile - 1) / kTile) * tiles_c;
  const int lr = threadIdx.x / 4, lv = threadIdx.x % 4;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int r0 = static_cast<int>(t / tiles_c) * kTile, c0 = static_cast<int>(t % tiles_c) * kTile;
    const int r = r0 + lr, c = c0 + 16 * lv;
    if (r < rows && c < cols) {
      const uint4 x = *reinterpret_cast<const uint4*>(in + static_cast<size_t>(r) * cols + c);
      const std::uint32_t w[4] = {x.x, x.y, x.z, x.w};
      stage_codes(tile, w);
    }
    __syncthreads();
    store_transposed(tile, out, r0, c0, rows, cols);
    __syncthreads();  // the next tile overwrites the shared tile
  }
}

}  // namespace

void transpose_bytes(std::uint8_t* out, const std::uint8_t* in, std::int64_t rows, std::int64_t cols, cudaStream_t s) {
  if (rows <= 0 || cols <= 0) return;
  if (rows % 16 == 0 && cols % 16 == 0 && rows <= 0x7fffffff && cols <= 0x7fffffff && aligned16(in) && aligned16(out)) {
    const long long tiles = ((rows + kTile - 1) / kTile) * ((cols + kTile - 1) / kTile);
    const auto grid = static_cast<unsigned>(std::min<long long>(tiles, kMaxBlocks));
    transpose_bytes_tiled<<<grid, kThreads, 0, s>>>(out, in, static_cast<int>(rows), static_cast<int>(cols));
    KILN_CUDA_LAUNCH_CHECK();
    return;
  }
  const std::int64_t tiles_r = (rows + kTileDim - 1) / kTileDim, tiles_c = (cols + kTileDim - 1) / kTileDim;
  KILN_CHECK(tiles_r <= 65535, "fp8 transpose: ", rows, " rows are too many");
  const dim3 grid(static_cast<unsigned>(tiles_c), static_cast<unsigned>(tiles_r)), block(kTileDim, kRowsPerPass);
  transpose_bytes_kernel<<<grid, block, 0, s>>>(out, in, rows, cols);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::fp8::cuda
