#pragma once
// A mixture of experts' grouped linear (one linear per expert over its rows, ops::GroupedLinear*) in
// FP8, with the contract of ops::GroupedLinearForward / GroupedLinearBackward. Device-agnostic: it only
// calls Fp8Ops.
//
// Each GEMM runs over every expert at once as one batched FP8 GEMM: the experts' rows are quantised
// into operands padded to the largest expert's row count (rounded up to 16, as Hopper's FP8 GEMMs
// need), each expert's rows first and zeros after (Fp8Ops::quantize_grouped), and the padded results
// are copied back into the grouped rows (Fp8Ops::ungroup). The padding costs the GEMM time of the
// imbalance between the experts, never a second launch per expert.
//
//   forward  out[e]  = x[e] @ W[e]^T          X = x rowwise (padded),  Y = W as [OC, IC] per expert
//   dgrad    dx[e]   = dout[e] @ W[e]         X = dout rowwise,        Y = W as [IC, OC] per expert
//   wgrad    dW[e]  += dout[e]^T @ x[e]       X = dout colwise,        Y = x colwise (both padded)
// (an FC2 stored [in, out] per expert swaps wgrad's operands and uses the stored layout for dgrad).
//
// Scales: per tensor, the three slots of a linear (TensorRole) in an Fp8MetaStore: one for the
// whole grouped input (every expert's rows), one for all of this rank's experts' weights, one for the
// output gradient. The weight's FP8 copies are made once per weight version and reused by every
// micro-batch and the backward pass; the input is quantised again, with the forward's scale, for the
// weight gradient. A replayed forward (activation recompute) reuses the forward's scales and records
// no amax, as Fp8Linear's.
#include <cstdint>
#include <string>

#include "kiln/fp8/linear.hpp"
#include "kiln/fp8/meta.hpp"
#include "kiln/fp8/ops.hpp"
#include "kiln/ops/moe.hpp"

namespace kiln::fp8 {

class Fp8GroupedLinear {
 public:
  // Uses slots first_slot + TensorRole of `meta`.
  Fp8GroupedLinear(Fp8Ops& ops, Fp8MetaStore& meta, int first_slot, Fp8Workspace& workspace, const Fp8Recipe& recipe,
                   std::string name = "grouped linear");

  // The weight's FP8 copies are remade when `weight_version` differs from the cached one (or the
  // weight is another tensor). Bump the version whenever the weight values change.
  void forward(const ops::GroupedLinearForward& a, std::int64_t weight_version, bool replay = false);
  void backward(const ops::GroupedLinearBackward& a);
  void invalidate_weight() { cache_.valid = false; }

  ScalingSlot slot(TensorRole r) const { return meta_.slot(first_slot_ + static_cast<int>(r)); }
  const std::string& name() const { return name_; }
  // The padded rows of a grouping: the largest expert's rows rounded up to 16 (0 without rows).
  static std::int64_t padded_rows(const std::int32_t* offsets_host, int experts);

 private:
  // Makes the weight's two FP8 copies: forward [E, OC, IC] and dgrad [E, IC, OC].
  void ensure_weight(const TensorView& w, bool in_out, std::int64_t version);
  bool weight_cached(const TensorView& w) const { return cache_.valid && cache_.source == w.data; }
  TensorView codes(void* at, Shape shape, const ScalingSlot& s) const;
  Fp8TensorView fp8(const ScalingSlot& s, void* rowwise, Shape row_shape, void* colwise, Shape col_shape) const;

  Fp8Ops& ops_;
  Fp8MetaStore& meta_;
  int first_slot_;
  Fp8Workspace& ws_;
  Fp8Recipe recipe_;
  std::string name_;
  struct WeightCache {
    Buffer forward, dgrad;  // [E, OC, IC] and [E, IC, OC] codes
    bool valid = false;
    std::int64_t version = 0;
    const void* source = nullptr;
  } cache_;
};

}  // namespace kiln::fp8
