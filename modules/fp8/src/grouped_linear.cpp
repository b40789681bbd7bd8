// Fp8GroupedLinear: a mixture of experts' grouped GEMMs as one FP8 GEMM per expert.
#include "kiln/fp8/grouped_linear.hpp"

#include <algorithm>
#include <vector>

#include "kiln/core/error.hpp"
#include "kiln/tensor/alignment.hpp"
#include "scaling.hpp"
#include "stacked.hpp"

namespace kiln::fp8 {

namespace {
constexpr std::size_t kAlign = 256;  // bytes: each operand carved from the workspace starts aligned
std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
}  // namespace

Fp8GroupedLinear::Fp8GroupedLinear(Fp8Ops& ops, Fp8MetaStore& meta, int first_slot, Fp8Workspace& workspace,
                                   const Fp8Recipe& recipe, std::string name, bool keep_input)
    : ops_(ops),
      meta_(meta),
      first_slot_(first_slot),
      ws_(workspace),
      recipe_(recipe),
      name_(std::move(name)),
      keep_input_(keep_input) {
  KILN_CHECK(first_slot >= 0 && first_slot + kRolesPerLinear <= meta.size(), name_, ": meta slots ", first_slot,
             "..", first_slot + kRolesPerLinear - 1, " outside the store of ", meta.size());
  KILN_CHECK(slot(TensorRole::input).format == Format::e4m3 && slot(TensorRole::weight).format == Format::e4m3,
             name_, ": the forward GEMM needs E4M3 input and weight (E5M2 x E5M2 products do not exist)");
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

void Fp8GroupedLinear::ensure_weight(const TensorView& w, std::int64_t version) {
  if (weight_cached(w) && cache_.version == version) return;
  const std::int64_t E = w.size(0), A = w.size(1), B = w.size(2);  // stored [E, A, B]
  const auto bytes = static_cast<std::size_t>(E * A * B);
  // The compute copy's memory holds both copies (2 bytes per element), made from the master (both
  // flat or 2-D as the parameter store holds them: the layer takes them in the forward's shape).
  const bool in_compute = master_ && w.data == compute_.data && w.numel() == compute_.numel();
  const TensorView src = in_compute ? master_.reshape(w.shape) : w;
  if (in_compute) {  // A B a multiple of 16: every expert's block of either copy is aligned
    KILN_CHECK(A * B % 16 == 0, name_, ": FP8 copies in the compute copy need A B a multiple of 16, got ", w.str());
    master_shape_ = w.shape;
    cache_.stored = static_cast<std::uint8_t*>(compute_.data);
    cache_.transposed = cache_.stored + bytes;
  } else {
    if (cache_.own.bytes() < aligned(bytes) + bytes) {
      ops_.synchronize();
      cache_.own = Buffer();
      cache_.own = ops_.alloc(aligned(bytes) + bytes);
    }
    cache_.stored = static_cast<std::uint8_t*>(cache_.own.data());
    cache_.transposed = cache_.stored + aligned(bytes);
  }
  const ScalingSlot s = slot(TensorRole::weight);
  float* record = prepare_scale(ops_, meta_, recipe_, s, [&](float* into) { ops_.amax(src, into); });
  ops_.quantize(src, fp8(s, cache_.stored, {E, A, B}, cache_.transposed, {E, B, A}), record);
  cache_.valid = true;
  cache_.version = version;
  cache_.source = w.data;
}

void Fp8GroupedLinear::use_master_weight(const TensorView& master, const TensorView& compute) {
  KILN_CHECK(master.dtype == DType::f32 && master.contiguous() && compute.shape == master.shape &&
                 compute.contiguous() && size_of(compute.dtype) >= 2 && aligned16(compute.data),
             name_, ": use_master_weight needs an f32 master and a 16-byte aligned compute copy of at least two bytes "
                    "per element of the same shape, got ",
             master.str(), " and ", compute.str());
  master_ = master;
  compute_ = compute;
  master_shape_ = {};
  cache_.valid = false;
}

void Fp8GroupedLinear::update_weight(AdamWQuantizeArgs u, std::int64_t version) {
  KILN_CHECK(master_, name_, ": update_weight needs use_master_weight");
  for (const TensorView* t : {&u.grad, &u.m, &u.v})
    KILN_CHECK(t->numel() == master_.numel() && t->contiguous(), name_, ": update_weight's grad, m and v must have ",
               master_.numel(), " elements, got ", t->str());
  const ScalingSlot s = slot(TensorRole::weight);
  // The experts' shape is the forward's (a forward has quantised from the master): before any, the
  // update alone.
  const bool quantise = recipe_.kind == RecipeKind::delayed && meta_.ready(s.index) && master_shape_.ndim == 3;
  if (!quantise) {
    adamw_step_alone(ops_, u, master_);
    cache_.valid = false;
    return;
  }
  const std::int64_t E = master_shape_[0], A = master_shape_[1], B = master_shape_[2], per = A * B;
  auto* stored = static_cast<std::uint8_t*>(compute_.data);
  // One pass over every expert: the stored layout rowwise, each expert's transpose colwise.
  u.param = master_.reshape(master_shape_);
  for (TensorView* t : {&u.grad, &u.m, &u.v}) *t = t->reshape(master_shape_);
  u.out = fp8(s, stored, {E, A, B}, stored + E * per, {E, B, A});
  u.amax = s.amax;
  ops_.adamw_quantize(u);
  cache_.stored = stored;
  cache_.transposed = stored + E * per;
  cache_.valid = true;
  cache_.version = version;
  cache_.source = compute_.data;
}

void* Fp8GroupedLinear::kept_input(const std::int32_t* off, int experts, std::int64_t rows, std::int64_t cols) {
  const auto bytes = static_cast<std::size_t>(segment_row(off, experts) * cols);
  if (kept_.bytes() < bytes) {
    // With room for the padding and the load to move (an eighth more, at most what any grouping of
    // these rows needs, each expert's padded to 16 at most 15 more): they change from step to step,
    // and a growth waits for the device and reallocates (~0.45 ms of an idle GPU each time on
    // moe-1b). Not the bound alone: with expert parallelism `rows` is the worst case received.
    const auto bound = static_cast<std::size_t>((rows + 15 * static_cast<std::int64_t>(experts)) * cols);
    ops_.synchronize();
    kept_ = Buffer();
    kept_ = ops_.alloc(std::min(bound, bytes + bytes / 8));
  }
  kept_off_.assign(off, off + experts + 1);
  kept_cols_ = cols;
  return kept_.data();
}

namespace {

// A grouped linear's input or output gradient as the source of a grouped quantisation.
GroupedSource input_source(const ops::LinearInput& x, const std::string& name) {
  if (const auto* t = std::get_if<TensorView>(&x)) return *t;
  if (const auto* g = std::get_if<ops::GeluOnLoad>(&x)) return *g;
  if (const auto* g = std::get_if<ops::SwigluOnLoad>(&x)) return *g;
  KILN_THROW(name, ": a grouped linear takes no ", ops::name_of(ops::prologue_of(x)), " prologue");
}
GroupedSource grad_source(const ops::OutputGrad& dout) {
  if (const auto* t = std::get_if<TensorView>(&dout)) return *t;
  if (const auto* g = std::get_if<ops::DgeluOnLoad>(&dout)) return *g;
  if (const auto* g = std::get_if<ops::DswigluOnLoad>(&dout)) return *g;
  KILN_THROW("a grouped linear takes no ", ops::name_of(ops::prologue_of(dout)), " output gradient");
}
}  // namespace

void Fp8GroupedLinear::forward(const ops::GroupedLinearForward& a, std::int64_t weight_version, bool replay) {
  const GroupedSource x = input_source(a.x, name_);
  const Shape xs = grouped_source_shape(x, name_.c_str());
  KILN_CHECK(a.weight.ndim() == 3 && a.offsets_host && xs[0] == a.out.size(0), name_, " forward: weight ",
             a.weight.str(), ", x [", xs[0], ",", xs[1], "], out ", a.out.str());
  const std::int64_t E = ops::row_groups(a.groups, a.weight.size(0)), IC = xs[1];  // E: the row groups
  KILN_CHECK(!replay || (weight_cached(a.weight) && cache_.version == weight_version), name_,
             ": a replayed forward needs the weight of the original one");
  ensure_weight(a.weight, weight_version);
  const std::int32_t* off = a.offsets_host;
  const int experts = static_cast<int>(E);
  const std::int64_t used = off[E];
  const ScalingSlot sx = slot(TensorRole::input), sw = slot(TensorRole::weight);
  // The input's padded transposes for the backward, kept from here where asked.
  void* kept = keep_input_ ? kept_input(off, experts, xs[0], IC) : nullptr;
  if (used == 0) return;  // no rows
  float* record = replay ? nullptr : prepare_scale(ops_, meta_, recipe_, sx, [&](float* into) {
    ops_.quantize_grouped({x, off, experts, fp8(sx, nullptr, {}, nullptr, {}), into});
  });
  // Scratch requests are for any grouping of these rows (see kept_input): the padding moves from
  // step to step, and a workspace that grows waits for the device.
  std::uint8_t* codes_x = ws_.get(static_cast<std::size_t>(xs[0] * IC));
  ops_.quantize_grouped(
      {x, off, experts, fp8(sx, codes_x, {used, IC}, kept, {segment_row(off, experts) * IC}), record});
  ops_.gemm_grouped(rows_products("fp8_grouped_gemm_forward", {codes_x, sx}, {forward_codes(a.weight_in_out), sw}, a.out, off,
                                  E, IC, recipe_.fast_accum_forward, a.expert_of));
}

std::vector<GemmArgs> Fp8GroupedLinear::rows_products(const char* what, const Operand& x, const Operand& w,
                                                      const TensorView& d, const std::int32_t* off, std::int64_t E,
                                                      std::int64_t K, bool fast_accum,
                                                      const std::int32_t* expert_of) const {
  const std::int64_t N = d.size(1);
  std::vector<GemmArgs> gs;
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    GemmArgs g;
    g.what = what;
    g.x = codes(static_cast<std::uint8_t*>(x.codes) + off[e] * K, {rows, K}, x.slot);
    g.x_scale_inv = x.slot.scale_inv;
    g.y = codes(static_cast<std::uint8_t*>(w.codes) + ops::group_expert(expert_of, static_cast<int>(e)) * N * K, {N, K},
                w.slot);
    g.y_scale_inv = w.slot.scale_inv;
    g.d = d.rows(off[e], rows);
    g.fast_accum = fast_accum;
    gs.push_back(g);
  }
  return gs;
}

void Fp8GroupedLinear::backward(const ops::GroupedLinearBackward& a) {
  const GroupedSource dout = grad_source(a.dout);
  const Shape ds = grouped_source_shape(dout, name_.c_str());
  KILN_CHECK(a.weight.ndim() == 3 && a.offsets_host, name_, " backward: weight ", a.weight.str());
  KILN_CHECK(a.dweight.dtype != DType::bf16, name_, ": a bf16 gradient (optim.grads = \"bf16\") is not supported by the grouped FP8 linears yet");
  // E: the row groups (one per expert unless a.groups says), each through its expert's weight.
  const std::int64_t experts_w = a.weight.size(0), E = ops::row_groups(a.groups, experts_w), R = ds[0], OC = ds[1];
  const std::int64_t IC = a.weight_in_out ? a.weight.size(1) : a.weight.size(2);
  KILN_CHECK((a.weight_in_out ? a.weight.size(2) : a.weight.size(1)) == OC, name_, " backward: weight ",
             a.weight.str(), ", dout [", R, ",", OC, "]");
  if (!weight_cached(a.weight)) ensure_weight(a.weight, cache_.version);
  const std::int32_t* off = a.offsets_host;
  const int experts = static_cast<int>(E);
  const std::int64_t used = off[E], padded = segment_row(off, experts);
  if (keep_input_)
    KILN_CHECK(kept_cols_ == IC && kept_off_ == std::vector<std::int32_t>(off, off + E + 1), name_,
               ": backward without its forward's kept input (another grouping or width)");
  if (a.dx && used < R) {  // rows past the experts' get a zero gradient
    const TensorView rest = a.dx.rows(used, R - used);
    ops_.zero(rest.data, rest.bytes());
  }
  if (used == 0) {  // no rows: a zero weight gradient written, or nothing added
    if (a.dweight_overwrite) ops_.zero(a.dweight.data, a.dweight.bytes());
    return;
  }
  const ScalingSlot sx = slot(TensorRole::input), sw = slot(TensorRole::weight), sg = slot(TensorRole::grad_output);
  // Scratch: the output gradient's rowwise codes (for the data gradient) and padded transposes, the
  // input's padded transposes (unless kept); sized for any grouping of these rows, as in forward().
  const std::int64_t padded_bound = R + 15 * E;
  const std::size_t rb = a.dx ? aligned(static_cast<std::size_t>(R * OC)) : 0,
                    gb = aligned(static_cast<std::size_t>(padded_bound * OC));
  std::uint8_t* scratch = ws_.get(rb + gb + (keep_input_ ? 0 : static_cast<std::size_t>(padded_bound * IC)));
  std::uint8_t *gr = a.dx ? scratch : nullptr, *gc = scratch + rb;
  std::uint8_t* xc = keep_input_ ? static_cast<std::uint8_t*>(kept_.data()) : scratch + rb + gb;
  float* record = prepare_scale(ops_, meta_, recipe_, sg, [&](float* into) {
    ops_.quantize_grouped({dout, off, experts, fp8(sg, nullptr, {}, nullptr, {}), into});
  });
  ops_.quantize_grouped({dout, off, experts, fp8(sg, gr, {used, OC}, gc, {padded * OC}), record});
  // The input again, with the forward's scale (its amax is recorded already), unless kept.
  if (!keep_input_)
    ops_.quantize_grouped({input_source(a.x, name_), off, experts, fp8(sx, nullptr, {}, xc, {padded * IC}), nullptr});
  if (a.dx) {  // dx[e] [rows, IC] = dout[e] [rows, OC] @ W[e] [OC, IC]
    ops_.gemm_grouped(
        rows_products("fp8_grouped_gemm_dgrad", {gr, sg}, {dgrad_codes(a.weight_in_out), sw}, a.dx, off, E, OC, false, a.expert_of));
    if (a.dx_gelu_pre) ops_.dgelu(a.dx.rows(0, used), a.dx_gelu_pre.rows(0, used));
  }
  if (a.dgrad_queued) a.dgrad_queued();
  // dW[e] [OC, IC] += dout[g]^T @ x[g] over expert e's groups g (K = a group's padded rows: zeros add
  // nothing), in passes where groups share an expert; an FC2 stored [IC, OC] per expert takes x^T @ dout.
  if (a.dweight_overwrite)
    for (const int e : ops::experts_without_rows(off, experts, a.expert_of, static_cast<int>(experts_w))) {
      const TensorView dw = expert_matrix(a.dweight, e);
      ops_.zero(dw.data, dw.bytes());
    }
  const std::vector<std::vector<int>> passes = ops::weight_grad_passes(off, experts, a.expert_of);
  for (std::size_t pass = 0; pass < passes.size(); ++pass) {
    std::vector<GemmArgs> gs;
    for (const int g : passes[pass]) {
      const std::int64_t P = segment_rows(off, g), at = segment_row(off, g);
      const TensorView dout_t = codes(gc + at * OC, {OC, P}, sg), x_t = codes(xc + at * IC, {IC, P}, sx);
      GemmArgs w;
      w.what = "fp8_grouped_gemm_wgrad";
      w.x = a.weight_in_out ? x_t : dout_t;
      w.x_scale_inv = a.weight_in_out ? sx.scale_inv : sg.scale_inv;
      w.y = a.weight_in_out ? dout_t : x_t;
      w.y_scale_inv = a.weight_in_out ? sg.scale_inv : sx.scale_inv;
      w.d = expert_matrix(a.dweight, ops::group_expert(a.expert_of, g));
      w.f32_result = true;
      w.accumulate = !(a.dweight_overwrite && pass == 0);
      gs.push_back(w);
    }
    ops_.gemm_grouped(gs);
  }
}

}  // namespace kiln::fp8
