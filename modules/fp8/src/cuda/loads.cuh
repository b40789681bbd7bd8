#pragma once
// What a quantising kernel applies to the values it loads (cast_transpose.cu, grouped.cu): the
// quantised values are the results, each rounded to bf16 exactly as the op that would otherwise
// store it rounds it (ops/formulas.hpp gives both the same formula), so the codes equal the unfused
// path's. Internal to kiln::fp8's CUDA sources, like tiles.cuh.
#include <cuda_bf16.h>

#include <cstdint>

#include "kiln/ops/formulas.hpp"
#include "tiles.cuh"

namespace kiln::fp8::cuda {
namespace {

__device__ __forceinline__ float act_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
// Two values rounded to bf16 (round to nearest even, as act_round) by one paired conversion.
__device__ __forceinline__ void act_round2(float& a, float& b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);  // a in the low half
  const std::uint32_t u = *reinterpret_cast<const std::uint32_t*>(&h);
  a = __uint_as_float(u << 16);
  b = __uint_as_float(u & 0xffff0000u);
}

// What a quantising kernel applies to the values it loads (the quantised values are the results):
// 16 consecutive columns gc.. of row gr in the tiled kernels, one element in the elementwise one.
// A Load with kLoadsItself reads its values from its own pointers (load(v, r, c) and at(r, c)) in
// place of the kernel's x.
struct PlainLoad {
  static constexpr bool kLoadsItself = false;
  static constexpr int kOutputs = 1;
  __device__ void operator()(float (&)[16], int, int) const {}
  __device__ float operator()(float v, long long, long long) const { return v; }
};
// act(gelu(v)), as the GELU kernels store it (bf16 round to nearest even).
struct GeluLoad {
  static constexpr bool kLoadsItself = false;
  static constexpr int kOutputs = 1;
  __device__ void operator()(float (&v)[16], int, int) const {
#pragma unroll
    for (int i = 0; i < 16; i += 2) {
      v[i] = ops::gelu(v[i]);
      v[i + 1] = ops::gelu(v[i + 1]);
      act_round2(v[i], v[i + 1]);
    }
  }
  __device__ float operator()(float v, long long, long long) const { return act_round(ops::gelu(v)); }
};
// act(LayerNorm(v)) with the forward's statistics, as the LayerNorm kernel stores it.
struct LayerNormLoad {
  static constexpr bool kLoadsItself = false;
  static constexpr int kOutputs = 1;
  const float* mean;
  const float* rstd;
  const bf16* weight;
  const bf16* bias;
  __device__ void operator()(float (&v)[16], int r, int c) const {
    const float m = mean[r], s = rstd[r];
    float w[16], b[16];
    load16(weight + c, w);
    load16(bias + c, b);
#pragma unroll
    for (int i = 0; i < 16; i += 2) {
      v[i] = ops::layernorm_apply(v[i], m, s, w[i], b[i]);
      v[i + 1] = ops::layernorm_apply(v[i + 1], m, s, w[i + 1], b[i + 1]);
      act_round2(v[i], v[i + 1]);
    }
  }
  __device__ float operator()(float v, long long r, long long c) const {
    return act_round(ops::layernorm_apply(v, mean[r], rstd[r], __bfloat162float(weight[c]), __bfloat162float(bias[c])));
  }
};

// act(silu(gate) * up) from pre [rows, 2 cols] (gate columns, then up columns), as the SwiGLU
// kernel stores it (bf16 round to nearest even).
struct SwigluLoad {
  static constexpr bool kLoadsItself = true;
  static constexpr int kOutputs = 1;
  const bf16* pre;
  long long F;  // the output's columns
  __device__ void load(float (&v)[16], int r, int c) const {
    float u[16];
    const bf16* row = pre + static_cast<size_t>(r) * 2 * F;
    load16(row + c, v);
    load16(row + F + c, u);
#pragma unroll
    for (int i = 0; i < 16; i += 2) {
      v[i] = ops::swiglu(v[i], u[i]);
      v[i + 1] = ops::swiglu(v[i + 1], u[i + 1]);
      act_round2(v[i], v[i + 1]);
    }
  }
  __device__ float at(long long r, long long c) const {
    const bf16* row = pre + r * 2 * F;
    return act_round(ops::swiglu(__bfloat162float(row[c]), __bfloat162float(row[F + c])));
  }
};

// act(dgelu * gelu'(pre)) from two tensors of the same shape, as gelu_backward stores it.
struct DgeluLoad {
  static constexpr bool kLoadsItself = true;
  static constexpr int kOutputs = 1;
  const bf16* dgelu;
  const bf16* pre;
  long long cols;
  __device__ void load(float (&v)[16], long long r, int c) const {
    float p[16];
    load16(dgelu + r * cols + c, v);
    load16(pre + r * cols + c, p);
#pragma unroll
    for (int i = 0; i < 16; i += 2) {
      v[i] *= ops::gelu_grad(p[i]);
      v[i + 1] *= ops::gelu_grad(p[i + 1]);
      act_round2(v[i], v[i + 1]);
    }
  }
  __device__ float at(long long r, long long c) const {
    const long long i = r * cols + c;
    return act_round(__bfloat162float(dgelu[i]) * ops::gelu_grad(__bfloat162float(pre[i])));
  }
};

// swiglu_backward's values [rows, 2 F] (the gate's gradient columns, then the up's) from the SwiGLU
// output's gradient dswiglu [rows, F] and its input gate_up [rows, 2 F]. Two outputs per load: the
// 16 loaded columns c.. give columns c.. (v[0]) and F + c.. (v[1]), so each input is read once.
struct DswigluLoad {
  static constexpr bool kLoadsItself = true;
  static constexpr int kOutputs = 2;
  const bf16* dswiglu;
  const bf16* gate_up;
  long long F;
  __device__ void load(float (&v)[2][16], long long r, int c) const {
    float g[16], u[16], go[16];
    load16(gate_up + r * 2 * F + c, g);
    load16(gate_up + r * 2 * F + F + c, u);
    load16(dswiglu + r * F + c, go);
    gate16(v[0], go, g, u);
    up16(v[1], go, g);
  }
  // One half alone, for a consumer that takes 16 columns of one: the gate's gradient columns c..
  // (c < F; reads gate, up and the output's gradient) or the up's, F + c.. (reads gate and the
  // output's gradient), the same values as load()'s.
  __device__ void load_gate(float (&v)[16], long long r, int c) const {
    float g[16], u[16], go[16];
    load16(gate_up + r * 2 * F + c, g);
    load16(gate_up + r * 2 * F + F + c, u);
    load16(dswiglu + r * F + c, go);
    gate16(v, go, g, u);
  }
  __device__ void load_up(float (&v)[16], long long r, int c) const {
    float g[16], go[16];
    load16(gate_up + r * 2 * F + c, g);
    load16(dswiglu + r * F + c, go);
    up16(v, go, g);
  }
  // The 16 gradients of the gate and of the up from the loaded values, rounded to act.
  __device__ static void gate16(float (&v)[16], const float (&go)[16], const float (&g)[16], const float (&u)[16]) {
#pragma unroll
    for (int i = 0; i < 16; i += 2) {
      v[i] = ops::dswiglu_gate(go[i], g[i], u[i]);
      v[i + 1] = ops::dswiglu_gate(go[i + 1], g[i + 1], u[i + 1]);
      act_round2(v[i], v[i + 1]);
    }
  }
  __device__ static void up16(float (&v)[16], const float (&go)[16], const float (&g)[16]) {
#pragma unroll
    for (int i = 0; i < 16; i += 2) {
      v[i] = ops::dswiglu_up(go[i], g[i]);
      v[i + 1] = ops::dswiglu_up(go[i + 1], g[i + 1]);
      act_round2(v[i], v[i + 1]);
    }
  }
  // Column c of the 2 F.
  __device__ float at(long long r, long long c) const {
    const long long f = c < F ? c : c - F;
    const float g = __bfloat162float(gate_up[r * 2 * F + f]), go = __bfloat162float(dswiglu[r * F + f]);
    return act_round(c < F ? ops::dswiglu_gate(go, g, __bfloat162float(gate_up[r * 2 * F + F + f]))
                           : ops::dswiglu_up(go, g));
  }
};

}  // namespace
}  // namespace kiln::fp8::cuda
