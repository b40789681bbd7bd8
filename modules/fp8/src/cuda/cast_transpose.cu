// Quantisation kernels: the fused cast + transpose + amax, the amax reduction for current scaling,
// the scale computation, and dequantisation (for tests).
//
// The tiled kernel: a block of 256 threads handles 64 x 64 tiles. Load phase: each thread reads 16
// consecutive elements of one row (2 x 16 bytes of bf16), converts them with the hardware's
// saturating round-to-nearest-even (cvt.rn.satfinite.e4m3x2/e5m2x2.f32, two values per
// instruction), stores the 16 codes rowwise as one 16-byte word and into a shared tile. Transpose
// phase: each thread gathers 16 consecutive rows of one column from the tile and stores them
// colwise as one 16-byte word; 4 consecutive threads write one 64-byte column segment.
// The amax is a max over |x| bit patterns (NaN-propagating, order-free, so atomicMax keeps the
// result deterministic): per thread, warp, block, then one atomic per block.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "loads.cuh"
#include "tiles.cuh"

namespace kiln::fp8::cuda {

namespace {

template <class In, Format F, bool ROW, bool COL, bool AMAX, class Load>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_tiled(const In* __restrict__ x, std::uint8_t* __restrict__ row, std::uint8_t* __restrict__ col,
                         const float* __restrict__ scale_ptr, float* amax, int rows, int cols, Load op) {
  __shared__ __align__(16) std::uint8_t tile[kTile * kStride];
  const float scale = *scale_ptr;
  const int tiles_c = (cols + kTile - 1) / kTile;
  const long long tiles = static_cast<long long>((rows + kTile - 1) / kTile) * tiles_c;
  const int lr = threadIdx.x / 4, lv = threadIdx.x % 4;  // load: tile row, 16-column group
  unsigned local = 0;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int r0 = static_cast<int>(t / tiles_c) * kTile, c0 = static_cast<int>(t % tiles_c) * kTile;
    const int gr = r0 + lr, gc = c0 + lv * 16;
    if (gr < rows && gc < cols) {
      float v[16];
      if constexpr (Load::kLoadsItself) {
        op.load(v, gr, gc);
      } else {
        load16(x + static_cast<size_t>(gr) * cols + gc, v);
        op(v, gr, gc);
      }
      std::uint32_t w[4];
      encode16<F>(v, scale, w);
      if (AMAX)
#pragma unroll
        for (int i = 0; i < 16; ++i) local = max(local, abs_bits(v[i]));
      if (ROW)
        *reinterpret_cast<uint4*>(row + static_cast<size_t>(gr) * cols + gc) = make_uint4(w[0], w[1], w[2], w[3]);
      if (COL) stage_codes(tile, w);
    }
    if (COL) {
      __syncthreads();
      store_transposed(tile, col, r0, c0, rows, cols);
      __syncthreads();  // the next tile overwrites the shared tile
    }
  }
  if (AMAX) block_amax(local, amax);
}

// The cross-entropy gradient of an LM head's logits (ops::XentOnLoad), as xent_grad writes it.
struct XentRows {
  const float* lse;
  const std::int32_t* targets;
  long long vocab_begin;
  long long real_cols;
  float dloss;
  __device__ float at(float x, int r, int c) const {
    const int t = targets[r];
    if (t < 0 || c >= real_cols) return 0.0f;
    return ops::xent_grad(x, lse[r], c == t - vocab_begin, dloss);
  }
};

// The gradient variant (GradQuantizeArgs): bf16 dy, optionally (MODE kDgelu) times gelu'(pre) or
// (kXent: dy the logits) their cross-entropy gradient, rounded to bf16 as the unfused ops store them,
// both copies, and with DBIAS each tile's column sums into partial[r0 / 64][c] (f32, a fixed
// summation order: 8 rows per warp by shuffles, then the 8 warps in order), which
// bias_partials_finish adds up over the row tiles in a fixed order.
enum GradMode { kPlainGrad, kDgelu, kXent };
template <Format F, bool AMAX, bool DBIAS, GradMode MODE>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_grad_tiled(const bf16* __restrict__ x, const bf16* __restrict__ pre, std::uint8_t* __restrict__ row,
                              std::uint8_t* __restrict__ col, const float* __restrict__ scale_ptr, float* amax,
                              float* __restrict__ partial, int rows, int cols, XentRows xent) {
  __shared__ __align__(16) std::uint8_t tile[kTile * kStride];
  __shared__ float colsum[DBIAS ? kThreads / 32 : 1][kTile];
  const float scale = *scale_ptr;
  const int tiles_c = (cols + kTile - 1) / kTile;
  const long long tiles = static_cast<long long>((rows + kTile - 1) / kTile) * tiles_c;
  const int lr = threadIdx.x / 4, lv = threadIdx.x % 4;
  unsigned local = 0;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int r0 = static_cast<int>(t / tiles_c) * kTile, c0 = static_cast<int>(t % tiles_c) * kTile;
    const int gr = r0 + lr, gc = c0 + lv * 16;
    float v[16];
    if (gr < rows && gc < cols) {
      const size_t at = static_cast<size_t>(gr) * cols + gc;
      load16(x + at, v);
      if (MODE == kXent) {
#pragma unroll
        for (int i = 0; i < 16; i += 2) {
          v[i] = xent.at(v[i], gr, gc + i);
          v[i + 1] = xent.at(v[i + 1], gr, gc + i + 1);
          act_round2(v[i], v[i + 1]);
        }
      }
      if (MODE == kDgelu) {
        float p[16];
        load16(pre + at, p);
#pragma unroll
        for (int i = 0; i < 16; i += 2) {
          v[i] *= ops::gelu_grad(p[i]);
          v[i + 1] *= ops::gelu_grad(p[i + 1]);
          act_round2(v[i], v[i + 1]);
        }
      }
      std::uint32_t w[4];
      encode16<F>(v, scale, w);
      if (AMAX)
#pragma unroll
        for (int i = 0; i < 16; ++i) local = max(local, abs_bits(v[i]));
      *reinterpret_cast<uint4*>(row + at) = make_uint4(w[0], w[1], w[2], w[3]);
      stage_codes(tile, w);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = 0.0f;
    }
    if (DBIAS) {  // lanes 4k + lv of a warp hold rows k = 0..7 of the same 16 columns
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        v[i] += __shfl_xor_sync(0xffffffffu, v[i], 4);
        v[i] += __shfl_xor_sync(0xffffffffu, v[i], 8);
        v[i] += __shfl_xor_sync(0xffffffffu, v[i], 16);
      }
      if ((threadIdx.x & 31) < 4)
#pragma unroll
        for (int i = 0; i < 16; ++i) colsum[threadIdx.x / 32][lv * 16 + i] = v[i];
    }
    __syncthreads();
    store_transposed(tile, col, r0, c0, rows, cols);
    if (DBIAS && threadIdx.x < kTile && c0 + threadIdx.x < cols) {
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) s += colsum[w][threadIdx.x];
      partial[static_cast<size_t>(r0 / kTile) * cols + c0 + threadIdx.x] = s;
    }
    __syncthreads();
  }
  if (AMAX) block_amax(local, amax);
}

