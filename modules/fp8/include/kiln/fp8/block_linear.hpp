#pragma once
// A linear layer whose three GEMMs run in FP8 with block scaling (fp8.recipe = "block";
// kiln/fp8/block.hpp), with the contract of ops::LinearForward / LinearBackward (bias; GELU epilogue
// writing pre_gelu; dx with dgelu; dweight accumulated or written in f32, dbias accumulated):
//
//   forward  out[N, OC]  = x[N, IC] @ W[OC, IC]^T      X = x, 1x128 along IC      Y = W, 128x128
//   dgrad    dx[N, IC]   = dout[N, OC] @ W[OC, IC]      X = dout, 1x128 along OC   Y = W^T, 128x128
//   wgrad    dW[OC, IC] (+)= dout^T[OC, N] @ x[N, IC]   X = dout^T, 1x128 along N  Y = x^T, 1x128 along N
//
// The weight's two copies (rowwise and its transpose, the same 128x128 tiles, so the same scales
// transposed) are made once per weight version and reused by every micro-batch and the backward
// pass. The input is quantised in the forward (rowwise) and again in the backward (its transpose),
// the output gradient in the backward (both). No amax history and no state beyond the weight's
// copies: nothing goes into checkpoints, and a replayed forward (activation recompute) computes
// exactly what the first did. Scales are fp8_max / amax of each block, optionally powers of two.
//
// Plain operands only so far (no prologues: the model stores or recomputes GELU, SwiGLU and
// LayerNorm outputs for it); the epilogues run after the block-scaled GEMM (cuBLASLt fuses none).
#include <cstdint>
#include <string>

#include "kiln/fp8/linear.hpp"
#include "kiln/fp8/ops.hpp"
#include "kiln/fp8/recipe.hpp"
#include "kiln/ops/backend.hpp"

namespace kiln::fp8 {

struct BlockRecipe {
  Format input = Format::e4m3, weight = Format::e4m3, grad = Format::e4m3;
  bool pow2 = false;  // power-of-two scales (TransformerEngine's option)
};

class Fp8BlockLinear {
 public:
  Fp8BlockLinear(Fp8Ops& ops, Fp8Workspace& workspace, const BlockRecipe& recipe, std::string name = "linear");

  // The weight's FP8 copies are remade when `weight_version` differs from the cached one (or the
  // weight is another tensor).
  void forward(const ops::LinearForward& a, std::int64_t weight_version);
  void backward(const ops::LinearBackward& a);
  void invalidate_weight() { cache_.valid = false; }
  const std::string& name() const { return name_; }

 private:
  // [rows, cols] codes of `f` and their scales, carved out of the workspace.
  struct Operand {
    TensorView codes;
    float* scale_inv = nullptr;
  };
  void ensure_weight(const TensorView& w, std::int64_t version);

  Fp8Ops& ops_;
  Fp8Workspace& ws_;
  BlockRecipe recipe_;
  std::string name_;
  struct WeightCache {
    Buffer rowwise, colwise, row_scales, col_scales;
    bool valid = false;
    std::int64_t version = 0;
    const void* source = nullptr;
    std::int64_t rows = 0, cols = 0;
  } cache_;
};

}  // namespace kiln::fp8
