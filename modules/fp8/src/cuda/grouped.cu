// A mixture of experts' grouped FP8 operands: a grouped tensor's rows quantised rowwise as they are
// and, per expert, transposed into a contiguous block padded to its plan's rows (GroupedCast), one
// read of x. A stacked tensor [B, rows, cols] is the same grouping with every expert full and no
// padding: the batched quantize of the experts' weights.
//
// The tiled kernel is cast_transpose_tiled's (tiles.cuh) over every expert's padded rows in one
// grid: a tile's rows past its expert's rows load zeros, so they get the code of 0 and add nothing
// to the amax, and are not written rowwise. The amax is the same order-free max over |x| bit patterns.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "tiles.cuh"

namespace kiln::fp8::cuda {

namespace {

// The last expert e with a[e] <= v (a: non-decreasing, experts + 1 entries; empty experts share
// their successor's start, so the one found holds v).
__device__ __forceinline__ int expert_at(const std::int32_t* a, int experts, long long v) {
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a[mid] <= v)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The plan's three arrays.
struct Plan {
  const std::int32_t *begin, *seg, *tile;
  __device__ Plan(const std::int32_t* p, int experts) : begin(p), seg(p + experts + 1), tile(p + 2 * (experts + 1)) {}
};

template <class In, Format F, bool ROW, bool COL, bool AMAX>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_grouped_tiled(const In* __restrict__ x, const std::int32_t* __restrict__ plan,
                                 std::uint8_t* __restrict__ row, std::uint8_t* __restrict__ col,
                                 const float* __restrict__ scale_ptr, float* amax, int experts, int tiles, int cols) {
  __shared__ __align__(16) std::uint8_t tile[kTile * kStride];
  const float scale = *scale_ptr;
  const Plan p(plan, experts);
  const int tiles_c = (cols + kTile - 1) / kTile;
  const int lr = threadIdx.x / 4, lv = threadIdx.x % 4;
  unsigned local = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int e = expert_at(p.tile, experts, t), in_e = t - p.tile[e];
    const int r0 = (in_e / tiles_c) * kTile, c0 = (in_e % tiles_c) * kTile;
    const int gr = r0 + lr, gc = c0 + lv * 16;
    const int begin = p.begin[e], count = p.begin[e + 1] - begin, pad = p.seg[e + 1] - p.seg[e];
    if (gr < pad && gc < cols) {
      float v[16];
      if (gr < count) {
        load16(x + static_cast<size_t>(begin + gr) * cols + gc, v);
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = 0.0f;  // padding: encode(0 * scale), as the CPU writes it
      }
      std::uint32_t w[4];
      encode16<F>(v, scale, w);
      if (AMAX)
#pragma unroll
        for (int i = 0; i < 16; ++i) local = max(local, abs_bits(v[i]));
      if (ROW && gr < count)
        *reinterpret_cast<uint4*>(row + static_cast<size_t>(begin + gr) * cols + gc) = make_uint4(w[0], w[1], w[2], w[3]);
      if (COL) stage_codes(tile, w);
    }
    if (COL) {
      __syncthreads();
      store_transposed(tile, col + static_cast<size_t>(cols) * p.seg[e], r0, c0, pad, cols);
      __syncthreads();  // the next tile overwrites the shared tile
    }
  }
  if (AMAX) block_amax(local, amax);
}

// Any shape and alignment: one element of the padded rows per thread and step.
template <class In, Format F, bool ROW, bool COL, bool AMAX>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_grouped_any(const In* __restrict__ x, const std::int32_t* __restrict__ plan,
                               std::uint8_t* __restrict__ row, std::uint8_t* __restrict__ col,
                               const float* __restrict__ scale_ptr, float* amax, int experts, long long padded_rows,
                               long long cols) {
  const float scale = *scale_ptr;
  const Plan p(plan, experts);
  const long long n = padded_rows * cols;
  unsigned local = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long vr = i / cols, c = i % cols;
    const int e = expert_at(p.seg, experts, vr);
    const long long r = vr - p.seg[e], begin = p.begin[e], count = p.begin[e + 1] - begin, pad = p.seg[e + 1] - p.seg[e];
    const float v = r < count ? load1(x, (begin + r) * cols + c) : 0.0f;
    const std::uint8_t q = cvt1<F>(__fmul_rn(v, scale));
    if (ROW && r < count) row[(begin + r) * cols + c] = q;
    if (COL) col[cols * p.seg[e] + c * pad + r] = q;
    if (AMAX) local = max(local, abs_bits(v));
  }
  if (AMAX) block_amax(local, amax);
}

