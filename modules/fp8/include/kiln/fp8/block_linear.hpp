#pragma once
// A linear layer whose three GEMMs run in FP8 with block scaling (fp8.recipe = "block";
// kiln/fp8/block.hpp), with the contract of ops::LinearForward / LinearBackward (bias; GELU epilogue
// writing pre_gelu; dx with dgelu; dweight accumulated or written in f32, dbias accumulated):
//
//   forward  out[N, OC]  = x[N, IC] @ W[OC, IC]^T      X = x, 1x128 along IC      Y = W, 128x128
//   dgrad    dx[N, IC]   = dout[N, OC] @ W[OC, IC]      X = dout, 1x128 along OC   Y = W^T, 128x128
//   wgrad    dW[OC, IC] (+)= dout^T[OC, N] @ x[N, IC]   X = dout^T, 1x128 along N  Y = x^T, 1x128 along N
//                                                                              (or 128x128: wgrad_input_2d)
//
// The weight's two copies (rowwise and its transpose, the same 128x128 tiles, so the same scales
// transposed) are made once per weight version and reused by every micro-batch and the backward
// pass. The input is quantised in the forward (rowwise) and again in the backward (its transpose),
// the output gradient in the backward (both). With `keep_input` (ops::LinearImpl::keeps_input: the
// model then stores no input for the backward) the forward writes the input's transpose too, from
// the same read where both are 1x128, and keeps it with its scales for the backward, which never
// reads the input: the codes the backward would make, so the same products. No amax history and no
// state beyond the weight's copies (and that transient one): nothing goes into checkpoints, and a
// replayed forward (activation recompute) computes exactly what the first did. Scales are fp8_max / amax of each block, optionally powers of two.
//
// It takes every prologue of ops/prologue.hpp, as Fp8Linear does: the input as LayerNormOnLoad (the
// forward computes the statistics, then the values while quantising; the backward recomputes them
// from those statistics while quantising the transpose), GeluOnLoad or SwigluOnLoad, and the output
// gradient as DgeluOnLoad or DswigluOnLoad (never written back); the bias gradient is summed in the
// output gradient's quantisation. The epilogues run after the block-scaled GEMM (cuBLASLt fuses
// none).
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
  // The weight gradient's input operand (x^T, [IC, N]) in 128x128 blocks instead of 1x128 along the
  // tokens: one scale per 128 tokens x 128 features (TransformerEngine's 2D scaling of activations,
  // here for the weight gradient alone). cuBLASLt's 1x128 x 128x128 products run ~40% faster than its
  // 1x128 x 1x128 ones on Hopper (docs/PERF.md), at coarser scales for the input.
  bool wgrad_input_2d = false;
};

class Fp8BlockLinear {
 public:
  Fp8BlockLinear(Fp8Ops& ops, Fp8Workspace& workspace, const BlockRecipe& recipe, std::string name = "linear",
                 bool keep_input = false);
  // What it takes through prologues (ops::LinearImpl::prologues): all but the cross-entropy gradient.
  static constexpr ops::PrologueSet kPrologues = {ops::Prologue::plain, ops::Prologue::layernorm, ops::Prologue::gelu,
                                                  ops::Prologue::swiglu, ops::Prologue::dgelu, ops::Prologue::dswiglu};

  // The weight's FP8 copies are remade when `weight_version` differs from the cached one (or the
  // weight is another tensor).
  void forward(const ops::LinearForward& a, std::int64_t weight_version);
  void backward(const ops::LinearBackward& a);
  void invalidate_weight() { cache_.valid = false; }

  // Makes the weight's codes from `master` (its f32 master copy) into the memory of `compute` (its
  // act-precision compute copy: rowwise codes in the first OC x IC bytes, the transpose's in the
  // next; the scales in the layer's own memory) for forwards whose weight is that compute copy, as
  // Fp8Linear::use_master_weight: nothing else may read the compute copy between the first forward
  // after a weight update and the next update.
  void use_master_weight(const TensorView& master, const TensorView& compute);
  // The optimizer's step of the master weight (use_master_weight) and its codes in one pass
  // (Fp8Ops::adamw_quantize_blocks; `u` names the master's grad, m and v, and the hyperparameters):
  // the codes are then those of `version`, which the next forward reuses.
  void update_weight(AdamWQuantizeArgs u, std::int64_t version);

  // ---- a weight whose f32 master is sharded over ranks (FSDP), gathered as 128x128-block codes ----
  // The weight [rows, cols] is gathered as its rowwise codes (a u8 weight in forward and backward),
  // whose scales the ranks make alike: each rank max-accumulates its part's tile amaxes into
  // `tile_amax` (tile_count(rows, cols) floats the caller zeroes and all-reduces), then
  // scales_from_amax() and quantize_weight_part() per part. The backward transposes the gathered
  // codes for the data gradient (the same tiles, so the same scales transposed).
  static std::int64_t tile_count(std::int64_t rows, std::int64_t cols) {
    return BlockLayout{ScalingMode::block_128x128, rows, cols}.count();
  }
  void use_gathered_codes(std::int64_t rows, std::int64_t cols, float* tile_amax);
  void weight_part_amax(const TensorView& part, std::int64_t first);
  void scales_from_amax();
  void quantize_weight_part(const TensorView& part, std::int64_t first, void* codes);
  const std::string& name() const { return name_; }
  bool keeps_input() const { return keep_input_; }
  std::size_t kept_bytes() const { return kept_.bytes(); }  // the kept input transpose's memory (keep_input)

  // A GEMM operand: [rows, cols] codes and their block scales.
  struct Operand {
    TensorView codes;
    float* scale_inv = nullptr;
  };

 private:
  void ensure_weight(const TensorView& w, std::int64_t version);
  // The weight gradient's input operand, x^T [IC, N]: 1x128 along the tokens, or 128x128.
  BlockLayout input_transpose(std::int64_t N, std::int64_t IC) const;
  // The kept transpose's codes and scales (keep_input), grown where they must be.
  Operand kept_input(std::int64_t N, std::int64_t IC);

  Fp8Ops& ops_;
  Fp8Workspace& ws_;
  BlockRecipe recipe_;
  std::string name_;
  bool keep_input_ = false;
  Buffer kept_;                          // keep_input: the last forward's input transpose and its scales
  std::int64_t kept_rows_ = 0, kept_cols_ = 0;  // that forward's N and IC
  TensorView master_, compute_;  // use_master_weight
  // Where the weight's codes go, [OC, IC] and [IC, OC]: the compute copy's memory or their own.
  void place_codes(std::int64_t OC, std::int64_t IC, bool in_compute);
  BlockQuantizeArgs weight_codes() const;
  struct Gathered {  // use_gathered_codes
    std::int64_t rows = 0, cols = 0;
    float* tile_amax = nullptr;
    Buffer scale;  // the tiles' scales (the rowwise layout), then the scale_inv of both copies in cache_
  } gathered_;
  BlockPart part_of(const TensorView& part, std::int64_t first) const;
  void check_gathered(std::int64_t OC, std::int64_t IC) const;
  struct WeightCache {
    Buffer own_rowwise, own_colwise, row_scales, col_scales;
    void* rowwise = nullptr;
    void* colwise = nullptr;
    bool valid = false;
    std::int64_t version = 0;
    const void* source = nullptr;
    std::int64_t rows = 0, cols = 0;
  } cache_;
};

}  // namespace kiln::fp8
