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
#include "loads.cuh"
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

// The tiles cover the loaded columns (`cols`); a Load with two outputs (DswigluLoad) writes columns
// c and cols + c of rows 2 cols wide from the load of column c.
template <class In, Format F, bool ROW, bool COL, bool AMAX, class Load>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_grouped_tiled(const In* __restrict__ x, const std::int32_t* __restrict__ plan,
                                 const __grid_constant__ InlinePlan inline_plan, std::uint8_t* __restrict__ row, std::uint8_t* __restrict__ col,
                                 const float* __restrict__ scale_ptr, float* amax, int experts, int tiles, int cols,
                                 Load op) {
  constexpr int kOut = Load::kOutputs;
  __shared__ __align__(16) std::uint8_t tile[kOut][kTile * kStride];
  const float scale = *scale_ptr;
  const Plan p(plan ? plan : inline_plan.v, experts);
  const int tiles_c = (cols + kTile - 1) / kTile;
  const long long out_cols = static_cast<long long>(kOut) * cols;
  const int lr = threadIdx.x / 4, lv = threadIdx.x % 4;
  unsigned local = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int e = expert_at(p.tile, experts, t), in_e = t - p.tile[e];
    const int r0 = (in_e / tiles_c) * kTile, c0 = (in_e % tiles_c) * kTile;
    const int gr = r0 + lr, gc = c0 + lv * 16;
    const int begin = p.begin[e], count = p.begin[e + 1] - begin, pad = p.seg[e + 1] - p.seg[e];
    if (gr < pad && gc < cols) {
      float v[kOut][16];
      if (gr < count) {
        if constexpr (kOut == 2) {
          op.load(v, begin + gr, gc);
        } else if constexpr (Load::kLoadsItself) {
          op.load(v[0], begin + gr, gc);
        } else {
          load16(x + static_cast<size_t>(begin + gr) * cols + gc, v[0]);
          op(v[0], begin + gr, gc);
        }
      } else {
#pragma unroll
        for (int o = 0; o < kOut; ++o)
#pragma unroll
          for (int i = 0; i < 16; ++i) v[o][i] = 0.0f;  // padding: encode(0 * scale), as the CPU writes it
      }
#pragma unroll
      for (int o = 0; o < kOut; ++o) {
        std::uint32_t w[4];
        encode16<F>(v[o], scale, w);
        if (AMAX)
#pragma unroll
          for (int i = 0; i < 16; ++i) local = max(local, abs_bits(v[o][i]));
        if (ROW && gr < count)
          *reinterpret_cast<uint4*>(row + static_cast<size_t>(begin + gr) * out_cols + o * cols + gc) =
              make_uint4(w[0], w[1], w[2], w[3]);
        if (COL) stage_codes(tile[o], w);
      }
    }
    if (COL) {
      __syncthreads();
#pragma unroll
      for (int o = 0; o < kOut; ++o)
        store_transposed(tile[o], col + static_cast<size_t>(out_cols) * p.seg[e], r0, c0 + o * cols, pad,
                         (o + 1) * cols);
      __syncthreads();  // the next tile overwrites the shared tile
    }
  }
  if (AMAX) block_amax(local, amax);
}

