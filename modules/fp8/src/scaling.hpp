#pragma once
// The scaling decision before a tensor is quantised, shared by the FP8 layers (Fp8Linear,
// Fp8GroupedLinear): current scaling takes the tensor's own amax now; delayed scaling the history's
// scale, or, with no history yet, the tensor's own amax recorded as this step's.
#include <functional>

#include "kiln/fp8/meta.hpp"

namespace kiln::fp8 {

// Makes slot s's scale valid for quantising a tensor whose amax `amax` max-accumulates into its
// argument (called only where the scale needs it now). Returns where the quantisation records the
// tensor's amax: the slot's history row (delayed scaling with a known scale), else nullptr (the amax
// is recorded already, or not wanted).
inline float* prepare_scale(Fp8Ops& ops, Fp8MetaStore& meta, const Fp8Recipe& recipe, const ScalingSlot& s,
                            const std::function<void(float*)>& amax) {
  if (recipe.kind == RecipeKind::current) {
    ops.zero(s.amax_now, sizeof(float));
    amax(s.amax_now);
    ops.scale_from_amax(s.amax_now, s.scale, s.scale_inv, s.fp8_max, recipe.margin);
    return nullptr;
  }
  if (meta.ready(s.index)) return s.amax;
  // Delayed scaling with no history yet: start from this tensor's own amax (recorded as this
  // step's), instead of a scale of 1 that would flush small gradients to zero.
  amax(s.amax);
  ops.scale_from_amax(s.amax, s.scale, s.scale_inv, s.fp8_max, recipe.margin);
  meta.set_ready(s.index);
  return nullptr;
}

}  // namespace kiln::fp8
