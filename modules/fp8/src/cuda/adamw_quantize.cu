// The optimizer's step and the weight quantisation in one pass (AdamWQuantize): per element
// ops::adamw_update of the f32 master, m and v, then the updated master's FP8 codes, rowwise and
// through the shared tile colwise, and its amax, exactly as cast_transpose would quantise the
// updated master (same scale, same hardware conversion).
//
// The tiled kernel is cast_transpose_tiled with four f32 loads (param, grad, m, v: 4 x 64 bytes
// per thread) and three stores before the codes: 30 bytes per element where the unfused path
// moves 30 (AdamW with its bf16 copy) plus 6 (the f32 master read again, both copies written).
#include <algorithm>

#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "tiles.cuh"

namespace kiln::fp8::cuda {

namespace {

struct Hyper {
  float lr, beta1, beta2, eps, weight_decay, grad_scale, bc1, bc2;
};

__device__ __forceinline__ void store16(float* p, const float v[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
    reinterpret_cast<float4*>(p)[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
}

__device__ __forceinline__ void update(float& p, float& m, float& v, float g, const Hyper& h) {
  ops::adamw_update(p, m, v, g * h.grad_scale, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.bc1, h.bc2);
}

template <Format F, bool QUANT, bool AMAX>
__global__ void __launch_bounds__(kThreads)
    adamw_quantize_tiled(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ m,
                         float* __restrict__ v, std::uint8_t* __restrict__ row, std::uint8_t* __restrict__ col,
                         const float* __restrict__ scale_ptr, float* amax, int rows, int cols, Hyper h) {
  __shared__ __align__(16) std::uint8_t tile[kTile * kStride];
  const float scale = QUANT ? *scale_ptr : 0.0f;
  const int tiles_c = (cols + kTile - 1) / kTile;
  const long long tiles = static_cast<long long>((rows + kTile - 1) / kTile) * tiles_c;
  const int lr = threadIdx.x / 4, lv = threadIdx.x % 4;
  unsigned local = 0;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int r0 = static_cast<int>(t / tiles_c) * kTile, c0 = static_cast<int>(t % tiles_c) * kTile;
    const int gr = r0 + lr, gc = c0 + lv * 16;
    if (gr < rows && gc < cols) {
      const size_t at = static_cast<size_t>(gr) * cols + gc;
      float p[16], mm[16], vv[16];
      {
        float g[16];
        load16(param + at, p);
        load16(grad + at, g);
        load16(m + at, mm);
        load16(v + at, vv);
#pragma unroll
        for (int i = 0; i < 16; ++i) update(p[i], mm[i], vv[i], g[i], h);
      }
      store16(param + at, p);
      store16(m + at, mm);
      store16(v + at, vv);
      if (QUANT) {
        std::uint32_t w[4];
        encode16<F>(p, scale, w);
        if (AMAX)
#pragma unroll
          for (int i = 0; i < 16; ++i) local = max(local, abs_bits(p[i]));
        *reinterpret_cast<uint4*>(row + at) = make_uint4(w[0], w[1], w[2], w[3]);
        auto* dst = reinterpret_cast<std::uint32_t*>(tile + lr * kStride + lv * 16);
#pragma unroll
        for (int j = 0; j < 4; ++j) dst[j] = w[j];
      }
    }
    if (QUANT) {
      __syncthreads();
      store_transposed(tile, col, r0, c0, rows, cols);
      __syncthreads();
    }
  }
  if (AMAX) block_amax(local, amax);
}

// Any shape and alignment: one element per thread and step.
template <Format F, bool QUANT, bool AMAX>
__global__ void __launch_bounds__(kThreads)
    adamw_quantize_any(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ m,
                       float* __restrict__ v, std::uint8_t* __restrict__ row, std::uint8_t* __restrict__ col,
                       const float* __restrict__ scale_ptr, float* amax, long long rows, long long cols, Hyper h) {
  const float scale = QUANT ? *scale_ptr : 0.0f;
  const long long n = rows * cols;
  unsigned local = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    float p = param[i], mi = m[i], vi = v[i];
    update(p, mi, vi, grad[i], h);
    param[i] = p;
    m[i] = mi;
    v[i] = vi;
    if (QUANT) {
      const std::uint8_t q = cvt1<F>(__fmul_rn(p, scale));
      row[i] = q;
      col[(i % cols) * rows + i / cols] = q;
      if (AMAX) local = max(local, abs_bits(p));
    }
  }
  if (AMAX) block_amax(local, amax);
}

template <Format F, bool QUANT, bool AMAX>
void launch(const AdamWQuantizeDev& a, const Hyper& h, cudaStream_t s) {
  const bool tiled = a.rows % 16 == 0 && a.cols % 16 == 0 && a.rows <= 0x7fffffff && a.cols <= 0x7fffffff &&
                     aligned16(a.param) && aligned16(a.grad) && aligned16(a.m) && aligned16(a.v) &&
                     (!QUANT || (aligned16(a.rowwise) && aligned16(a.colwise)));
  if (tiled) {
    const long long tiles = ((a.rows + kTile - 1) / kTile) * ((a.cols + kTile - 1) / kTile);
    const auto grid = static_cast<unsigned>(std::min<long long>(tiles, kMaxBlocks));
    adamw_quantize_tiled<F, QUANT, AMAX><<<grid, kThreads, 0, s>>>(a.param, a.grad, a.m, a.v, a.rowwise, a.colwise,
                                                                   a.scale, a.amax, static_cast<int>(a.rows),
                                                                   static_cast<int>(a.cols), h);
  } else {
    const long long n = a.rows * a.cols;
    const auto grid = static_cast<unsigned>(std::clamp<long long>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
    adamw_quantize_any<F, QUANT, AMAX>
        <<<grid, kThreads, 0, s>>>(a.param, a.grad, a.m, a.v, a.rowwise, a.colwise, a.scale, a.amax, a.rows, a.cols, h);
  }
  KILN_CUDA_LAUNCH_CHECK();
}

template <Format F>
void with_flags(const AdamWQuantizeDev& a, const Hyper& h, cudaStream_t s) {
  if (!a.rowwise)
    launch<F, false, false>(a, h, s);
  else if (a.amax)
    launch<F, true, true>(a, h, s);
  else
    launch<F, true, false>(a, h, s);
}

}  // namespace

void adamw_quantize(const AdamWQuantizeDev& a, cudaStream_t s) {
  KILN_CHECK(a.rows >= 0 && a.cols >= 0 && a.param && a.grad && a.m && a.v, "fp8 adamw_quantize: [", a.rows, ",",
             a.cols, "]");
  KILN_CHECK(!a.rowwise == !a.colwise && (!a.rowwise || a.scale), "fp8 adamw_quantize: both FP8 copies and a "
             "scale, or neither");
  if (a.rows == 0 || a.cols == 0) return;
  float bc1 = 0, bc2 = 0;
  ops::adamw_bias_corrections(a.beta1, a.beta2, a.step, bc1, bc2);
  const Hyper h{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_scale, bc1, bc2};
  if (a.format == Format::e4m3)
    with_flags<Format::e4m3>(a, h, s);
  else
    with_flags<Format::e5m2>(a, h, s);
}

}  // namespace kiln::fp8::cuda