// Any shape and alignment: one element of the padded rows (cols wide: the output's) per thread and step.
template <class In, Format F, bool ROW, bool COL, bool AMAX, class Load>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_grouped_any(const In* __restrict__ x, const std::int32_t* __restrict__ plan,
                               const __grid_constant__ InlinePlan inline_plan, std::uint8_t* __restrict__ row, std::uint8_t* __restrict__ col,
                               const float* __restrict__ scale_ptr, float* amax, int experts, long long padded_rows,
                               long long cols, Load op) {
  const float scale = *scale_ptr;
  const Plan p(plan ? plan : inline_plan.v, experts);
  const long long n = padded_rows * cols;
  unsigned local = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long vr = i / cols, c = i % cols;
    const int e = expert_at(p.seg, experts, vr);
    const long long r = vr - p.seg[e], begin = p.begin[e], count = p.begin[e + 1] - begin, pad = p.seg[e + 1] - p.seg[e];
    float v = 0.0f;
    if (r < count) {
      if constexpr (Load::kLoadsItself)
        v = op.at(begin + r, c);
      else
        v = op(load1(x, (begin + r) * cols + c), begin + r, c);
    }
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

// The tiled kernel's further needs of a Load: its own pointers 16-byte aligned, its column groups
// whole.
bool tiled_load(const PlainLoad&) { return true; }
bool tiled_load(const GeluLoad&) { return true; }
bool tiled_load(const SwigluLoad& l) { return aligned16(l.pre) && l.F % 16 == 0; }
bool tiled_load(const DgeluLoad& l) { return aligned16(l.dgelu) && aligned16(l.pre); }
bool tiled_load(const DswigluLoad& l) { return aligned16(l.dswiglu) && aligned16(l.gate_up) && l.F % 16 == 0; }

template <class In, Format F, bool ROW, bool COL, bool AMAX, class Load>
void launch_grouped(const GroupedCast& a, const Load& op, cudaStream_t s) {
  const In* x = static_cast<const In*>(a.x);
  const std::int64_t load_cols = a.cols / Load::kOutputs;
  const bool tiled = a.tiled && load_cols % 16 == 0 && a.cols <= 0x7fffffff && a.tiles <= 0x7fffffff &&
                     aligned16(x) && tiled_load(op) && (!ROW || aligned16(a.rowwise)) && (!COL || aligned16(a.colwise));
  if (tiled) {
    const auto grid = static_cast<unsigned>(std::clamp<long long>(a.tiles, 1, kMaxBlocks));
    cast_transpose_grouped_tiled<In, F, ROW, COL, AMAX, Load><<<grid, kThreads, 0, s>>>(
        x, a.plan, a.inline_plan, a.rowwise, a.colwise, a.scale, a.amax, a.experts, static_cast<int>(a.tiles),
        static_cast<int>(load_cols), op);
  } else {
    cast_transpose_grouped_any<In, F, ROW, COL, AMAX, Load><<<grid_for(a.padded_rows * a.cols), kThreads, 0, s>>>(
        x, a.plan, a.inline_plan, a.rowwise, a.colwise, a.scale, a.amax, a.experts, a.padded_rows, a.cols, op);
  }
  KILN_CUDA_LAUNCH_CHECK();
}

template <class In, Format F, bool ROW, bool COL, class Load>
void grouped_with_amax(const GroupedCast& a, const Load& op, cudaStream_t s) {
  if (a.amax)
    launch_grouped<In, F, ROW, COL, true>(a, op, s);
  else
    launch_grouped<In, F, ROW, COL, false>(a, op, s);
}

template <class In, Format F, class Load>
void grouped_with_copies(const GroupedCast& a, const Load& op, cudaStream_t s) {
  if (a.rowwise && a.colwise)
    grouped_with_amax<In, F, true, true>(a, op, s);
  else if (a.rowwise)
    grouped_with_amax<In, F, true, false>(a, op, s);
  else if (a.colwise)
    grouped_with_amax<In, F, false, true>(a, op, s);
  else  // the amax alone of the loaded values
    launch_grouped<In, F, false, false, true>(a, op, s);
}

template <class In, class Load = PlainLoad>
void grouped_with_format(const GroupedCast& a, cudaStream_t s, const Load& op = {}) {
  if (a.format == Format::e4m3)
    grouped_with_copies<In, Format::e4m3>(a, op, s);
  else
    grouped_with_copies<In, Format::e5m2>(a, op, s);
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
  KILN_CHECK(a.x_dtype == DType::bf16 || (a.x_dtype == DType::f32 && a.source == CastSource::plain),
             "fp8 cast_transpose_grouped: input must be bf16 (or f32 rows as they are), not ", name_of(a.x_dtype));
  KILN_CHECK(a.experts >= 0 && a.used_rows >= 0 && a.padded_rows >= a.used_rows && a.cols >= 0 && a.scale &&
                 (a.source != CastSource::dswiglu || a.cols % 2 == 0) &&
                 (a.grad || (a.source != CastSource::dgelu && a.source != CastSource::dswiglu)),
             "fp8 cast_transpose_grouped: ", a.experts, " experts, ", a.used_rows, " rows (", a.padded_rows,
             " padded) of ", a.cols, " columns");
  if (a.experts == 0 || a.padded_rows == 0 || a.cols == 0) return;
  if (!a.rowwise && !a.colwise && a.source == CastSource::plain) {  // the amax alone: of the rows used
    if (a.amax) amax(a.x, a.x_dtype, a.used_rows * a.cols, a.amax, s);
    return;
  }
  if (!a.rowwise && !a.colwise && !a.amax) return;
  KILN_CHECK(a.plan || a.experts <= kInlinePlanExperts, "fp8 cast_transpose_grouped: no plan");
  const auto* x = static_cast<const bf16*>(a.x);
  const auto* grad = static_cast<const bf16*>(a.grad);
  switch (a.source) {
    case CastSource::plain:
      if (a.x_dtype == DType::bf16)
        grouped_with_format<bf16>(a, s);
      else
        grouped_with_format<float>(a, s);
      return;
    case CastSource::gelu: grouped_with_format<bf16>(a, s, GeluLoad{}); return;
    case CastSource::swiglu: grouped_with_format<bf16>(a, s, SwigluLoad{x, a.cols}); return;
    case CastSource::dgelu: grouped_with_format<bf16>(a, s, DgeluLoad{grad, x, a.cols}); return;
    case CastSource::dswiglu: grouped_with_format<bf16>(a, s, DswigluLoad{grad, x, a.cols / 2}); return;
  }
}

}  // namespace kiln::fp8::cuda