// dbias[c] += sum over the row tiles of partial[t][c], in a fixed order: a block of 256 threads
// takes 32 columns; its 8 warps sum interleaved row tiles (warp w: tiles w, w + 8, ...) in order,
// then one thread per column adds the 8 sums in order. Enough blocks to load the whole GPU where
// one thread per column would leave most SMs idle.
// G: the gradient's type, float or bf16 (the total added in f32, stored once).
constexpr int kFinishCols = 32, kFinishParts = kThreads / kFinishCols;
__device__ __forceinline__ float grad_value(const float* p) { return *p; }
__device__ __forceinline__ float grad_value(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void grad_put(float* p, float v) { *p = v; }
__device__ __forceinline__ void grad_put(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
template <class G>
__global__ void __launch_bounds__(kThreads)
    bias_partials_finish(G* __restrict__ dbias, const float* __restrict__ partial, int row_tiles, int cols) {
  __shared__ float part[kFinishParts][kFinishCols];
  const int lc = threadIdx.x % kFinishCols, w = threadIdx.x / kFinishCols;
  const int c = blockIdx.x * kFinishCols + lc;
  float s = 0.0f;
  if (c < cols)
    for (int t = w; t < row_tiles; t += kFinishParts) s += partial[static_cast<size_t>(t) * cols + c];
  part[w][lc] = s;
  __syncthreads();
  if (w == 0 && c < cols) {
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < kFinishParts; ++k) total += part[k][lc];
    grad_put(dbias + c, grad_value(dbias + c) + total);
  }
}

// Any shape and alignment: one element per thread and step.
template <class In, Format F, bool ROW, bool COL, bool AMAX, class Load>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_any(const In* __restrict__ x, std::uint8_t* __restrict__ row, std::uint8_t* __restrict__ col,
                       const float* __restrict__ scale_ptr, float* amax, long long rows, long long cols, Load op) {
  const float scale = *scale_ptr;
  const long long n = rows * cols;
  unsigned local = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    float v;
    if constexpr (Load::kLoadsItself)
      v = op.at(i / cols, i % cols);
    else
      v = op(load1(x, i), i / cols, i % cols);
    const std::uint8_t q = cvt1<F>(__fmul_rn(v, scale));
    if (ROW) row[i] = q;
    if (COL) col[(i % cols) * rows + i / cols] = q;
    if (AMAX) local = max(local, abs_bits(v));
  }
  if (AMAX) block_amax(local, amax);
}

