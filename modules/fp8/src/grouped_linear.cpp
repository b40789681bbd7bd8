// Fp8GroupedLinear: a mixture of experts' grouped GEMMs as batched FP8 GEMMs over padded rows.
#include "kiln/fp8/grouped_linear.hpp"

#include <algorithm>

#include "kiln/core/error.hpp"
#include "scaling.hpp"

namespace kiln::fp8 {

namespace {
constexpr std::size_t kAlign = 256;  // bytes: each operand carved from the workspace starts aligned
std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
}  // namespace

Fp8GroupedLinear::Fp8GroupedLinear(Fp8Ops& ops, Fp8MetaStore& meta, int first_slot, Fp8Workspace& workspace,
                                   const Fp8Recipe& recipe, std::string name)
    : ops_(ops), meta_(meta), first_slot_(first_slot), ws_(workspace), recipe_(recipe), name_(std::move(name)) {
  KILN_CHECK(first_slot >= 0 && first_slot + kRolesPerLinear <= meta.size(), name_, ": meta slots ", first_slot,
             "..", first_slot + kRolesPerLinear - 1, " outside the store of ", meta.size());
  KILN_CHECK(slot(TensorRole::input).format == Format::e4m3 && slot(TensorRole::weight).format == Format::e4m3,
             name_, ": the forward GEMM needs E4M3 input and weight (E5M2 x E5M2 products do not exist)");
}

std::int64_t Fp8GroupedLinear::padded_rows(const std::int32_t* offsets_host, int experts) {
  std::int64_t most = 0;
  for (int e = 0; e < experts; ++e) most = std::max<std::int64_t>(most, offsets_host[e + 1] - offsets_host[e]);
  return (most + 15) / 16 * 16;
}

TensorView Fp8GroupedLinear::codes(void* at, Shape shape, const ScalingSlot& s) const {
  return TensorView(at, shape, dtype_of(s.format), ops_.device());
}

Fp8TensorView Fp8GroupedLinear::fp8(const ScalingSlot& s, void* rowwise, Shape row_shape, void* colwise,
                                    Shape col_shape) const {
  Fp8TensorView v;
  if (rowwise) v.rowwise = codes(rowwise, row_shape, s);
  if (colwise) v.colwise = codes(colwise, col_shape, s);
  v.format = s.format;
  v.scale = s.scale;
  v.scale_inv = s.scale_inv;
  return v;
}

void Fp8GroupedLinear::ensure_weight(const TensorView& w, bool in_out, std::int64_t version) {
  if (weight_cached(w) && cache_.version == version) return;
  const std::int64_t E = w.size(0), A = w.size(1), B = w.size(2);  // stored [E, A, B]
  const auto bytes = static_cast<std::size_t>(E * A * B);
  if (cache_.forward.bytes() < bytes) {
    ops_.synchronize();
    cache_.forward = ops_.alloc(bytes);
    cache_.dgrad = ops_.alloc(bytes);
  }
  const ScalingSlot s = slot(TensorRole::weight);
  float* record = prepare_scale(ops_, meta_, recipe_, s, [&](float* into) { ops_.amax(w, into); });
  // The stored layout is one copy, its per-expert transpose the other: [out, in] for the forward
  // (an FC1's stored layout), [in, out] for the data gradient (an FC2's).
  void* stored = in_out ? cache_.dgrad.data() : cache_.forward.data();
  void* transposed = in_out ? cache_.forward.data() : cache_.dgrad.data();
  ops_.quantize(w, fp8(s, stored, {E, A, B}, transposed, {E, B, A}), record);
  cache_.valid = true;
  cache_.version = version;
  cache_.source = w.data;
}

void Fp8GroupedLinear::forward(const ops::GroupedLinearForward& a, std::int64_t weight_version, bool replay) {
  const std::int64_t E = a.weight.size(0), IC = a.x.size(1), OC = a.out.size(1);
  KILN_CHECK(a.weight.ndim() == 3 && a.offsets_host && a.x.size(0) == a.out.size(0), name_, " forward: weight ",
             a.weight.str(), ", x ", a.x.str(), ", out ", a.out.str());
  KILN_CHECK(!replay || (weight_cached(a.weight) && cache_.version == weight_version), name_,
             ": a replayed forward needs the weight of the original one");
  ensure_weight(a.weight, a.weight_in_out, weight_version);
  const std::int32_t* off = a.offsets_host;
  const int experts = static_cast<int>(E);
  const std::int64_t P = padded_rows(off, experts);
  if (P == 0) return;  // no rows
  const ScalingSlot sx = slot(TensorRole::input), sw = slot(TensorRole::weight);
  const TensorView used = a.x.rows(0, off[E]);
  float* record = replay ? nullptr : prepare_scale(ops_, meta_, recipe_, sx, [&](float* into) { ops_.amax(used, into); });
  // Scratch: the padded input codes, then the padded result.
  const std::size_t xb = aligned(static_cast<std::size_t>(E * P * IC));
  std::uint8_t* scratch = ws_.get(xb + static_cast<std::size_t>(E * P * OC) * size_of(ops_.act_dtype()));
  ops_.quantize_grouped({a.x, off, experts, P, fp8(sx, scratch, {E, P, IC}, nullptr, {}), record});
  const TensorView d(scratch + xb, {E, P, OC}, ops_.act_dtype(), ops_.device());
  GemmArgs g;
  g.what = "fp8_grouped_gemm_forward";
  g.x = codes(scratch, {E, P, IC}, sx);
  g.x_scale_inv = sx.scale_inv;
  g.y = codes(cache_.forward.data(), {E, OC, IC}, sw);
  g.y_scale_inv = sw.scale_inv;
  g.d = d;
  g.fast_accum = recipe_.fast_accum_forward;
  ops_.gemm(g);
  ops_.ungroup(a.out, d, off);
}

void Fp8GroupedLinear::backward(const ops::GroupedLinearBackward& a) {
  const std::int64_t E = a.weight.size(0), R = a.x.size(0), IC = a.x.size(1), OC = a.dout.size(1);
  KILN_CHECK(a.weight.ndim() == 3 && a.offsets_host && a.dout.size(0) == R, name_, " backward: weight ",
             a.weight.str(), ", x ", a.x.str(), ", dout ", a.dout.str());
  if (!weight_cached(a.weight)) ensure_weight(a.weight, a.weight_in_out, cache_.version);
  const std::int32_t* off = a.offsets_host;
  const int experts = static_cast<int>(E);
  const std::int64_t P = padded_rows(off, experts);
  const DType act = ops_.act_dtype();
  const Device dev = ops_.device();
  if (a.dx && off[E] < R) {  // rows past the experts' get a zero gradient
    const TensorView rest = a.dx.rows(off[E], R - off[E]);
    ops_.zero(rest.data, rest.bytes());
  }
  if (P == 0) {  // no rows: a zero weight gradient written, or nothing added
    if (a.dweight_overwrite) ops_.zero(a.dweight.data, a.dweight.bytes());
    return;
  }
  const ScalingSlot sx = slot(TensorRole::input), sw = slot(TensorRole::weight), sg = slot(TensorRole::grad_output);
  // Scratch: the output gradient's padded codes, rowwise and colwise; the input's colwise codes;
  // the data gradient's padded result.
  const std::size_t gb = aligned(static_cast<std::size_t>(E * P * OC)), xb = aligned(static_cast<std::size_t>(E * P * IC));
  std::uint8_t* scratch = ws_.get(2 * gb + xb + (a.dx ? static_cast<std::size_t>(E * P * IC) * size_of(act) : 0));
  std::uint8_t *gr = scratch, *gc = scratch + gb, *xc = scratch + 2 * gb;
  const TensorView dout = a.dout.rows(0, off[E]);
  float* record = prepare_scale(ops_, meta_, recipe_, sg, [&](float* into) { ops_.amax(dout, into); });
  ops_.quantize_grouped({a.dout, off, experts, P, fp8(sg, gr, {E, P, OC}, gc, {E, OC, P}), record});
  // The input again, with the forward's scale (its amax is recorded already).
  ops_.quantize_grouped({a.x, off, experts, P, fp8(sx, nullptr, {}, xc, {E, IC, P}), nullptr});
  if (a.dx) {
    GemmArgs g;  // dx[e][P, IC] = dout[e][P, OC] @ W[e][OC, IC]: K = OC, Y = W[e] as [IC, OC]
    g.what = "fp8_grouped_gemm_dgrad";
    g.x = codes(gr, {E, P, OC}, sg);
    g.x_scale_inv = sg.scale_inv;
    g.y = codes(cache_.dgrad.data(), {E, IC, OC}, sw);
    g.y_scale_inv = sw.scale_inv;
    const TensorView d(scratch + 2 * gb + xb, {E, P, IC}, act, dev);
    g.d = d;
    ops_.gemm(g);
    ops_.ungroup(a.dx, d, off);
    if (a.dx_gelu_pre) ops_.dgelu(a.dx.rows(0, off[E]), a.dx_gelu_pre.rows(0, off[E]));
  }
  // dW[e] [OC, IC] += dout[e]^T @ x[e] (K = the padded rows: zeros add nothing); an FC2 stored
  // [IC, OC] per expert takes x^T @ dout.
  GemmArgs w;
  w.what = "fp8_grouped_gemm_wgrad";
  const TensorView dout_t = codes(gc, {E, OC, P}, sg), x_t = codes(xc, {E, IC, P}, sx);
  w.x = a.weight_in_out ? x_t : dout_t;
  w.x_scale_inv = a.weight_in_out ? sx.scale_inv : sg.scale_inv;
  w.y = a.weight_in_out ? dout_t : x_t;
  w.y_scale_inv = a.weight_in_out ? sg.scale_inv : sx.scale_inv;
  w.d = a.dweight;
  w.f32_result = true;
  w.accumulate = !a.dweight_overwrite;
  ops_.gemm(w);
}

}  // namespace kiln::fp8
