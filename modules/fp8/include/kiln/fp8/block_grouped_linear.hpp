#pragma once
// A mixture of experts' grouped linear (one linear per expert over its rows; the contract of
// ops::GroupedLinearForward / GroupedLinearBackward) in FP8 with block scaling (fp8.recipe = "block";
// kiln/fp8/block.hpp): Fp8BlockLinear's three products for each expert over its rows.
//
//   forward  out[e] = x[e] @ W[e]^T      X = x[e], 1x128 along IC        Y = W[e] [OC, IC], 128x128
//   dgrad    dx[e]  = dout[e] @ W[e]     X = dout[e], 1x128 along OC     Y = W[e]^T [IC, OC], 128x128
//   wgrad    dW[e] += dout[e]^T @ x[e]   X = dout[e]^T, 1x128 along the expert's rows
//                                        Y = x[e]^T, 1x128 along them (128x128: wgrad_input_2d)
// (an FC2 stored [in, out] per expert reads its transposed copy forward and the stored one for the
// data gradient, and takes x[e]^T @ dout[e] for its weight gradient, x[e]^T then 1x128 always: it
// is the product's first operand, and the 128x128 option applies where it is the second).
//
// Each expert's operands are quantised on their own (its rows of the grouped tensor or of a
// prologue's tensors; all experts' in one Fp8Ops::quantize_blocks_grouped per tensor), so that its
// blocks start at its first row and its scales lie as the products read them. With `keep_input`
// (ops::GroupedLinearImpl::keeps_input: the model then keeps no input for the backward pass) the
// forward also writes the input's transposes the weight gradient reads, and keeps them until the
// backward pass, which must follow with the same grouping. cuBLASLt's 1x128-scaled products need the rows
// (M) to be multiples of 4 and the reduction (K) of 16: the rowwise codes of an expert of n rows
// have round_up(n, 4) rows and the transposes round_up(n, 16) columns, the extra ones zero codes
// (BlockQuantizeArgs' padded outputs: zeros leave every block's scale as it was). An expert whose n
// is not a multiple of 4 writes its product into scratch and its n rows are copied out; the others
// write their rows of the result directly. Each GEMM's products run together (Fp8Ops::gemm_grouped:
// on CUDA spread over streams, each planned for its exact shape).
//
// The weight's codes (each expert's [A, B] and its transpose [B, A], 128x128 tiles, so one set of
// tile scales transposed) are made once per weight version, in their own memory or, with
// use_master_weight, in the compute copy's from the f32 master, where the optimizer's step may write
// them (update_weight: the AdamW update and the codes in one pass). No amax history and no state beyond
// them: nothing goes into checkpoints and a replayed forward computes what the first did.
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/fp8/block_linear.hpp"
#include "kiln/fp8/linear.hpp"
#include "kiln/fp8/ops.hpp"
#include "kiln/ops/moe.hpp"

namespace kiln::fp8 {

class Fp8BlockGroupedLinear {
 public:
  Fp8BlockGroupedLinear(Fp8Ops& ops, Fp8Workspace& workspace, const BlockRecipe& recipe,
                        std::string name = "grouped linear", bool keep_input = false);
  // What it takes through prologues (ops::GroupedLinearImpl::prologues).
  static constexpr ops::PrologueSet kPrologues = {ops::Prologue::plain, ops::Prologue::gelu, ops::Prologue::swiglu,
                                                  ops::Prologue::dgelu, ops::Prologue::dswiglu};

  // The weight's codes are remade when `weight_version` differs from the cached one (or the weight
  // is another tensor).
  void forward(const ops::GroupedLinearForward& a, std::int64_t weight_version);
  void backward(const ops::GroupedLinearBackward& a);
  void invalidate_weight() { cache_.valid = false; }
  // Makes the weight's codes from `master` (the stacked weight's f32 master) into the memory of
  // `compute` (its act-precision compute copy of the same elements: each expert's [A, B] codes in the
  // first E A B bytes, their transposes in the next) for forwards whose weight is that compute copy;
  // nothing else may read it between the first forward after an update and the next update.
  void use_master_weight(const TensorView& master, const TensorView& compute);
  // The optimizer's step of the master weight (use_master_weight) and its codes in one pass
  // (Fp8Ops::adamw_quantize_blocks_grouped; `u` names the master's grad, m and v, of its elements, and
  // the hyperparameters): the codes are then those of `version`. Before any forward (the experts'
  // shape unknown), the step alone: the next forward quantises.
  void update_weight(AdamWQuantizeArgs u, std::int64_t version);
  const std::string& name() const { return name_; }

 private:
  void ensure_weight(const TensorView& w, std::int64_t version);
  // Places the codes of E experts' [A, B] (and their scales): the compute copy's memory or their own.
  void place_codes(std::int64_t E, std::int64_t A, std::int64_t B, bool in_compute);
  // Expert e's codes and scales as the forward ([OC, IC]) or the data gradient ([IC, OC]) reads them.
  struct WeightOperand {
    TensorView codes;
    float* scale_inv;
  };
  WeightOperand stored(std::int64_t e) const;
  WeightOperand transposed(std::int64_t e) const;
  // Both copies of every expert's codes and their scales, as a grouped quantisation's groups (expert
  // e: rows e A.. of the stacked weight seen as [E A, B]).
  std::vector<BlockGroup> weight_groups() const;

  // How the weight gradient takes the input's transposes: 128x128 blocks where it is the product's
  // second operand (an FC1, [E, OC, IC]) and the recipe asks for them.
  ScalingMode input_col_mode(bool weight_in_out) const {
    return recipe_.wgrad_input_2d && !weight_in_out ? ScalingMode::block_128x128 : ScalingMode::block_1x128;
  }
  // The kept input transposes' memory for this grouping (keep_input), grown where it must be.
  std::uint8_t* kept_input(const std::int32_t* off, int E, std::int64_t cols, std::size_t bytes);

  Fp8Ops& ops_;
  Fp8Workspace& ws_;
  BlockRecipe recipe_;
  std::string name_;
  bool keep_input_ = false;
  Buffer kept_;                            // the input's transposes and their scales (keep_input)
  std::vector<std::int32_t> kept_off_;     // the grouping they were made for
  std::int64_t kept_cols_ = 0;
  TensorView master_, compute_;  // use_master_weight
  struct WeightCache {
    Buffer own, scales;
    std::uint8_t* stored = nullptr;      // [E, A, B] codes
    std::uint8_t* transposed = nullptr;  // [E, B, A] codes
    std::int64_t E = 0, A = 0, B = 0;
    bool valid = false;
    std::int64_t version = 0;
    const void* source = nullptr;
  } cache_;
};

}  // namespace kiln::fp8
