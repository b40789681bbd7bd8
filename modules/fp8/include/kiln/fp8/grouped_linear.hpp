#pragma once
// A mixture of experts' grouped linear (one linear per expert over its rows, ops::GroupedLinear*) in
// FP8, with the contract of ops::GroupedLinearForward / GroupedLinearBackward. Device-agnostic: it only
// calls Fp8Ops.
//
// Each GEMM is one FP8 product per expert with rows (Fp8Ops::gemm_grouped: on CUDA one cuBLASLt
// matmul each, spread over streams), reading and writing the grouped rows where they are: the
// forward and data-gradient operands are the experts' rows of one rowwise quantisation, their
// results land in the grouped rows; the weight gradient's operands are each expert's transposed
// rows, padded with zero codes to a multiple of 16 (Fp8Ops::quantize_grouped). Nothing is padded to
// the largest expert and nothing copied back. (The earlier design, one batched GEMM over rows padded
// to the largest expert plus a copy back, cost moe-1b 50.8 ms of FP8 expert work per step on an
// H200 against 44.4 ms for the bf16 experts: docs/PERF.md.)
//
//   forward  out[e]  = x[e] @ W[e]^T          X = x rowwise,   Y = W as [OC, IC] per expert
//   dgrad    dx[e]   = dout[e] @ W[e]         X = dout rowwise, Y = W as [IC, OC] per expert
//   wgrad    dW[e]  += dout[e]^T @ x[e]       X = dout colwise, Y = x colwise (both padded to 16)
// (an FC2 stored [in, out] per expert swaps wgrad's operands and uses the stored layout for dgrad).
//
// Operands through prologues (ops::GroupedLinearImpl::prologues): the input may be the GELU or SwiGLU
// of the pre-activation (an FC2 whose activation the model does not store) and the output gradient
// the GELU's or SwiGLU's output gradient with the pre-activation (an FC1 whose activation's backward
// the model does not run): Fp8Ops::quantize_grouped computes the values as it quantises them, the
// same codes as the unfused path. With keep_input, the forward writes the input's padded transposes
// too and keeps them for the backward, which then reads no input (ops::GroupedLinearImpl::keeps_input).
//
// Scales: per tensor, the three slots of a linear (TensorRole) in an Fp8MetaStore: one for the
// whole grouped input (every expert's rows), one for all of this rank's experts' weights, one for the
// output gradient. The weight's FP8 copies (the stored layout [E, A, B] and each expert's transpose
// [E, B, A]) are made once per weight version and reused by every micro-batch and the backward pass;
// the input is quantised again, with the forward's scale, for the weight gradient. A replayed forward
// (activation recompute) reuses the forward's scales and records no amax, as Fp8Linear's.
//
// As Fp8Linear's, the weight's copies may live in the memory of its act-precision compute copy,
// made from the f32 master (use_master_weight), and the optimizer's step may write them in the same
// pass as it updates the master (update_weight: delayed scaling with the scale known), one
// adamw_quantize per expert.
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/fp8/linear.hpp"
#include "kiln/fp8/meta.hpp"
#include "kiln/fp8/ops.hpp"
#include "kiln/ops/moe.hpp"

namespace kiln::fp8 {

class Fp8GroupedLinear {
 public:
  // Uses slots first_slot + TensorRole of `meta`.
  Fp8GroupedLinear(Fp8Ops& ops, Fp8MetaStore& meta, int first_slot, Fp8Workspace& workspace, const Fp8Recipe& recipe,
                   std::string name = "grouped linear", bool keep_input = false);
  // What it takes through prologues (ops::GroupedLinearImpl::prologues).
  static constexpr ops::PrologueSet kPrologues = {ops::Prologue::plain, ops::Prologue::gelu, ops::Prologue::swiglu,
                                                  ops::Prologue::dgelu, ops::Prologue::dswiglu};

  // The weight's FP8 copies are remade when `weight_version` differs from the cached one (or the
  // weight is another tensor). Bump the version whenever the weight values change.
  void forward(const ops::GroupedLinearForward& a, std::int64_t weight_version, bool replay = false);
  void backward(const ops::GroupedLinearBackward& a);
  void invalidate_weight() { cache_.valid = false; }

