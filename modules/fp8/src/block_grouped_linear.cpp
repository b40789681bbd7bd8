// Fp8BlockGroupedLinear: a mixture of experts' grouped linear in block-scaled FP8
// (kiln/fp8/block_grouped_linear.hpp).
#include "kiln/fp8/block_grouped_linear.hpp"

#include <algorithm>
#include <functional>
#include <optional>
#include <utility>

#include "align.hpp"
#include "block_product.hpp"
#include "kiln/core/error.hpp"
#include "stacked.hpp"

namespace kiln::fp8 {

namespace {

constexpr std::int64_t round_up(std::int64_t n, std::int64_t m) { return (n + m - 1) / m * m; }

// One block-scaled operand of every expert with rows, one after another: expert e's codes at byte
// code_at[e] of the codes, its scales at float scale_at[e] of the scales (16-byte aligned, as
// cuBLASLt wants them: a BlockLayout's leading dimension is a multiple of 4 floats, and every code
// count here a multiple of 16 where the GEMMs' K and N are, which CUDA requires).
struct Grouped {
  std::vector<BlockLayout> layout;  // per expert (rows 0: an expert without rows)
  std::vector<std::int64_t> code_at, scale_at;
  std::int64_t codes = 0, scales = 0;
  std::uint8_t* code_base = nullptr;
  float* scale_base = nullptr;

