// A mixture of experts' grouped FP8 operands: the experts' rows of a grouped tensor quantised into
// zero-padded batched operands (rowwise and its per-expert transpose, one read of x), and the padded
// results of a batched GEMM copied back into the grouped rows. A stacked tensor [B, rows, cols] is
// the same grouping with every expert full (no offsets): the batched quantise of the experts' weights.
//
// The tiled kernel is cast_transpose_tiled's (tiles.cuh) with the tiles of every expert's padded
// block in one grid: a tile's rows past its expert's rows load zeros, so they get the code of 0 and
// add nothing to the amax. The amax is the same order-free max over |x| bit patterns.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "tiles.cuh"

namespace kiln::fp8::cuda {

namespace {

// Expert e's rows of x: [begin, begin + count); with no offsets every expert has `pad` rows.
struct ExpertRows {
  long long begin, count;
};
__device__ __forceinline__ ExpertRows expert_rows(const std::int32_t* off, long long e, long long pad) {
  if (!off) return {e * pad, pad};
  const long long b = off[e];
  return {b, off[e + 1] - b};
}

template <class In, Format F, bool ROW, bool COL, bool AMAX>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_grouped_tiled(const In* __restrict__ x, const std::int32_t* __restrict__ off,
                                 std::uint8_t* __restrict__ row, std::uint8_t* __restrict__ col,
                                 const float* __restrict__ scale_ptr, float* amax, int experts, int pad, int cols) {
  __shared__ __align__(16) std::uint8_t tile[kTile * kStride];
  const float scale = *scale_ptr;
  const int tiles_c = (cols + kTile - 1) / kTile;
  const long long per_expert = static_cast<long long>((pad + kTile - 1) / kTile) * tiles_c;
  const long long tiles = per_expert * experts;
  const int lr = threadIdx.x / 4, lv = threadIdx.x % 4;
  unsigned local = 0;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    const long long e = t / per_expert, in_e = t % per_expert;
    const int r0 = static_cast<int>(in_e / tiles_c) * kTile, c0 = static_cast<int>(in_e % tiles_c) * kTile;
    const int gr = r0 + lr, gc = c0 + lv * 16;
    const ExpertRows rows = expert_rows(off, e, pad);
    if (gr < pad && gc < cols) {
      float v[16];
      if (gr < rows.count) {
        load16(x + static_cast<size_t>(rows.begin + gr) * cols + gc, v);
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = 0.0f;  // padding: encode(0 * scale), as the CPU writes it
      }
      std::uint32_t w[4];
      encode16<F>(v, scale, w);
      if (AMAX)
#pragma unroll
        for (int i = 0; i < 16; ++i) local = max(local, abs_bits(v[i]));
      if (ROW)
        *reinterpret_cast<uint4*>(row + (static_cast<size_t>(e) * pad + gr) * cols + gc) =
            make_uint4(w[0], w[1], w[2], w[3]);
      if (COL) {
        auto* dst = reinterpret_cast<std::uint32_t*>(tile + lr * kStride + lv * 16);
#pragma unroll
        for (int j = 0; j < 4; ++j) dst[j] = w[j];
      }
    }
    if (COL) {
      __syncthreads();
      store_transposed(tile, col + static_cast<size_t>(e) * cols * pad, r0, c0, pad, cols);
      __syncthreads();  // the next tile overwrites the shared tile
    }
  }
  if (AMAX) block_amax(local, amax);
}

// Any shape and alignment: one element of the padded operands per thread and step.
template <class In, Format F, bool ROW, bool COL, bool AMAX>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_grouped_any(const In* __restrict__ x, const std::int32_t* __restrict__ off,
                               std::uint8_t* __restrict__ row, std::uint8_t* __restrict__ col,
                               const float* __restrict__ scale_ptr, float* amax, long long experts, long long pad,
                               long long cols) {
  const float scale = *scale_ptr;
  const long long block = pad * cols, n = experts * block;
  unsigned local = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long e = i / block, p = (i % block) / cols, c = i % cols;
    const ExpertRows rows = expert_rows(off, e, pad);
    const float v = p < rows.count ? load1(x, (rows.begin + p) * cols + c) : 0.0f;
    const std::uint8_t q = cvt1<F>(__fmul_rn(v, scale));
    if (ROW) row[i] = q;
    if (COL) col[(e * cols + c) * pad + p] = q;
    if (AMAX) local = max(local, abs_bits(v));
  }
  if (AMAX) block_amax(local, amax);
}

// out row r (r < used_rows) = in row e * pad + (r - off[e]) of the expert e holding it: one warp per
// row, V-sized words (vpr of them per row).
template <class V>
__global__ void __launch_bounds__(kThreads)
    ungroup_rows_kernel(V* __restrict__ out, const V* __restrict__ in, const std::int32_t* __restrict__ off,
                        int experts, long long used_rows, long long pad, long long vpr) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32;
  for (long long r = static_cast<long long>(blockIdx.x) * kWarps + threadIdx.x / 32; r < used_rows;
       r += static_cast<long long>(gridDim.x) * kWarps) {
    // The last expert starting at or before r (empty experts share their successor's start).
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (off[mid] <= r)
        lo = mid;
      else
        hi = mid - 1;
    }
    const V* src = in + (static_cast<long long>(lo) * pad + (r - off[lo])) * vpr;
    V* dst = out + r * vpr;
    for (long long c = lane; c < vpr; c += 32) dst[c] = src[c];
  }
}

