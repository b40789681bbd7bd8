#pragma once
// A block-scaled product's arguments, as Fp8BlockLinear and Fp8BlockGroupedLinear make them.
#include "kiln/fp8/ops.hpp"

namespace kiln::fp8 {

// D = X @ Y^T of block-scaled operands (no epilogue yet).
inline GemmArgs block_product(const TensorView& x, const float* x_scale_inv, ScalingMode x_mode, const TensorView& y,
                              const float* y_scale_inv, ScalingMode y_mode, const TensorView& d, const char* what) {
  GemmArgs g;
  g.x = x;
  g.x_scale_inv = x_scale_inv;
  g.x_mode = x_mode;
  g.y = y;
  g.y_scale_inv = y_scale_inv;
  g.y_mode = y_mode;
  g.d = d;
  g.what = what;
  return g;
}

}  // namespace kiln::fp8
