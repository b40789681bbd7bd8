// The optimizer's step and the weight quantisation in one pass (AdamWQuantize): per element
// ops::adamw_update of the f32 master, m and v, then the updated master's FP8 codes, rowwise and
// through the shared tile colwise, and its amax, exactly as cast_transpose would quantise the
// updated master (same scale, same hardware conversion). Rows may be `batch` stacked matrices (a
// mixture of experts' weights): the colwise copy is then each one's transpose, in one launch.
//
// The tiled kernel moves 30 bytes per element (param, grad, m, v read; param, m, v and both codes
// written; 22 with bf16 moments) where the unfused path moves 30 (AdamW with its bf16 copy) plus 6
// (the f32 master read again, both copies written). The moments are f32 or bf16 (M: float, or
// std::uint16_t holding bf16 bits; ops::moment_load / moment_store), and so is the gradient (G, the
// same two; ops::grad_load: a bf16 gradient gives the bits an f32 one of the same values gives).
#include <algorithm>

#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/ops/cuda/moments.cuh"
#include "kiln/ops/formulas.hpp"
#include "kiln/ops/grads.hpp"
#include "kiln/ops/moments.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "adamw.cuh"
#include "tiles.cuh"

namespace kiln::fp8::cuda {

namespace {

// The f32 arrays are read and written coalesced: in pass k = 0..3 thread t handles float4 column
// t % 16 of tile row 16 k + t / 16 (a warp covers two whole 256-byte rows) and leaves its 4 codes in
// the shared tile; both copies are then written from there (rowwise: 16 bytes of tile row t / 4 per
// thread; colwise: store_transposed).
template <Format F, bool QUANT, bool AMAX, class M, class G>
__global__ void __launch_bounds__(kThreads)
    adamw_quantize_tiled(float* __restrict__ param, const G* __restrict__ grad, M* __restrict__ m,
                         M* __restrict__ v, std::uint8_t* __restrict__ row, std::uint8_t* __restrict__ col,
                         const float* __restrict__ scale_ptr, float* amax, int rows, int cols, int per, Hyper h) {
  if (!step_numbers(h)) return;
  __shared__ __align__(16) std::uint8_t tile[kTile * kStride];
  const float scale = QUANT ? *scale_ptr : 0.0f;
  const int tiles_c = (cols + kTile - 1) / kTile;
  const long long tiles = static_cast<long long>((rows + kTile - 1) / kTile) * tiles_c;
  const int cr = threadIdx.x / 16, cq = threadIdx.x % 16;  // update: row in a 16-row band, float4 column
  const int lr = threadIdx.x / 4, lv = threadIdx.x % 4;    // rowwise store: tile row, 16-byte group
  unsigned local = 0;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int r0 = static_cast<int>(t / tiles_c) * kTile, c0 = static_cast<int>(t % tiles_c) * kTile;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int tr = 16 * k + cr, r = r0 + tr, c = c0 + 4 * cq;
      if (r >= rows || c >= cols) continue;  // cols % 16 == 0: a float4 is all in or all out
      const size_t at = static_cast<size_t>(r) * cols + c;
      float4 p4 = *reinterpret_cast<const float4*>(param + at);
      float g4[4], m4[4], v4[4];
      kiln::cuda::load4(grad + at, g4);
      kiln::cuda::load4(m + at, m4);
      kiln::cuda::load4(v + at, v4);
      update4(p4, m4, v4, g4, h);
      *reinterpret_cast<float4*>(param + at) = p4;
      kiln::cuda::store4(m + at, m4);
      kiln::cuda::store4(v + at, v4);
      if (QUANT) {
        *reinterpret_cast<std::uint32_t*>(tile + tr * kStride + 4 * cq) =
            cvt2<F>(__fmul_rn(p4.x, scale), __fmul_rn(p4.y, scale)) |
            (cvt2<F>(__fmul_rn(p4.z, scale), __fmul_rn(p4.w, scale)) << 16);
        if (AMAX)
          local = max(max(local, max(abs_bits(p4.x), abs_bits(p4.y))), max(abs_bits(p4.z), abs_bits(p4.w)));
      }
    }
    if (QUANT) {
      __syncthreads();
      const int gr = r0 + lr, gc = c0 + lv * 16;
      if (gr < rows && gc < cols) {
        const auto* src = reinterpret_cast<const std::uint32_t*>(tile + lr * kStride + lv * 16);
        *reinterpret_cast<uint4*>(row + static_cast<size_t>(gr) * cols + gc) = make_uint4(src[0], src[1], src[2], src[3]);
      }
      if (col) {
        if (per == rows) {
          store_transposed(tile, col, r0, c0, rows, cols);
        } else {  // stacked matrices of `per` rows, a multiple of 16: a thread's 16 rows are in one
          const int tc = threadIdx.x / 4, tv = threadIdx.x % 4;
          const int oc = c0 + tc, orow = r0 + tv * 16;
          if (oc < cols && orow < rows) {
            const int b = orow / per;
            *reinterpret_cast<uint4*>(col + static_cast<size_t>(b) * per * cols + static_cast<size_t>(oc) * per +
                                      (orow - b * per)) = transposed_word(tile, tc, tv);
          }
        }
      }
      __syncthreads();  // the next tile overwrites the shared tile
    }
  }
  if (AMAX) block_amax(local, amax);
}