  Grouped(const std::int32_t* off, int E, const std::function<BlockLayout(std::int64_t)>& layout_of) {
    for (int e = 0; e < E; ++e) {
      const std::int64_t n = off[e + 1] - off[e];
      const BlockLayout l = n > 0 ? layout_of(n) : BlockLayout{};
      layout.push_back(l);
      code_at.push_back(codes);
      scale_at.push_back(scales);
      codes += l.rows * l.cols;
      scales += n > 0 ? l.count() : 0;
    }
  }
  std::size_t bytes() const { return round256(static_cast<std::size_t>(codes)) + round256(static_cast<std::size_t>(scales) * 4); }
  // Places it at p (bytes() of them); returns the end.
  std::uint8_t* place(std::uint8_t* p) {
    code_base = p;
    scale_base = reinterpret_cast<float*>(p + round256(static_cast<std::size_t>(codes)));
    return p + bytes();
  }
  TensorView codes_of(int e, Format f, Device dev) const {
    const BlockLayout& l = layout[static_cast<std::size_t>(e)];
    return TensorView(code_base + code_at[static_cast<std::size_t>(e)], {l.rows, l.cols}, dtype_of(f), dev);
  }
  float* scales_of(int e) const { return scale_base + scale_at[static_cast<std::size_t>(e)]; }
};

// Bytes a workspace request asks for: the rows' grouping moves from step to step, and a workspace
// that grows waits for the device; an eighth more than this grouping needs, so that it rarely grows.
std::size_t with_room(std::size_t bytes) { return bytes + bytes / 8; }

}  // namespace

Fp8BlockGroupedLinear::Fp8BlockGroupedLinear(Fp8Ops& ops, Fp8Workspace& workspace, const BlockRecipe& recipe,
                                             std::string name, bool keep_input)
    : ops_(ops), ws_(workspace), recipe_(recipe), name_(std::move(name)), keep_input_(keep_input) {
  KILN_CHECK(recipe.input == Format::e4m3 && recipe.weight == Format::e4m3, name_,
             ": the forward GEMM needs E4M3 input and weight (E5M2 x E5M2 products do not exist)");
}

void Fp8BlockGroupedLinear::use_master_weight(const TensorView& master, const TensorView& compute) {
  KILN_CHECK(master.dtype == DType::f32 && master.contiguous() && compute.numel() == master.numel() &&
                 compute.contiguous() && size_of(compute.dtype) >= 2,
             name_, ": use_master_weight needs an f32 master and a compute copy of at least two bytes per element of "
                    "as many elements, got ", master.str(), " and ", compute.str());
  master_ = master;
  compute_ = compute;
  cache_.valid = false;
}

void Fp8BlockGroupedLinear::place_codes(std::int64_t E, std::int64_t A, std::int64_t B, bool in_compute) {
  const auto per = static_cast<std::size_t>(A * B);
  const BlockLayout sl{ScalingMode::block_128x128, A, B}, tl{ScalingMode::block_128x128, B, A};
  const auto scale_bytes = static_cast<std::size_t>(E * (sl.count() + tl.count())) * 4;
  if (cache_.E != E || cache_.A != A || cache_.B != B || cache_.scales.bytes() < scale_bytes) {
    if (cache_.scales.data()) ops_.synchronize();  // another shape: the old codes and scales may still be read
    cache_.scales = Buffer();
    cache_.own = Buffer();
    cache_.scales = ops_.alloc(scale_bytes);
  }
  if (in_compute) {
    cache_.stored = static_cast<std::uint8_t*>(compute_.data);
  } else {
    if (!cache_.own.data()) cache_.own = ops_.alloc(2 * per * static_cast<std::size_t>(E));
    cache_.stored = static_cast<std::uint8_t*>(cache_.own.data());
  }
  cache_.transposed = cache_.stored + per * static_cast<std::size_t>(E);
  cache_.E = E;
  cache_.A = A;
  cache_.B = B;
}

void Fp8BlockGroupedLinear::ensure_weight(const TensorView& w, std::int64_t version) {
  KILN_CHECK(w.ndim() == 3, name_, ": a stacked weight [E, A, B], got ", w.str());
  const std::int64_t E = w.size(0), A = w.size(1), B = w.size(2);
  if (cache_.valid && cache_.version == version && cache_.source == w.data && cache_.E == E && cache_.A == A &&
      cache_.B == B)
    return;
  // The compute copy's memory holds both copies (2 bytes per element), made from the master.
  const bool in_compute = master_ && w.data == compute_.data && w.numel() == compute_.numel();
  place_codes(E, A, B, in_compute);
  const TensorView src = (in_compute ? master_ : w).reshape({E * A, B});
  const std::vector<BlockGroup> groups = weight_groups();
  ops_.quantize_blocks_grouped({src, ScalingMode::block_128x128, recipe_.pow2, groups});
  cache_.valid = true;
  cache_.version = version;
  cache_.source = w.data;
}

void Fp8BlockGroupedLinear::update_weight(AdamWQuantizeArgs u, std::int64_t version) {
  KILN_CHECK(master_, name_, ": update_weight needs use_master_weight");
  const std::int64_t n = master_.numel();
  for (const TensorView* t : {&u.grad, &u.m, &u.v})
    KILN_CHECK(t->numel() == n && t->contiguous(), name_, ": update_weight's grad, m and v must have ", n,
               " elements, got ", t->str());
  const std::int64_t E = cache_.E, A = cache_.A, B = cache_.B;
  if (E == 0 || E * A * B != n) {  // no forward yet: the step alone
    adamw_step_alone(ops_, u, master_);
    cache_.valid = false;
    return;
  }
  place_codes(E, A, B, true);
  u.param = master_.reshape({E * A, B});
  u.grad = u.grad.reshape({E * A, B});
  u.m = u.m.reshape({E * A, B});
  u.v = u.v.reshape({E * A, B});
  const std::vector<BlockGroup> groups = weight_groups();
  ops_.adamw_quantize_blocks_grouped(u, {TensorView{}, ScalingMode::block_128x128, recipe_.pow2, groups});
  cache_.valid = true;
  cache_.version = version;
  cache_.source = compute_.data;
}

std::vector<BlockGroup> Fp8BlockGroupedLinear::weight_groups() const {
  std::vector<BlockGroup> groups;
  for (std::int64_t e = 0; e < cache_.E; ++e) {
    const WeightOperand s = stored(e), t = transposed(e);
    groups.push_back({e * cache_.A, cache_.A, s.codes, s.scale_inv, t.codes, t.scale_inv});
  }
  return groups;
}

Fp8BlockGroupedLinear::WeightOperand Fp8BlockGroupedLinear::stored(std::int64_t e) const {
  const std::int64_t A = cache_.A, B = cache_.B;
  const BlockLayout sl{ScalingMode::block_128x128, A, B};
  return {TensorView(cache_.stored + e * A * B, {A, B}, dtype_of(recipe_.weight), ops_.device()),
          static_cast<float*>(cache_.scales.data()) + e * sl.count()};
}

Fp8BlockGroupedLinear::WeightOperand Fp8BlockGroupedLinear::transposed(std::int64_t e) const {
  const std::int64_t A = cache_.A, B = cache_.B;
  const BlockLayout sl{ScalingMode::block_128x128, A, B}, tl{ScalingMode::block_128x128, B, A};
  return {TensorView(cache_.transposed + e * A * B, {B, A}, dtype_of(recipe_.weight), ops_.device()),
          static_cast<float*>(cache_.scales.data()) + cache_.E * sl.count() + e * tl.count()};
}

std::uint8_t* Fp8BlockGroupedLinear::kept_input(const std::int32_t* off, int E, std::int64_t cols,
                                                std::size_t bytes) {
  if (kept_.bytes() < bytes) {  // the old buffer may still be read by the device
    if (kept_.data()) ops_.synchronize();
    kept_ = Buffer();
    kept_ = ops_.alloc(with_room(bytes));
  }
  kept_off_.assign(off, off + E + 1);
  kept_cols_ = cols;
  return static_cast<std::uint8_t*>(kept_.data());
}

namespace {

// Each expert's product d = X @ Y^T (block-scaled), run together (Fp8Ops::gemm_grouped: concurrent
// on CUDA): an expert whose X has round_up(n, 4) rows of which n are real writes its n rows of d
// directly where the padding is none, else into its own scratch, whose n rows are copied out after.
class ExpertProducts {
 public:
  ExpertProducts(Fp8Ops& ops, const char* what) : ops_(ops), what_(what) {}
  // The scratch the padded products of experts with these row counts need, for results of `cols`
  // columns of `dtype`.
  static std::size_t scratch_bytes(const std::int32_t* off, int E, std::int64_t cols, DType dtype) {
    std::size_t n = 0;
    for (int e = 0; e < E; ++e) {
      const std::int64_t rows = off[e + 1] - off[e];
      if (rows % 4 != 0) n += round256(static_cast<std::size_t>(round_up(rows, 4) * cols) * size_of(dtype));
    }
    return n;
  }
  void set_scratch(std::uint8_t* p) { scratch_ = p; }
  void add(const TensorView& x, const float* x_scale_inv, const TensorView& y, const float* y_scale_inv,
           const TensorView& d) {
    GemmArgs g = block_product(x, x_scale_inv, ScalingMode::block_1x128, y, y_scale_inv, ScalingMode::block_128x128,
                               d, what_);
    if (x.size(0) != d.size(0)) {  // padded rows: into scratch, copied out after
      g.d = TensorView(scratch_, {x.size(0), d.size(1)}, d.dtype, d.device);
      scratch_ += round256(g.d.bytes());
      copies_.push_back({d, g.d.data});
    }
    gs_.push_back(g);
  }
  void run() {
    ops_.gemm_grouped(gs_);
    for (const auto& [d, from] : copies_) ops_.copy_on_device(d.data, from, d.bytes());
  }

