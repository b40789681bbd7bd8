#pragma once
// Argument checks the CPU and CUDA Fp8Ops share (they differ only in the device they expect).
#include "kiln/fp8/ops.hpp"
#include "kiln/ops/arg_check.hpp"

namespace kiln::fp8 {

// A layer's operand: a contiguous `dtype` [rows, cols], or an error naming `what`.
inline void expect_matrix(const TensorView& t, DType dtype, std::int64_t rows, std::int64_t cols,
                          const std::string& what) {
  if (t.dtype != dtype || t.ndim() != 2 || t.size(0) != rows || t.size(1) != cols || !t.contiguous())
    KILN_THROW(what, ": expected a contiguous ", name_of(dtype), "[", rows, ",", cols, "], got ", t.str());
}

// param, grad, m, v: [rows, cols] or [batch, rows, cols] on `device`, contiguous, one shape (param
// f32; grad f32 or bf16, the gradient dtype; m and v f32 or both bf16); no colwise copy without the
// rowwise one.
inline void check_adamw_quantize_args(const AdamWQuantizeArgs& a, Device device) {
  ops::OpArgs c("fp8 adamw_quantize", {device, DType::f32, false});
  const auto rows = c.wide_dim("rows"), cols = c.wide_dim("cols");
  // The moments f32 or bf16, both alike (ops::moment_load / moment_store).
  const DType moments = a.m.dtype == DType::bf16 ? DType::bf16 : DType::f32;
  // The gradient f32 or bf16 (optim.grads; read as f32 exactly, ops::grad_load); any other refused by name.
  if (a.grad.dtype != DType::f32 && a.grad.dtype != DType::bf16)
    KILN_THROW(c.op(), " grad: expected f32 or bf16 (the gradient dtype), got ", a.grad.str());
  struct Arg {
    const char* name;
    const TensorView* t;
    DType dtype;
  };
  const Arg args[] = {{"param", &a.param, DType::f32}, {"grad", &a.grad, a.grad.dtype}, {"m", &a.m, moments},
                      {"v", &a.v, moments}};
  if (a.param.ndim() == 3) {
    const auto batch = c.wide_dim("batch");
    for (const Arg& x : args) c.tensor(x.name, *x.t, x.dtype, {batch, rows, cols});
  } else {
    for (const Arg& x : args) c.tensor(x.name, *x.t, x.dtype, {rows, cols});
  }
  c.check(a.out.rowwise || !a.out.colwise, "the colwise FP8 copy only with the rowwise one");
}

// out [cols, rows] and in [rows, cols]: contiguous one-byte tensors of one dtype on `device`.
inline void check_transpose_args(const TensorView& out, const TensorView& in, Device device) {
  ops::OpArgs c("fp8 transpose", {device, DType::bf16, false});
  const auto rows = c.wide_dim("rows"), cols = c.wide_dim("cols");
  c.tensor("in", in, ops::ArgDType::any(), {rows, cols});
  c.tensor("out", out, in.dtype, {cols, rows});
  c.check(size_of(in.dtype) == 1, "codes of one byte, got ", in.str());
}

// A grouping's offsets (experts + 1 of them, host memory) against R rows: non-decreasing from 0,
// within R.
inline void check_offsets(const std::int32_t* off, std::int64_t experts, std::int64_t R, const char* what) {
  KILN_CHECK(off && experts > 0, what, ": ", experts, " experts", off ? "" : " and no offsets");
  KILN_CHECK(off[0] == 0 && off[experts] <= R, what, ": offsets [0] = ", off[0], ", [E] = ", off[experts], " for ", R,
             " rows");
  for (std::int64_t e = 0; e < experts; ++e)
    KILN_CHECK(off[e + 1] >= off[e], what, ": offsets decrease at expert ", e, " (", off[e], " then ", off[e + 1], ")");
}

}  // namespace kiln::fp8