template <class In>
__global__ void __launch_bounds__(kThreads) amax_kernel(const In* __restrict__ x, long long n, bool vec, float* amax) {
  constexpr int V = 16 / sizeof(In);  // elements per 16-byte word
  const long long nv = vec ? n / V : 0;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  const long long tid = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  unsigned local = 0;
  for (long long i = tid; i < nv; i += stride) {
    const uint4 u = reinterpret_cast<const uint4*>(x)[i];
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (sizeof(In) == 2) {  // two bf16: their f32 bit patterns are the high halves
        local = max(local, (w[j] << 16) & 0x7fffffffu);
        local = max(local, w[j] & 0x7fff0000u);
      } else {
        local = max(local, w[j] & 0x7fffffffu);
      }
    }
  }
  for (long long i = nv * V + tid; i < n; i += stride) local = max(local, abs_bits(load1(x, i)));
  block_amax(local, amax);
}

__global__ void scale_from_amax_kernel(const float* amax, float* scale, float* scale_inv, float fp8_max, int margin) {
  const float s = compute_scale(fp8_max, *amax, margin, *scale);
  *scale = s;
  *scale_inv = reciprocal(s);
}

template <Format F>
__global__ void dequantize_kernel(float* out, const std::uint8_t* q, long long n, const float* scale_inv) {
  const float si = *scale_inv;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    out[i] = __fmul_rn(decode(q[i], F), si);
}

