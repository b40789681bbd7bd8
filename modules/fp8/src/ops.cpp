// Fp8Ops' default of the fused optimizer step with block quantisation: the two calls it fuses.
#include "kiln/core/error.hpp"
#include "kiln/fp8/ops.hpp"

namespace kiln::fp8 {

void Fp8Ops::adamw_quantize_blocks(const AdamWQuantizeArgs& u, const BlockQuantizeArgs& out) {
  KILN_CHECK(!out.dbias, "fp8 adamw_quantize_blocks: no bias gradient");
  AdamWQuantizeArgs step = u;
  step.out = {};
  step.amax = nullptr;
  adamw_quantize(step);
  BlockQuantizeArgs q = out;
  q.x = u.param;
  quantize_blocks(q);
}

}  // namespace kiln::fp8
