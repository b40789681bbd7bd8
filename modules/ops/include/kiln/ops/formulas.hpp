#pragma once
// Scalar formulas shared by the CPU and CUDA backends, so both compute the same function.
#include <cmath>
#include <cstdint>
#include <limits>

#include "kiln/tensor/bf16.hpp"
#include "kiln/tensor/hd.hpp"

namespace kiln::ops {

// GELU, tanh approximation (GPT-2), and its derivative, written through the logistic function:
// 0.5 (1 + tanh u) = 1 / (1 + e^(-2u)) with u = sqrt(2/pi) (x + 0.044715 x^3), so
//   gelu(x)  = x s,  s = 1 / (1 + e^(-2u))
//   gelu'(x) = s + 2 x s (1 - s) u'(x),  u'(x) = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
// The same function as 0.5 x (1 + tanh u), without its cancellation for negative x; on the device
// one exp2 and one reciprocal of the special-function unit (tanhf costs several times that, and the
// FP8 kernels that apply the GELU while quantising are bound by it). The device's approximate
// exp2 / reciprocal differ from the host's in the last bits (a few ulp), as tanhf did.
KILN_HD float gelu_logistic(float x) {
  const float k = 0.7978845608028654f;  // sqrt(2/pi)
  const float u = x * (k + (k * 0.044715f) * (x * x));
#ifdef __CUDA_ARCH__
  return __fdividef(1.0f, 1.0f + __expf(-2.0f * u));
#else
  return 1.0f / (1.0f + std::exp(-2.0f * u));
#endif
}

KILN_HD float gelu(float x) { return x * gelu_logistic(x); }

KILN_HD float gelu_grad(float x) {
  const float k = 0.7978845608028654f;
  const float s = gelu_logistic(x);
  const float du = k + (k * 3.0f * 0.044715f) * (x * x);
  return s + 2.0f * x * (s * (1.0f - s)) * du;
}

// SiLU (swish) through the logistic function, and its derivative: silu(g) = g s, s = 1 / (1 + e^-g);
// silu'(g) = s (1 + g (1 - s)). SwiGLU is silu(gate) * up.
KILN_HD float silu_logistic(float g) {
#ifdef __CUDA_ARCH__
  return __fdividef(1.0f, 1.0f + __expf(-g));
#else
  return 1.0f / (1.0f + std::exp(-g));
#endif
}
KILN_HD float silu(float g) { return g * silu_logistic(g); }
// SwiGLU's value before rounding: what swiglu_forward stores (act-rounded) and what FP8's
// quantise-with-SwiGLU reads, from one formula on every backend.
KILN_HD float swiglu(float gate, float up) { return silu(gate) * up; }
KILN_HD float silu_grad(float g) {
  const float s = silu_logistic(g);
  return s * (1.0f + g * (1.0f - s));
}
// SwiGLU's backward before rounding, from the output's gradient dout: what swiglu_backward stores
// (act-rounded) for the gate column and the up column, and what FP8's gradient quantisation with the
// SwiGLU's derivative reads.
KILN_HD float dswiglu_gate(float dout, float gate, float up) { return dout * up * silu_grad(gate); }
KILN_HD float dswiglu_up(float dout, float gate) { return dout * silu(gate); }

// The softmax cross-entropy's gradient with respect to one logit x of a row whose logsumexp is `lse`
// ((softmax - onehot) * dloss; `target`: x is the target's logit). Each backend's own arithmetic: the
// host's exp(x - lse), the device's exp2(x log2(e) - lse log2(e)); every op of a backend that writes
// or quantises this gradient takes this function, so they agree bit for bit within the backend.
KILN_HD float xent_grad(float x, float lse, bool target, float dloss) {
#ifdef __CUDA_ARCH__
  constexpr float kLog2e = 1.4426950408889634f;
  const float prob = exp2f(fmaf(x, kLog2e, -(lse * kLog2e)));
#else
  const float prob = std::exp(x - lse);
#endif
  return (prob - (target ? 1.0f : 0.0f)) * dloss;
}

// RoPE's inverse frequency of pair i of a D-wide head: theta^(-2i/D), in f32 as Hugging Face's
// Llama computes it; the angle of position pos is pos * rope_inv_freq(i, D, theta), rounded to f32.
KILN_HD float rope_inv_freq(int i, int D, float theta) {
  return 1.0f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(D));
}

