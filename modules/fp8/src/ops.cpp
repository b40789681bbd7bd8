// Fp8Ops' defaults of the fused optimizer step with block quantisation (the two calls it fuses) and of
// the grouped block quantisations (one call per group).
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

namespace {

BlockQuantizeArgs group_args(const GroupedBlockQuantizeArgs& a, const BlockGroup& g) {
  return {{}, a.mode, a.pow2, g.rowwise, g.row_scale_inv, g.colwise, g.col_scale_inv};
}

// param seen as [R, cols] (a 2-D or stacked 3-D master weight).
TensorView as_rows(const TensorView& t, const char* what) {
  KILN_CHECK((t.ndim() == 2 || t.ndim() == 3) && t.contiguous(), "fp8 adamw_quantize_blocks_grouped: ", what,
             " must be a contiguous [rows, cols] or [batch, rows, cols] tensor, got ", t.str());
  return t.ndim() == 2 ? t : t.reshape({t.size(0) * t.size(1), t.size(2)});
}

}  // namespace

void Fp8Ops::quantize_blocks_grouped(const GroupedBlockQuantizeArgs& a) {
  for (const BlockGroup& g : a.groups) {
    if (g.rows == 0) continue;
    BlockQuantizeArgs q = group_args(a, g);
    q.x = source_rows(a.x, g.first, g.rows);
    quantize_blocks(q);
  }
}

void Fp8Ops::adamw_quantize_blocks_grouped(const AdamWQuantizeArgs& u, const GroupedBlockQuantizeArgs& out) {
  const TensorView param = as_rows(u.param, "param"), grad = as_rows(u.grad, "grad"), m = as_rows(u.m, "m"),
                   v = as_rows(u.v, "v");
  std::int64_t next = 0;  // the groups cover the weight's rows in order (every element takes its step)
  for (const BlockGroup& g : out.groups) {
    if (g.rows == 0) continue;
    KILN_CHECK(g.first == next && g.first + g.rows <= param.size(0), "fp8 adamw_quantize_blocks_grouped: rows ",
               g.first, "..", g.first + g.rows, " after row ", next, " of ", param.str());
    next = g.first + g.rows;
    AdamWQuantizeArgs ug = u;
    ug.param = param.rows(g.first, g.rows);
    ug.grad = grad.rows(g.first, g.rows);
    ug.m = m.rows(g.first, g.rows);
    ug.v = v.rows(g.first, g.rows);
    adamw_quantize_blocks(ug, group_args(out, g));
  }
  KILN_CHECK(next == param.size(0), "fp8 adamw_quantize_blocks_grouped: groups of ", next, " rows for ", param.str());
}

}  // namespace kiln::fp8
