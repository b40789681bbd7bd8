#pragma once
// The sources of block.cu's quantisation kernels: what a tile's values are as they are loaded (a
// tensor, a load of loads.cuh on x or on its own tensors, the optimizer's step of an f32 master).
// Internal to kiln::fp8's CUDA sources, like tiles.cuh.
#include <cuda_bf16.h>

#include <cstdint>

#include "kiln/ops/cuda/moments.cuh"
#include "kiln/ops/grads.hpp"
#include "kiln/ops/moments.hpp"
#include "adamw.cuh"
#include "loads.cuh"
#include "tiles.cuh"

namespace kiln::fp8::cuda {
namespace {

// The sources of the staged values: load(v, r, c) gives kVec consecutive columns c.. of row r (c a
// multiple of kVec and c + kVec <= C: the vector path, each thread's kVec values 16 or 32 bytes of
// every tensor it reads, a warp's loads whole rows of the tile), at(r, c) one value.
template <typename T>
struct PlainSource {
  using Tile = T;
  static constexpr int kVec = 16 / sizeof(T);  // one 16-byte load
  const T* x;
  long long C;
  __device__ void load(float (&v)[kVec], long long r, long long c) const {
    const uint4 raw = *reinterpret_cast<const uint4*>(x + r * C + c);
    if constexpr (sizeof(T) == 2) {
      const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[2 * i] = __uint_as_float(w[i] << 16);  // bf16 -> f32 is exact
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      }
    } else {
      v[0] = __uint_as_float(raw.x), v[1] = __uint_as_float(raw.y), v[2] = __uint_as_float(raw.z),
      v[3] = __uint_as_float(raw.w);
    }
  }
  __device__ float at(long long r, long long c) const { return load1(x, r * C + c); }
};
// x's values through an elementwise load of loads.cuh (GELU, LayerNorm), 16 at a time as those take them.
template <class L>
struct OnX {
  using Tile = bf16;
  static constexpr int kVec = 16;
  const bf16* x;
  long long C;
  L l;
  __device__ void load(float (&v)[kVec], long long r, long long c) const {
    cuda::load16(x + r * C + c, v);
    l(v, static_cast<int>(r), static_cast<int>(c));
  }
  __device__ float at(long long r, long long c) const { return l(load1(x, r * C + c), r, c); }
};
// A load of loads.cuh that reads its own tensors (SwiGLU, dGELU).
template <class L>
struct Own {
  using Tile = bf16;
  static constexpr int kVec = 16;
  L l;
  __device__ void load(float (&v)[kVec], long long r, long long c) const { l.load(v, r, static_cast<int>(c)); }
  __device__ float at(long long r, long long c) const { return l.at(r, c); }
};
// swiglu_backward's [rows, 2 F]: the gate's gradient columns, then the up's (the vector path needs F
// to be a multiple of 16, so that 16 columns lie in one half), each half computed alone (the up's
// reads neither the up values nor computes the gate's gradient).
struct DswigluSource {
  using Tile = bf16;
  static constexpr int kVec = 16;
  DswigluLoad l;
  __device__ void load(float (&v)[kVec], long long r, long long c) const {
    if (c >= l.F)
      l.load_up(v, r, static_cast<int>(c - l.F));
    else
      l.load_gate(v, r, static_cast<int>(c));
  }
  __device__ float at(long long r, long long c) const { return l.at(r, c); }
};

// The optimizer's step of an f32 master weight, applied as its values are loaded (each element once):
// param, m and v updated in place, the updated param staged (the param as it was where the step is
// skipped). Its codes are then the block quantisation of the updated weight. M: the moments' storage,
// G: the gradient's (each float, or std::uint16_t holding bf16 bits, read as f32 exactly).
template <class M, class G>
struct AdamWSource {
  using Tile = float;
  static constexpr int kVec = 4;  // one float4 of the master, four gradients and moments
  float* param;
  const G* grad;
  M* m;
  M* v;
  long long C;
  Hyper h;
  __device__ void load(float (&out)[kVec], long long r, long long c) const {
    Hyper hh = h;
    const long long at = r * C + c;
    // All four loads issued before the step's numbers are known (a skipped step reads g, m, v for nothing).
    float4 p4 = *reinterpret_cast<const float4*>(param + at);
    float g4[4], m4[4], v4[4];
    kiln::cuda::load4(grad + at, g4);
    kiln::cuda::load4(m + at, m4);
    kiln::cuda::load4(v + at, v4);
    if (step_numbers(hh)) {
      update4(p4, m4, v4, g4, hh);
      *reinterpret_cast<float4*>(param + at) = p4;
      kiln::cuda::store4(m + at, m4);
      kiln::cuda::store4(v + at, v4);
    }
    out[0] = p4.x, out[1] = p4.y, out[2] = p4.z, out[3] = p4.w;
  }
  __device__ float at(long long r, long long c) const {
    Hyper hh = h;
    const long long i = r * C + c;
    float p = param[i];
    if (step_numbers(hh)) {
      float mi = ops::moment_load(m, i), vi = ops::moment_load(v, i);
      update(p, mi, vi, ops::grad_load(grad, i), hh);
      param[i] = p;
      ops::moment_store(m, i, mi);
      ops::moment_store(v, i, vi);
    }
    return p;
  }
};

}  // namespace
}  // namespace kiln::fp8::cuda