// RoPE's frequencies stretched for long contexts as Llama 3.1 / 3.2 do (Hugging Face's rope_scaling
// of type "llama3"): wavelengths longer than original_max_positions / low_freq_factor are divided
// by `factor`, those shorter than original_max_positions / high_freq_factor kept, and those between
// blended smoothly. factor = 0: none.
struct RopeScaling {
  float factor = 0.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  float original_max_positions = 8192.0f;
  KILN_HD bool enabled() const { return factor > 0.0f; }
};

// The scaled inverse frequency of pair i, with f32 operations in the order transformers'
// _compute_llama3_parameters makes them (x / tensor there is tensor.reciprocal() * x; its Python
// scalars are rounded to f32), so both backends and Hugging Face agree to the bit.
KILN_HD float rope_inv_freq(int i, int D, float theta, const RopeScaling& s) {
  const float inv = rope_inv_freq(i, D, theta);
  if (!s.enabled()) return inv;
  const float low_wavelen = static_cast<float>(static_cast<double>(s.original_max_positions) / s.low_freq_factor);
  const float high_wavelen = static_cast<float>(static_cast<double>(s.original_max_positions) / s.high_freq_factor);
  const float two_pi = static_cast<float>(2.0 * 3.14159265358979323846);
  const float wavelen = (1.0f / inv) * two_pi;
  const float scaled = wavelen > low_wavelen ? inv / s.factor : inv;
  if (wavelen < high_wavelen || wavelen > low_wavelen) return scaled;
  const float span = static_cast<float>(static_cast<double>(s.high_freq_factor) - s.low_freq_factor);
  const float smooth = ((1.0f / wavelen) * s.original_max_positions - s.low_freq_factor) / span;
  return (1.0f - smooth) * scaled / s.factor + smooth * scaled;
}

// RMSNorm's rstd of one row as the CPU backend computes it (one pass in f32).
inline float rmsnorm_row_rstd(const float* x, std::int64_t C, float eps) {
  float ss = 0;
  for (std::int64_t c = 0; c < C; ++c) ss += x[c] * x[c];
  return 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
}

// LayerNorm's output from an element's statistics (mean, rstd = 1 / sqrt(var + eps)).
KILN_HD float layernorm_apply(float x, float mean, float rstd, float w, float b) { return (x - mean) * rstd * w + b; }

// The statistics of one row as the CPU backend's LayerNorm computes them (two passes in f32), for
// other modules' CPU code that must reproduce them bit for bit.
inline void layernorm_row_stats(const float* x, std::int64_t C, float eps, float& mean, float& rstd) {
  float m = 0;
  for (std::int64_t c = 0; c < C; ++c) m += x[c];
  m /= static_cast<float>(C);
  float var = 0;
  for (std::int64_t c = 0; c < C; ++c) var += (x[c] - m) * (x[c] - m);
  var /= static_cast<float>(C);
  mean = m;
  rstd = 1.0f / std::sqrt(var + eps);
}