unsigned grid_for(long long work) {
  return static_cast<unsigned>(std::clamp<long long>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

template <class In, Format F, bool ROW, bool COL, bool AMAX>
void launch_grouped(const GroupedCast& a, cudaStream_t s) {
  const In* x = static_cast<const In*>(a.x);
  const bool tiled = a.rows_pad % 16 == 0 && a.cols % 16 == 0 && a.rows_pad <= 0x7fffffff && a.cols <= 0x7fffffff &&
                     aligned16(x) && (!ROW || aligned16(a.rowwise)) && (!COL || aligned16(a.colwise));
  if (tiled) {
    const long long tiles =
        static_cast<long long>(a.experts) * ((a.rows_pad + kTile - 1) / kTile) * ((a.cols + kTile - 1) / kTile);
    const auto grid = static_cast<unsigned>(std::min<long long>(tiles, kMaxBlocks));
    cast_transpose_grouped_tiled<In, F, ROW, COL, AMAX><<<grid, kThreads, 0, s>>>(
        x, a.offsets, a.rowwise, a.colwise, a.scale, a.amax, a.experts, static_cast<int>(a.rows_pad),
        static_cast<int>(a.cols));
  } else {
    cast_transpose_grouped_any<In, F, ROW, COL, AMAX><<<grid_for(a.experts * a.rows_pad * a.cols), kThreads, 0, s>>>(
        x, a.offsets, a.rowwise, a.colwise, a.scale, a.amax, a.experts, a.rows_pad, a.cols);
  }
  KILN_CUDA_LAUNCH_CHECK();
}

template <class In, Format F, bool ROW, bool COL>
void grouped_with_amax(const GroupedCast& a, cudaStream_t s) {
  if (a.amax)
    launch_grouped<In, F, ROW, COL, true>(a, s);
  else
    launch_grouped<In, F, ROW, COL, false>(a, s);
}

template <class In, Format F>
void grouped_with_copies(const GroupedCast& a, cudaStream_t s) {
  if (a.rowwise && a.colwise)
    grouped_with_amax<In, F, true, true>(a, s);
  else if (a.rowwise)
    grouped_with_amax<In, F, true, false>(a, s);
  else
    grouped_with_amax<In, F, false, true>(a, s);
}

template <class In>
void grouped_with_format(const GroupedCast& a, cudaStream_t s) {
  if (a.format == Format::e4m3)
    grouped_with_copies<In, Format::e4m3>(a, s);
  else
    grouped_with_copies<In, Format::e5m2>(a, s);
}

}  // namespace

void cast_transpose_grouped(const GroupedCast& a, cudaStream_t s) {
  KILN_CHECK(a.x_dtype == DType::bf16 || a.x_dtype == DType::f32,
             "fp8 cast_transpose_grouped: input must be bf16 or f32, not ", name_of(a.x_dtype));
  KILN_CHECK(a.experts >= 0 && a.rows_pad >= 0 && a.cols >= 0 && a.scale, "fp8 cast_transpose_grouped: ", a.experts,
             " experts of [", a.rows_pad, ",", a.cols, "]");
  if (a.experts == 0 || a.rows_pad == 0 || a.cols == 0) return;
  if (!a.rowwise && !a.colwise) {  // the amax alone: of the experts' rows, contiguous from row 0
    if (a.amax) amax(a.x, a.x_dtype, a.used_rows * a.cols, a.amax, s);
    return;
  }
  if (a.x_dtype == DType::bf16)
    grouped_with_format<bf16>(a, s);
  else
    grouped_with_format<float>(a, s);
}

void ungroup_rows(const UngroupRows& a, cudaStream_t s) {
  KILN_CHECK(a.experts > 0 && a.used_rows >= 0 && a.rows_pad >= 0 && a.cols >= 0 && a.elem_bytes > 0,
             "fp8 ungroup_rows: ", a.experts, " experts, ", a.used_rows, " rows of [", a.rows_pad, ",", a.cols, "]");
  if (a.used_rows == 0 || a.cols == 0) return;
  const std::size_t row_bytes = static_cast<std::size_t>(a.cols) * a.elem_bytes;
  constexpr long long kRowsPerBlock = kThreads / 32;
  const auto grid =
      static_cast<unsigned>(std::clamp<long long>((a.used_rows + kRowsPerBlock - 1) / kRowsPerBlock, 1, kMaxBlocks));
  auto launch = [&](auto word) {
    using V = decltype(word);
    const auto vpr = static_cast<long long>(row_bytes / sizeof(V));
    ungroup_rows_kernel<V><<<grid, kThreads, 0, s>>>(static_cast<V*>(a.out), static_cast<const V*>(a.in), a.offsets,
                                                    a.experts, a.used_rows, a.rows_pad, vpr);
    KILN_CUDA_LAUNCH_CHECK();
  };
  const auto out = reinterpret_cast<std::uintptr_t>(a.out), in = reinterpret_cast<std::uintptr_t>(a.in);
  auto fits = [&](std::size_t w) { return row_bytes % w == 0 && out % w == 0 && in % w == 0; };
  if (fits(16))
    launch(uint4{});
  else if (fits(4))
    launch(std::uint32_t{});
  else if (fits(2))
    launch(std::uint16_t{});
  else
    launch(std::uint8_t{});
}

}  // namespace kiln::fp8::cuda