unsigned grid_for(long long work) {
  return static_cast<unsigned>(std::clamp<long long>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

// Load = LayerNormLoad needs its weight and bias 16-byte aligned for the tiled kernel.
bool aligned_load(const PlainLoad&) { return true; }
bool aligned_load(const GeluLoad&) { return true; }
bool aligned_load(const LayerNormLoad& l) { return aligned16(l.weight) && aligned16(l.bias); }
bool aligned_load(const SwigluLoad& l) { return aligned16(l.pre) && l.F % 8 == 0; }

template <class In, Format F, bool ROW, bool COL, bool AMAX, class Load>
void launch(const void* xv, std::uint8_t* row, std::uint8_t* col, const float* scale, float* amax, std::int64_t rows,
            std::int64_t cols, const Load& op, cudaStream_t s) {
  const In* x = static_cast<const In*>(xv);
  const bool tiled = rows % 16 == 0 && cols % 16 == 0 && rows <= 0x7fffffff && cols <= 0x7fffffff && aligned16(x) &&
                     (!ROW || aligned16(row)) && (!COL || aligned16(col)) && aligned_load(op);
  if (tiled) {
    const long long tiles = ((rows + kTile - 1) / kTile) * ((cols + kTile - 1) / kTile);
    const auto grid = static_cast<unsigned>(std::min<long long>(tiles, kMaxBlocks));
    cast_transpose_tiled<In, F, ROW, COL, AMAX, Load>
        <<<grid, kThreads, 0, s>>>(x, row, col, scale, amax, static_cast<int>(rows), static_cast<int>(cols), op);
  } else {
    cast_transpose_any<In, F, ROW, COL, AMAX, Load>
        <<<grid_for(rows * cols), kThreads, 0, s>>>(x, row, col, scale, amax, rows, cols, op);
  }
  KILN_CUDA_LAUNCH_CHECK();
}

template <class In, Format F, bool ROW, bool COL, class Load>
void with_amax(const void* x, std::uint8_t* row, std::uint8_t* col, const float* scale, float* amax, std::int64_t rows,
               std::int64_t cols, const Load& op, cudaStream_t s) {
  if (amax)
    launch<In, F, ROW, COL, true>(x, row, col, scale, amax, rows, cols, op, s);
  else
    launch<In, F, ROW, COL, false>(x, row, col, scale, amax, rows, cols, op, s);
}

template <class In, Format F, class Load>
void with_copies(const void* x, std::uint8_t* row, std::uint8_t* col, const float* scale, float* amax,
                 std::int64_t rows, std::int64_t cols, const Load& op, cudaStream_t s) {
  if (row && col)
    with_amax<In, F, true, true>(x, row, col, scale, amax, rows, cols, op, s);
  else if (row)
    with_amax<In, F, true, false>(x, row, col, scale, amax, rows, cols, op, s);
  else if (col)
    with_amax<In, F, false, true>(x, row, col, scale, amax, rows, cols, op, s);
  else if (amax)  // the amax alone of the loaded values (of plain values the amax kernel finds it)
    launch<In, F, false, false, true>(x, row, col, scale, amax, rows, cols, op, s);
}

template <class In, class Load = PlainLoad>
void with_format(const void* x, std::uint8_t* row, std::uint8_t* col, Format f, const float* scale, float* amax,
                 std::int64_t rows, std::int64_t cols, cudaStream_t s, const Load& op = {}) {
  if (f == Format::e4m3)
    with_copies<In, Format::e4m3>(x, row, col, scale, amax, rows, cols, op, s);
  else
    with_copies<In, Format::e5m2>(x, row, col, scale, amax, rows, cols, op, s);
}

void check_input(DType t, const char* what) {
  KILN_CHECK(t == DType::bf16 || t == DType::f32, what, ": input must be bf16 or f32, not ", name_of(t));
}

}  // namespace

void cast_transpose(const void* x, DType x_dtype, std::uint8_t* rowwise, std::uint8_t* colwise, Format f,
                    const float* scale, float* amax, std::int64_t rows, std::int64_t cols, cudaStream_t s) {
  check_input(x_dtype, "fp8 cast_transpose");
  KILN_CHECK(rows >= 0 && cols >= 0 && scale, "fp8 cast_transpose: [", rows, ",", cols, "]");
  if (rows == 0 || cols == 0 || (!rowwise && !colwise && !amax)) return;
  if (!rowwise && !colwise) {
    fp8::cuda::amax(x, x_dtype, rows * cols, amax, s);
    return;
  }
  if (x_dtype == DType::bf16)
    with_format<bf16>(x, rowwise, colwise, f, scale, amax, rows, cols, s);
  else
    with_format<float>(x, rowwise, colwise, f, scale, amax, rows, cols, s);
}

std::int64_t grad_partials(std::int64_t rows, std::int64_t cols) { return (rows + kTile - 1) / kTile * cols; }

namespace {
template <Format F, bool AMAX, bool DBIAS>
void launch_grad(const CastTransposeGrad& a, cudaStream_t s) {
  const long long tiles = ((a.rows + kTile - 1) / kTile) * ((a.cols + kTile - 1) / kTile);
  const auto grid = static_cast<unsigned>(std::min<long long>(tiles, kMaxBlocks));
  const auto r = static_cast<int>(a.rows), c = static_cast<int>(a.cols);
  const XentRows xent{a.lse, a.targets, a.vocab_begin, a.real_cols, a.dloss};
  if (a.lse) {
    if constexpr (!DBIAS)
      cast_transpose_grad_tiled<F, AMAX, false, kXent>
          <<<grid, kThreads, 0, s>>>(a.dy, nullptr, a.rowwise, a.colwise, a.scale, a.amax, nullptr, r, c, xent);
  } else if (a.gelu_pre) {
    cast_transpose_grad_tiled<F, AMAX, DBIAS, kDgelu>
        <<<grid, kThreads, 0, s>>>(a.dy, a.gelu_pre, a.rowwise, a.colwise, a.scale, a.amax, a.partial, r, c, xent);
  } else {
    cast_transpose_grad_tiled<F, AMAX, DBIAS, kPlainGrad>
        <<<grid, kThreads, 0, s>>>(a.dy, a.gelu_pre, a.rowwise, a.colwise, a.scale, a.amax, a.partial, r, c, xent);
  }
  KILN_CUDA_LAUNCH_CHECK();
}
template <Format F>
void grad_with_flags(const CastTransposeGrad& a, cudaStream_t s) {
  const bool dbias = a.dbias || a.dbias_bf16;  // the column sums go to partial either way
  if (a.amax)
    dbias ? launch_grad<F, true, true>(a, s) : launch_grad<F, true, false>(a, s);
  else
    dbias ? launch_grad<F, false, true>(a, s) : launch_grad<F, false, false>(a, s);
}
}  // namespace

namespace {
__global__ void xent_grad_kernel(bf16* logits, XentRows xent, long long rows, long long cols) {
  const long long n = rows * cols;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(i / cols), c = static_cast<int>(i % cols);
    logits[i] = __float2bfloat16_rn(xent.at(__bfloat162float(logits[i]), r, c));
  }
}
}  // namespace