// One AdamW step for one element, PyTorch's formulation (decoupled weight decay applied first).
// bc1 = 1 - beta1^step, bc2 = 1 - beta2^step. On the device every operation is rounded on its own
// (no multiply-add contracted into an FMA), so every kernel that inlines it computes the same bits:
// the compiler contracted differently in the fused update's tiled and elementwise kernels, and a
// whole weight (plain data parallelism) and its FSDP parts then took different updates.
KILN_HD void adamw_update(float& p, float& m, float& v, float g, float lr, float beta1, float beta2, float eps,
                          float wd, float bc1, float bc2) {
#ifdef __CUDA_ARCH__
  m = __fadd_rn(__fmul_rn(beta1, m), __fmul_rn(1.0f - beta1, g));
  v = __fadd_rn(__fmul_rn(beta2, v), __fmul_rn(__fmul_rn(1.0f - beta2, g), g));
  p = __fmul_rn(p, __fsub_rn(1.0f, __fmul_rn(lr, wd)));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), __fsqrt_rn(bc2)), eps);
  p = __fsub_rn(p, __fmul_rn(__fdiv_rn(lr, bc1), __fdiv_rn(m, denom)));
#else
  m = beta1 * m + (1.0f - beta1) * g;
  v = beta2 * v + (1.0f - beta2) * g * g;
  p = p * (1.0f - lr * wd);
  float denom = sqrtf(v) / sqrtf(bc2) + eps;
  p = p - (lr / bc1) * (m / denom);
#endif
}

// AdamW's moments as held (optim.moments): f32, or bf16 bits (as Megatron-Core's precision-aware
// optimizer and DeepSeek-V3 keep them). Every implementation loads them as f32, runs adamw_update
// in f32 (the parameter's update reads the unrounded moments) and stores them back rounded to
// nearest even: the same bits on every backend.
KILN_HD float moment_load(const float* p, std::int64_t i) { return p[i]; }
KILN_HD float moment_load(const std::uint16_t* p, std::int64_t i) { return bf16_bits_to_float(p[i]); }
KILN_HD void moment_store(float* p, std::int64_t i, float x) { p[i] = x; }
KILN_HD void moment_store(std::uint16_t* p, std::int64_t i, float x) { p[i] = float_to_bf16_bits(x); }

// The bias corrections of adamw_update for `step` (counted from 1), as every implementation
// computes them on the host.
inline void adamw_bias_corrections(float beta1, float beta2, std::int64_t step, float& bc1, float& bc2) {
  bc1 = 1.0f - std::pow(beta1, static_cast<float>(step));
  bc2 = 1.0f - std::pow(beta2, static_cast<float>(step));
}

// Gradient clipping's scale for a gradient of global norm `norm` (max_norm 0: no clipping), in double
// as the optimizer computes it, the same on host and device; NaN where the norm is not finite (the
// AdamW implementations then skip the step).
KILN_HD float grad_clip_scale(double norm, double max_norm) {
  if (!(norm - norm == 0.0)) {  // inf - inf and NaN - NaN are NaN
#ifdef __CUDA_ARCH__
    return __int_as_float(0x7fc00000);
#else
    return std::numeric_limits<float>::quiet_NaN();
#endif
  }
  return max_norm > 0 && norm > max_norm ? static_cast<float>(max_norm / (norm + 1e-6)) : 1.0f;
}

// AdamW::scalars: the step's numbers in device memory, four floats.
enum AdamWScalar { kAdamWLr = 0, kAdamWGradScale = 1, kAdamWBc1 = 2, kAdamWBc2 = 3, kAdamWScalars = 4 };

// The numbers an AdamW implementation steps with: those given on the host, replaced by `scalars`'
// (device memory the optimizer wrote) where given. False where the step is skipped: a NaN gradient
// scale (the gradient was not finite).
struct AdamWNumbers {
  float lr, grad_scale, bc1, bc2;
};
KILN_HD bool adamw_numbers(const float* scalars, AdamWNumbers& n) {
  if (!scalars) return true;
  n.lr = scalars[kAdamWLr];
  n.grad_scale = scalars[kAdamWGradScale];
  n.bc1 = scalars[kAdamWBc1];
  n.bc2 = scalars[kAdamWBc2];
  return n.grad_scale == n.grad_scale;
}

}  // namespace kiln::ops
