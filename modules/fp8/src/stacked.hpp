#pragma once
// A mixture of experts' stacked [E, A, B] weights: their matrices, and their optimizer step alone.
#include <cstdint>

#include "kiln/fp8/ops.hpp"
#include "kiln/tensor/tensor.hpp"

namespace kiln::fp8 {

// Matrix e of a stacked [E, A, B] tensor as [A, B].
inline TensorView expert_matrix(const TensorView& t, std::int64_t e) {
  const std::int64_t A = t.size(1), B = t.size(2);
  return TensorView(static_cast<char*>(t.data) + static_cast<std::size_t>(e * A * B) * size_of(t.dtype), {A, B},
                    t.dtype, t.device);
}

// The AdamW step of a whole stacked master weight without its FP8 copies (u's grad, m and v of as
// many elements; u.out and u.amax ignored): for an update before the experts' shape is known.
inline void adamw_step_alone(Fp8Ops& ops, AdamWQuantizeArgs u, const TensorView& master) {
  const std::int64_t n = master.numel();
  u.param = master.reshape({1, n});
  for (TensorView* t : {&u.grad, &u.m, &u.v}) *t = t->reshape({1, n});
  u.out = {};
  u.amax = nullptr;
  ops.adamw_quantize(u);
}

}  // namespace kiln::fp8