void xent_grad(__nv_bfloat16* logits, const float* lse, const std::int32_t* targets, std::int64_t vocab_begin,
               std::int64_t real_cols, float dloss, std::int64_t rows, std::int64_t cols, cudaStream_t s) {
  KILN_CHECK(rows >= 0 && cols >= 0 && rows <= 0x7fffffff && cols <= 0x7fffffff && lse && targets,
             "fp8 xent_grad: [", rows, ",", cols, "]");
  if (rows == 0 || cols == 0) return;
  const long long blocks = std::min<long long>((rows * cols + kThreads - 1) / kThreads, kMaxBlocks);
  xent_grad_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
      logits, XentRows{lse, targets, vocab_begin, real_cols, dloss}, rows, cols);
  KILN_CUDA_LAUNCH_CHECK();
}

namespace {
template <class G>
void finish_bias(G* dbias, const float* partial, std::int64_t row_tiles, std::int64_t cols, cudaStream_t s) {
  KILN_CHECK(row_tiles <= 0x7fffffff && cols <= 0x7fffffff, "fp8 bias_from_partials: [", row_tiles, ",", cols, "]");
  if (row_tiles <= 0 || cols <= 0) return;
  const int c = static_cast<int>(cols);
  bias_partials_finish<G>
      <<<(c + kFinishCols - 1) / kFinishCols, kThreads, 0, s>>>(dbias, partial, static_cast<int>(row_tiles), c);
  KILN_CUDA_LAUNCH_CHECK();
}
}  // namespace

void bias_from_partials(float* dbias, const float* partial, std::int64_t row_tiles, std::int64_t cols, cudaStream_t s) {
  finish_bias(dbias, partial, row_tiles, cols, s);
}

void bias_from_partials(__nv_bfloat16* dbias, const float* partial, std::int64_t row_tiles, std::int64_t cols,
                        cudaStream_t s) {
  finish_bias(dbias, partial, row_tiles, cols, s);
}

bool cast_transpose_grad(const CastTransposeGrad& a, cudaStream_t s) {
  KILN_CHECK(a.rows >= 0 && a.cols >= 0 && a.scale && a.rowwise && a.colwise, "fp8 cast_transpose_grad: [", a.rows,
             ",", a.cols, "]");
  if (a.rows == 0 || a.cols == 0) return true;
  const bool tiled = a.rows % 16 == 0 && a.cols % 16 == 0 && a.rows <= 0x7fffffff && a.cols <= 0x7fffffff &&
                     aligned16(a.dy) && (!a.gelu_pre || aligned16(a.gelu_pre)) && aligned16(a.rowwise) &&
                     aligned16(a.colwise);
  if (!tiled) return false;
  KILN_CHECK(!(a.dbias && a.dbias_bf16), "fp8 cast_transpose_grad: dbias and dbias_bf16 both given (one gradient)");
  KILN_CHECK((!a.dbias && !a.dbias_bf16) || a.partial, "fp8 cast_transpose_grad: dbias without partial-sum scratch");
  KILN_CHECK(!a.lse || (a.targets && !a.gelu_pre && !a.dbias && !a.dbias_bf16),
             "fp8 cast_transpose_grad: a cross-entropy gradient needs its targets, and no dGELU or bias");
  if (a.format == Format::e4m3)
    grad_with_flags<Format::e4m3>(a, s);
  else
    grad_with_flags<Format::e5m2>(a, s);
  if (a.dbias) bias_from_partials(a.dbias, a.partial, (a.rows + kTile - 1) / kTile, a.cols, s);
  if (a.dbias_bf16) bias_from_partials(a.dbias_bf16, a.partial, (a.rows + kTile - 1) / kTile, a.cols, s);
  return true;
}