  // Makes the weight's FP8 copies from `master` (the stacked weight's f32 master, any shape of its
  // elements: the forward's weight gives [E, A, B]) into the memory of `compute` (its act-precision
  // compute copy, same shape: the stored layout in the first E A B bytes, the per-expert transposes
  // in the next), for forwards whose weight is that compute copy; nothing else may read it between
  // the first forward after an update and the next update.
  void use_master_weight(const TensorView& master, const TensorView& compute);
  // The optimizer's step of the master weight (use_master_weight) and its FP8 copies in one pass per
  // expert (Fp8Ops::adamw_quantize; `u` names the master's grad, m and v, of its elements, and the
  // hyperparameters). Under delayed scaling with the weight's scale known, the copies are written
  // with it and the new weight's amax recorded as the next step's; they are then the copies of
  // `version`. Otherwise the update alone: the next forward quantises.
  void update_weight(AdamWQuantizeArgs u, std::int64_t version);

  ScalingSlot slot(TensorRole r) const { return meta_.slot(first_slot_ + static_cast<int>(r)); }
  const std::string& name() const { return name_; }
  bool keeps_input() const { return keep_input_; }
  std::size_t kept_bytes() const { return kept_.bytes(); }  // the kept input copy's memory

 private:
  // Makes the weight's two FP8 copies: the stored layout [E, A, B] and its per-expert transpose.
  void ensure_weight(const TensorView& w, std::int64_t version);
  // The copies the forward ([E, OC, IC]) and the data gradient ([E, IC, OC]) read: an FC1 stored
  // [out, in] reads its stored layout forward, an FC2 stored [in, out] (in_out) its transposes.
  void* forward_codes(bool in_out) const { return in_out ? cache_.transposed : cache_.stored; }
  void* dgrad_codes(bool in_out) const { return in_out ? cache_.stored : cache_.transposed; }
  bool weight_cached(const TensorView& w) const { return cache_.valid && cache_.source == w.data; }
  TensorView codes(void* at, Shape shape, const ScalingSlot& s) const;
  // FP8 codes with their scaling slot.
  struct Operand {
    void* codes;
    ScalingSlot slot;
  };
  // One product per expert with rows: d's rows [off[e], off[e + 1]) = x's same rows ([*, K] codes)
  // @ W[e]^T (w: [E, N, K] codes, N = d's columns).
  std::vector<GemmArgs> rows_products(const char* what, const Operand& x, const Operand& w, const TensorView& d,
                                      const std::int32_t* off, std::int64_t E, std::int64_t K, bool fast_accum,
                                      const std::int32_t* expert_of = nullptr) const;
  Fp8TensorView fp8(const ScalingSlot& s, void* rowwise, Shape row_shape, void* colwise, Shape col_shape) const;
  // The keep_input buffer, sized for the padded transposes of `cols`-wide rows grouped by `off`
  // (allocated for any grouping of `rows` rows).
  void* kept_input(const std::int32_t* off, int experts, std::int64_t rows, std::int64_t cols);

  Fp8Ops& ops_;
  Fp8MetaStore& meta_;
  int first_slot_;
  Fp8Workspace& ws_;
  Fp8Recipe recipe_;
  std::string name_;
  struct WeightCache {
    Buffer own;                          // both copies, unless they live in the compute copy
    std::uint8_t* stored = nullptr;      // [E, A, B] codes
    std::uint8_t* transposed = nullptr;  // [E, B, A] codes
    bool valid = false;
    std::int64_t version = 0;
    const void* source = nullptr;
  } cache_;
  TensorView master_, compute_;  // use_master_weight
  Shape master_shape_;           // the experts' [E, A, B] (the forward's), once it quantised from the master
  bool keep_input_ = false;
  Buffer kept_;                        // keep_input: the input's padded transposes of the last forward
  std::vector<std::int32_t> kept_off_;  // ... for these offsets
  std::int64_t kept_cols_ = 0;
};

}  // namespace kiln::fp8