 private:
  Fp8Ops& ops_;
  const char* what_;
  std::uint8_t* scratch_ = nullptr;
  std::vector<GemmArgs> gs_;
  std::vector<std::pair<TensorView, const void*>> copies_;
};

}  // namespace

void Fp8BlockGroupedLinear::forward(const ops::GroupedLinearForward& a, std::int64_t weight_version) {
  const QuantizeSource x = to_source(a.x);
  const Shape xs = source_shape(x, (name_ + " forward input").c_str());
  KILN_CHECK(a.weight.ndim() == 3 && a.offsets_host && xs[0] == a.out.size(0) && a.out.ndim() == 2, name_,
             " forward: weight ", a.weight.str(), ", x ", xs.str(), ", out ", a.out.str());
  const std::int64_t R = xs[0], IC = xs[1], OC = a.out.size(1);
  const int E = ops::row_groups(a.groups, a.weight.size(0));  // the row groups, each through its expert's weight
  KILN_CHECK((a.weight_in_out ? a.weight.size(1) == IC && a.weight.size(2) == OC
                              : a.weight.size(1) == OC && a.weight.size(2) == IC),
             name_, " forward: weight ", a.weight.str(), " for x ", xs.str(), " and out ", a.out.str());
  ensure_weight(a.weight, weight_version);
  const std::int32_t* off = a.offsets_host;
  KILN_CHECK(off[0] == 0 && off[E] <= R, name_, " forward: offsets 0..", off[E], " for ", R, " rows");
  // Each expert's rows, 1x128 along IC, padded to 4 rows; with keep_input, the transposes the
  // backward's weight gradient reads (padded to 16 columns), made from the same read where they are
  // 1x128 too.
  Grouped xq(off, E, [&](std::int64_t n) { return BlockLayout{ScalingMode::block_1x128, round_up(n, 4), IC}; });
  const ScalingMode col_mode = input_col_mode(a.weight_in_out);
  std::optional<Grouped> xc;
  if (keep_input_) {
    xc.emplace(off, E, [&](std::int64_t n) { return BlockLayout{col_mode, IC, round_up(n, 16)}; });
    xc->place(kept_input(off, E, IC, xc->bytes()));
  }
  if (off[E] == 0) return;
  ExpertProducts products(ops_, "fp8_block_grouped_gemm_fwd");
  std::uint8_t* scratch =
      ws_.get(with_room(xq.bytes() + ExpertProducts::scratch_bytes(off, E, OC, a.out.dtype)));
  products.set_scratch(xq.place(scratch));
  const Device dev = ops_.device();
  const bool one_read = keep_input_ && col_mode == ScalingMode::block_1x128;
  std::vector<BlockGroup> groups, col_groups;
  for (int e = 0; e < E; ++e) {
    const std::int64_t n = off[e + 1] - off[e];
    if (n == 0) continue;
    const TensorView codes = xq.codes_of(e, recipe_.input, dev);
    BlockGroup g{off[e], n, codes, xq.scales_of(e)};
    if (keep_input_) {
      BlockGroup& kept = one_read ? g : col_groups.emplace_back(BlockGroup{off[e], n});
      kept.colwise = xc->codes_of(e, recipe_.input, dev);
      kept.col_scale_inv = xc->scales_of(e);
    }
    groups.push_back(g);
    const int we = ops::group_expert(a.expert_of, e);
    const WeightOperand w = a.weight_in_out ? transposed(we) : stored(we);
    products.add(codes, xq.scales_of(e), w.codes, w.scale_inv, a.out.rows(off[e], n));
  }
  ops_.quantize_blocks_grouped({x, ScalingMode::block_1x128, recipe_.pow2, groups});
  if (!col_groups.empty()) ops_.quantize_blocks_grouped({x, col_mode, recipe_.pow2, col_groups});
  products.run();
}

void Fp8BlockGroupedLinear::backward(const ops::GroupedLinearBackward& a) {
  const QuantizeSource dout = to_source(a.dout);
  const Shape ds = source_shape(dout, (name_ + " backward output gradient").c_str());
  KILN_CHECK(a.weight.ndim() == 3 && a.offsets_host, name_, " backward: weight ", a.weight.str(), ", dout ", ds.str());
  const std::int64_t R = ds[0], OC = ds[1], IC = a.weight_in_out ? a.weight.size(1) : a.weight.size(2);
  const int experts_w = static_cast<int>(a.weight.size(0));
  const int E = ops::row_groups(a.groups, experts_w);  // the row groups, each through its expert's weight
  // The input (not read where kept from the forward).
  const QuantizeSource x = keep_input_ ? QuantizeSource{} : to_source(a.x);
  if (!keep_input_) {
    const Shape xs = source_shape(x, (name_ + " backward input").c_str());
    KILN_CHECK(xs[0] == R && xs[1] == IC, name_, " backward: x ", xs.str(), " for dout ", ds.str(), " and weight ",
               a.weight.str());
  }
  KILN_CHECK(a.dweight.dtype != DType::bf16, name_, ": a bf16 gradient (optim.grads = \"bf16\") is not supported by the block-scaled grouped FP8 linears yet");
  KILN_CHECK((a.weight_in_out ? a.weight.size(2) == OC : a.weight.size(1) == OC) && a.dweight.dtype == DType::f32 &&
                 a.dweight.shape == a.weight.shape,
             name_, " backward: weight ", a.weight.str(), " and dweight ", a.dweight.str(), " for dout ", ds.str());
  if (!cache_.valid || cache_.source != a.weight.data) ensure_weight(a.weight, cache_.version);
  const std::int32_t* off = a.offsets_host;
  KILN_CHECK(off[0] == 0 && off[E] <= R, name_, " backward: offsets 0..", off[E], " for ", R, " rows");
  const std::int64_t used = off[E];
  if (a.dx && used < R) {  // rows past the experts' get a zero gradient
    const TensorView rest = a.dx.rows(used, R - used);
    ops_.zero(rest.data, rest.bytes());
  }
  // The output gradient: rowwise (the data gradient's, rows padded to 4) and its transpose (the
  // weight gradient's, the rows padded to 16); the input's transpose (padded to 16; kept from the
  // forward with keep_input). The 128x128 option for the input where it is the weight gradient's
  // second operand (an FC1).
  const ScalingMode xc_mode = input_col_mode(a.weight_in_out);
  const bool dx = static_cast<bool>(a.dx);
  Grouped gr(off, E, [&](std::int64_t n) { return BlockLayout{ScalingMode::block_1x128, dx ? round_up(n, 4) : 0, OC}; });
  Grouped gc(off, E, [&](std::int64_t n) { return BlockLayout{ScalingMode::block_1x128, OC, round_up(n, 16)}; });
  Grouped xc(off, E, [&](std::int64_t n) { return BlockLayout{xc_mode, IC, round_up(n, 16)}; });
  if (keep_input_) {
    KILN_CHECK(kept_cols_ == IC && kept_off_ == std::vector<std::int32_t>(off, off + E + 1) && kept_.bytes() >= xc.bytes(),
               name_, ": backward without its forward's kept input (another grouping or width)");
    xc.place(static_cast<std::uint8_t*>(kept_.data()));
  }
  std::uint8_t* scratch = ws_.get(with_room(gr.bytes() + gc.bytes() + (keep_input_ ? 0 : xc.bytes()) +
                                            (dx ? ExpertProducts::scratch_bytes(off, E, IC, a.dx.dtype) : 0)));
  std::uint8_t* next = gc.place(gr.place(scratch));
  if (!keep_input_) next = xc.place(next);
  ExpertProducts dgrad(ops_, "fp8_block_grouped_gemm_dgrad");
  dgrad.set_scratch(next);
  // The weight gradient in passes where groups share an expert (ops::weight_grad_passes): each group's
  // product in its pass's list; experts without rows written zero (with overwrite).
  const std::vector<std::vector<int>> passes = ops::weight_grad_passes(off, E, a.expert_of);
  std::vector<int> pass_of(static_cast<std::size_t>(E), 0);
  for (std::size_t p = 0; p < passes.size(); ++p)
    for (const int g : passes[p]) pass_of[static_cast<std::size_t>(g)] = static_cast<int>(p);
  if (a.dweight_overwrite)
    for (const int e : ops::experts_without_rows(off, E, a.expert_of, experts_w)) {
      const TensorView dw = expert_matrix(a.dweight, e);
      ops_.zero(dw.data, dw.bytes());
    }
  std::vector<std::vector<GemmArgs>> wgrad(passes.size());
  std::vector<BlockGroup> dout_groups, x_groups;
  const Device dev = ops_.device();
  for (int e = 0; e < E; ++e) {  // e: the row group
    const std::int64_t n = off[e + 1] - off[e];
    const int we = ops::group_expert(a.expert_of, e);
    const TensorView dw = expert_matrix(a.dweight, we);
    if (n == 0) continue;
    const TensorView g_row = dx ? gr.codes_of(e, recipe_.grad, dev) : TensorView{};
    const TensorView g_col = gc.codes_of(e, recipe_.grad, dev), x_col = xc.codes_of(e, recipe_.input, dev);
    dout_groups.push_back({off[e], n, g_row, dx ? gr.scales_of(e) : nullptr, g_col, gc.scales_of(e)});
    if (!keep_input_) x_groups.push_back({off[e], n, {}, nullptr, x_col, xc.scales_of(e)});
    // wgrad: dW[e] [OC, IC] (+)= dout^T @ x (an FC2's [IC, OC] = x^T @ dout), K the padded rows.
    GemmArgs w = a.weight_in_out ? block_product(x_col, xc.scales_of(e), ScalingMode::block_1x128, g_col,
                                                 gc.scales_of(e), ScalingMode::block_1x128, dw,
                                                 "fp8_block_grouped_gemm_wgrad")
                                 : block_product(g_col, gc.scales_of(e), ScalingMode::block_1x128, x_col,
                                                 xc.scales_of(e), xc_mode, dw, "fp8_block_grouped_gemm_wgrad");
    const int pass = pass_of[static_cast<std::size_t>(e)];
    w.f32_result = true;
    w.accumulate = !(a.dweight_overwrite && pass == 0);
    wgrad[static_cast<std::size_t>(pass)].push_back(w);
    // dgrad: dx[e] [n, IC] = dout[e] @ W[e]: the copy of the weight whose rows are IC.
    if (!dx) continue;
    const WeightOperand wt = a.weight_in_out ? stored(we) : transposed(we);
    dgrad.add(g_row, gr.scales_of(e), wt.codes, wt.scale_inv, a.dx.rows(off[e], n));
  }
  ops_.quantize_blocks_grouped({dout, ScalingMode::block_1x128, recipe_.pow2, dout_groups});
  if (!keep_input_) ops_.quantize_blocks_grouped({x, xc_mode, recipe_.pow2, x_groups});
  if (dx) dgrad.run();
  if (dx && a.dx_gelu_pre && used > 0) ops_.dgelu(a.dx.rows(0, used), a.dx_gelu_pre.rows(0, used));
  if (a.dgrad_queued) a.dgrad_queued();
  for (const std::vector<GemmArgs>& pass : wgrad) ops_.gemm_grouped(pass);
}

}  // namespace kiln::fp8