void cast_transpose_gelu(const __nv_bfloat16* pre, std::uint8_t* rowwise, std::uint8_t* colwise, Format f,
                         const float* scale, float* amax, std::int64_t rows, std::int64_t cols, cudaStream_t s) {
  KILN_CHECK(rows >= 0 && cols >= 0 && scale, "fp8 cast_transpose_gelu: [", rows, ",", cols, "]");
  if (rows == 0 || cols == 0 || (!rowwise && !colwise && !amax)) return;
  with_format<bf16>(pre, rowwise, colwise, f, scale, amax, rows, cols, s, GeluLoad{});
}

void cast_transpose_swiglu(const __nv_bfloat16* pre, std::uint8_t* rowwise, std::uint8_t* colwise, Format f,
                           const float* scale, float* amax, std::int64_t rows, std::int64_t cols, cudaStream_t s) {
  KILN_CHECK(rows >= 0 && cols >= 0 && scale && pre, "fp8 cast_transpose_swiglu: [", rows, ",", cols, "]");
  if (rows == 0 || cols == 0 || (!rowwise && !colwise && !amax)) return;
  with_format<bf16>(pre, rowwise, colwise, f, scale, amax, rows, cols, s, SwigluLoad{pre, cols});
}

void cast_transpose_layernorm(const LayerNormOfDev& ln, std::uint8_t* rowwise, std::uint8_t* colwise, Format f,
                              const float* scale, float* amax, std::int64_t rows, std::int64_t cols, cudaStream_t s) {
  KILN_CHECK(rows >= 0 && cols >= 0 && scale && ln.x && ln.mean && ln.rstd && ln.weight && ln.bias,
             "fp8 cast_transpose_layernorm: [", rows, ",", cols, "]");
  if (rows == 0 || cols == 0 || (!rowwise && !colwise && !amax)) return;
  with_format<bf16>(ln.x, rowwise, colwise, f, scale, amax, rows, cols, s,
                    LayerNormLoad{ln.mean, ln.rstd, ln.weight, ln.bias});
}

void amax(const void* x, DType x_dtype, std::int64_t n, float* amax, cudaStream_t s) {
  check_input(x_dtype, "fp8 amax");
  if (n <= 0) return;
  const bool vec = aligned16(x);
  const std::int64_t words = x_dtype == DType::bf16 ? n / 8 : n / 4;
  const unsigned grid = grid_for(std::max<long long>(words, 1));
  if (x_dtype == DType::bf16)
    amax_kernel<bf16><<<grid, kThreads, 0, s>>>(static_cast<const bf16*>(x), n, vec, amax);
  else
    amax_kernel<float><<<grid, kThreads, 0, s>>>(static_cast<const float*>(x), n, vec, amax);
  KILN_CUDA_LAUNCH_CHECK();
}

void scale_from_amax(const float* amax, float* scale, float* scale_inv, float fp8_max, int margin, cudaStream_t s) {
  scale_from_amax_kernel<<<1, 1, 0, s>>>(amax, scale, scale_inv, fp8_max, margin);
  KILN_CUDA_LAUNCH_CHECK();
}

void dequantize(float* out, const std::uint8_t* q, Format f, std::int64_t n, const float* scale_inv, cudaStream_t s) {
  if (n <= 0) return;
  if (f == Format::e4m3)
    dequantize_kernel<Format::e4m3><<<grid_for(n), kThreads, 0, s>>>(out, q, n, scale_inv);
  else
    dequantize_kernel<Format::e5m2><<<grid_for(n), kThreads, 0, s>>>(out, q, n, scale_inv);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::fp8::cuda