// Any shape and alignment: one element per thread and step.
template <Format F, bool QUANT, bool AMAX, class M, class G>
__global__ void __launch_bounds__(kThreads)
    adamw_quantize_any(float* __restrict__ param, const G* __restrict__ grad, M* __restrict__ m,
                       M* __restrict__ v, std::uint8_t* __restrict__ row, std::uint8_t* __restrict__ col,
                       const float* __restrict__ scale_ptr, float* amax, long long rows, long long cols,
                       long long per, Hyper h) {
  if (!step_numbers(h)) return;
  const float scale = QUANT ? *scale_ptr : 0.0f;
  const long long n = rows * cols;
  unsigned local = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    float p = param[i], mi = ops::moment_load(m, i), vi = ops::moment_load(v, i);
    update(p, mi, vi, ops::grad_load(grad, i), h);
    param[i] = p;
    ops::moment_store(m, i, mi);
    ops::moment_store(v, i, vi);
    if (QUANT) {
      const std::uint8_t q = cvt1<F>(__fmul_rn(p, scale));
      row[i] = q;
      if (col) {  // matrix b's transpose: [cols, per] at b * per * cols
        const long long r = i / cols, b = r / per;
        col[b * per * cols + (i % cols) * per + (r - b * per)] = q;
      }
      if (AMAX) local = max(local, abs_bits(p));
    }
  }
  if (AMAX) block_amax(local, amax);
}

template <Format F, bool QUANT, bool AMAX, class M, class G>
void launch(const AdamWQuantizeDev& a, M* m, M* v, const G* grad, const Hyper& h, cudaStream_t s) {
  const long long per = a.rows / std::max<std::int64_t>(a.batch, 1);
  const bool tiled = a.rows % 16 == 0 && a.cols % 16 == 0 && per % 16 == 0 && a.rows <= 0x7fffffff && a.cols <= 0x7fffffff &&
                     aligned16(a.param) && aligned16(a.grad) && aligned16(a.m) && aligned16(a.v) &&
                     (!QUANT || (aligned16(a.rowwise) && (!a.colwise || aligned16(a.colwise))));
  if (tiled) {
    const long long tiles = ((a.rows + kTile - 1) / kTile) * ((a.cols + kTile - 1) / kTile);
    const auto grid = static_cast<unsigned>(std::min<long long>(tiles, kMaxBlocks));
    adamw_quantize_tiled<F, QUANT, AMAX><<<grid, kThreads, 0, s>>>(a.param, grad, m, v, a.rowwise, a.colwise,
                                                                   a.scale, a.amax, static_cast<int>(a.rows),
                                                                   static_cast<int>(a.cols), static_cast<int>(per), h);
  } else {
    const long long n = a.rows * a.cols;
    const auto grid = static_cast<unsigned>(std::clamp<long long>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
    adamw_quantize_any<F, QUANT, AMAX>
        <<<grid, kThreads, 0, s>>>(a.param, grad, m, v, a.rowwise, a.colwise, a.scale, a.amax, a.rows, a.cols, per,
                                   h);
  }
  KILN_CUDA_LAUNCH_CHECK();
}

template <Format F, class M, class G>
void with_flags(const AdamWQuantizeDev& a, M* m, M* v, const G* g, const Hyper& h, cudaStream_t s) {
  if (!a.rowwise)
    launch<F, false, false>(a, m, v, g, h, s);
  else if (a.amax)
    launch<F, true, true>(a, m, v, g, h, s);
  else
    launch<F, true, false>(a, m, v, g, h, s);
}

template <class M, class G>
void with_format(const AdamWQuantizeDev& a, M* m, M* v, const G* g, const Hyper& h, cudaStream_t s) {
  if (a.format == Format::e4m3)
    with_flags<Format::e4m3>(a, m, v, g, h, s);
  else
    with_flags<Format::e5m2>(a, m, v, g, h, s);
}

}  // namespace

void adamw_quantize(const AdamWQuantizeDev& a, cudaStream_t s) {
  KILN_CHECK(a.rows >= 0 && a.cols >= 0 && a.batch >= 1 && a.rows % a.batch == 0 && a.param && a.grad && a.m && a.v,
             "fp8 adamw_quantize: [", a.rows, ",", a.cols, "] in ", a.batch, " matrices");
  KILN_CHECK((a.rowwise || !a.colwise) && (!a.rowwise || a.scale), "fp8 adamw_quantize: the rowwise copy (and the "
             "colwise one) with a scale, or neither");
  if (a.rows == 0 || a.cols == 0) return;
  const Hyper h = hyper_of(a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_scale, a.step, a.scalars);
  ops::with_moments(a.bf16_moments, a.m, a.v, [&](auto* m, auto* v) {
    ops::with_grads(a.bf16_grad, a.grad, [&](auto* g) { with_format(a, m, v, g, h, s); });
  });
}

}  // namespace kiln::fp8::cuda
