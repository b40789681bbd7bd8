#pragma once
// Argument checks the CPU and CUDA Fp8Ops share (they differ only in the device they expect).
#include "kiln/core/error.hpp"
#include "kiln/fp8/ops.hpp"

namespace kiln::fp8 {

// param, grad, m, v: f32 [rows, cols] on `device`, contiguous, one shape; both FP8 copies or neither.
inline void check_adamw_quantize_args(const AdamWQuantizeArgs& a, Device device) {
  KILN_CHECK(a.param.ndim() == 2, "fp8 adamw_quantize: param must be 2-D [rows, cols], got ", a.param.str());
  for (const TensorView* t : {&a.param, &a.grad, &a.m, &a.v})
    KILN_CHECK(t->device == device && t->dtype == DType::f32 && t->contiguous() && t->shape == a.param.shape,
               "fp8 adamw_quantize: ", t->str(), " for param ", a.param.str());
  KILN_CHECK(!a.out.rowwise == !a.out.colwise, "fp8 adamw_quantize: both FP8 copies or neither");
}

}  // namespace kiln::fp8
