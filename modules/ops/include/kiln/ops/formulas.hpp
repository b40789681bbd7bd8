#pragma once
// Scalar formulas shared by the CPU and CUDA backends, so both compute the same function.
#include <cmath>
#include <cstdint>

#include "kiln/tensor/hd.hpp"

namespace kiln::ops {

// GELU, tanh approximation (GPT-2), and its derivative.
KILN_HD float gelu(float x) {
  const float k = 0.7978845608028654f;  // sqrt(2/pi)
  float inner = k * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + tanhf(inner));
}

KILN_HD float gelu_grad(float x) {
  const float k = 0.7978845608028654f;
  float x2 = x * x;
  float inner = k * (x + 0.044715f * x2 * x);
  float t = tanhf(inner);
  float sech2 = 1.0f - t * t;
  return 0.5f * (1.0f + t) + 0.5f * x * sech2 * k * (1.0f + 3.0f * 0.044715f * x2);
}

// One AdamW step for one element, PyTorch's formulation (decoupled weight decay applied first).
// bc1 = 1 - beta1^step, bc2 = 1 - beta2^step.
KILN_HD void adamw_update(float& p, float& m, float& v, float g, float lr, float beta1, float beta2, float eps,
                          float wd, float bc1, float bc2) {
  m = beta1 * m + (1.0f - beta1) * g;
  v = beta2 * v + (1.0f - beta2) * g * g;
  p = p * (1.0f - lr * wd);
  float denom = sqrtf(v) / sqrtf(bc2) + eps;
  p = p - (lr / bc1) * (m / denom);
}

}  // namespace kiln::ops
