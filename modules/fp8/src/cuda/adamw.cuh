#pragma once
// The AdamW step as the fused FP8 kernels apply it (adamw_quantize.cu, block.cu): the step's numbers,
// from the arguments or from device memory (ops::AdamW::scalars), and ops::adamw_update of one
// element. Internal to kiln::fp8's CUDA sources, like tiles.cuh.
#include <cstdint>

#include "kiln/ops/formulas.hpp"

namespace kiln::fp8::cuda {
namespace {

struct Hyper {
  float lr, beta1, beta2, eps, weight_decay, grad_scale, bc1, bc2;
  const float* scalars;  // lr, grad_scale, bc1, bc2 from device memory instead (ops::AdamW::scalars)
};

// Takes the step's numbers from device memory where given; false where the step is skipped (a NaN
// gradient scale: the gradient was not finite). The same for every thread.
__device__ __forceinline__ bool step_numbers(Hyper& h) {
  ops::AdamWNumbers n{h.lr, h.grad_scale, h.bc1, h.bc2};
  if (!ops::adamw_numbers(h.scalars, n)) return false;
  h.lr = n.lr, h.grad_scale = n.grad_scale, h.bc1 = n.bc1, h.bc2 = n.bc2;
  return true;
}

__device__ __forceinline__ void update(float& p, float& m, float& v, float g, const Hyper& h) {
  ops::adamw_update(p, m, v, g * h.grad_scale, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.bc1, h.bc2);
}

// Four consecutive elements: a float4 of the master, the gradient and the moments as loaded (f32
// or bf16, kiln/ops/cuda/moments.cuh's load4).
__device__ __forceinline__ void update4(float4& p, float (&m)[4], float (&v)[4], const float (&g)[4], const Hyper& h) {
  update(p.x, m[0], v[0], g[0], h);
  update(p.y, m[1], v[1], g[1], h);
  update(p.z, m[2], v[2], g[2], h);
  update(p.w, m[3], v[3], g[3], h);
}

// The step's numbers of an AdamWQuantizeDev (the bias corrections of its step).
inline Hyper hyper_of(float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale,
                      std::int64_t step, const float* scalars) {
  float bc1 = 0, bc2 = 0;
  ops::adamw_bias_corrections(beta1, beta2, step, bc1, bc2);
  return Hyper{lr, beta1, beta2, eps, weight_decay, grad_scale, bc1, bc2, scalars};
}

}  // namespace
}  // namespace kiln::fp8::cuda