unsigned grid_for(long long work) {
  return static_cast<unsigned>(std::clamp<long long>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

template <class In, Format F, bool ROW, bool COL, bool AMAX>
void launch_grouped(const GroupedCast& a, cudaStream_t s) {
  const In* x = static_cast<const In*>(a.x);
  const bool tiled = a.tiled && a.cols % 16 == 0 && a.cols <= 0x7fffffff && a.tiles <= 0x7fffffff && aligned16(x) &&
                     (!ROW || aligned16(a.rowwise)) && (!COL || aligned16(a.colwise));
  if (tiled) {
    const auto grid = static_cast<unsigned>(std::clamp<long long>(a.tiles, 1, kMaxBlocks));
    cast_transpose_grouped_tiled<In, F, ROW, COL, AMAX><<<grid, kThreads, 0, s>>>(
        x, a.plan, a.rowwise, a.colwise, a.scale, a.amax, a.experts, static_cast<int>(a.tiles), static_cast<int>(a.cols));
  } else {
    cast_transpose_grouped_any<In, F, ROW, COL, AMAX><<<grid_for(a.padded_rows * a.cols), kThreads, 0, s>>>(
        x, a.plan, a.rowwise, a.colwise, a.scale, a.amax, a.experts, a.padded_rows, a.cols);
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

std::vector<std::int32_t> grouped_cast_plan(const std::int32_t* offsets, int experts, std::int64_t rows_each,
                                            std::int64_t cols) {
  KILN_CHECK(experts > 0 && cols > 0, "fp8 grouped cast plan: ", experts, " experts of ", cols, " columns");
  const auto E = static_cast<std::size_t>(experts);
  std::vector<std::int32_t> plan(3 * (E + 1));
  std::int32_t *begin = plan.data(), *seg = begin + E + 1, *tile = seg + E + 1;
  const std::int64_t tiles_c = (cols + kTile - 1) / kTile;
  std::int64_t b = 0, g = 0, t = 0;
  for (int e = 0;; ++e) {
    KILN_CHECK(b <= 0x7fffffff && g <= 0x7fffffff && t <= 0x7fffffff, "fp8 grouped cast plan: ", b, " rows (", g,
               " padded) do not fit 32-bit ints");
    begin[e] = static_cast<std::int32_t>(b);
    seg[e] = static_cast<std::int32_t>(g);
    tile[e] = static_cast<std::int32_t>(t);
    if (e == experts) break;
    const std::int64_t rows = offsets ? offsets[e + 1] - offsets[e] : rows_each;
    const std::int64_t pad = offsets ? (rows + 15) / 16 * 16 : rows;
    b += rows;
    g += pad;
    t += (pad + kTile - 1) / kTile * tiles_c;
  }
  return plan;
}

void cast_transpose_grouped(const GroupedCast& a, cudaStream_t s) {
  KILN_CHECK(a.x_dtype == DType::bf16 || a.x_dtype == DType::f32,
             "fp8 cast_transpose_grouped: input must be bf16 or f32, not ", name_of(a.x_dtype));
  KILN_CHECK(a.experts >= 0 && a.used_rows >= 0 && a.padded_rows >= a.used_rows && a.cols >= 0 && a.scale,
             "fp8 cast_transpose_grouped: ", a.experts, " experts, ", a.used_rows, " rows (", a.padded_rows,
             " padded) of ", a.cols, " columns");
  if (a.experts == 0 || a.padded_rows == 0 || a.cols == 0) return;
  if (!a.rowwise && !a.colwise) {  // the amax alone: of the experts' rows, contiguous from row 0
    if (a.amax) amax(a.x, a.x_dtype, a.used_rows * a.cols, a.amax, s);
    return;
  }
  KILN_CHECK(a.plan, "fp8 cast_transpose_grouped: no plan");
  if (a.x_dtype == DType::bf16)
    grouped_with_format<bf16>(a, s);
  else
    grouped_with_format<float>(a, s);
}

}  // namespace kiln::fp8::cuda
