// Fp8BlockLinear: the three block-scaled FP8 GEMMs of a linear layer (kiln/fp8/block_linear.hpp).
#include "kiln/fp8/block_linear.hpp"

#include <utility>

#include "align.hpp"
#include "block_product.hpp"
#include "kiln/core/error.hpp"
#include "ops_checks.hpp"

namespace kiln::fp8 {

namespace {


// Carves [rows, cols] codes and their block scales out of a scratch area, each 256-byte aligned.
class Carver {
 public:
  using Part = Fp8BlockLinear::Operand;
  // The bytes `parts` need: (codes, layout) pairs.
  static std::size_t bytes(std::initializer_list<BlockLayout> layouts) {
    std::size_t n = 0;
    for (const auto& l : layouts)
      n += round256(static_cast<std::size_t>(l.rows * l.cols)) + round256(static_cast<std::size_t>(l.count()) * 4);
    return n;
  }
  Carver(std::uint8_t* base, Device dev) : p_(base), dev_(dev) {}
  Part take(const BlockLayout& l, Format f) {
    Part part{TensorView(p_, {l.rows, l.cols}, dtype_of(f), dev_), nullptr};
    p_ += round256(static_cast<std::size_t>(l.rows * l.cols));
    part.scale_inv = reinterpret_cast<float*>(p_);
    p_ += round256(static_cast<std::size_t>(l.count()) * 4);
    return part;
  }

 private:
  std::uint8_t* p_;
  Device dev_;
};

}  // namespace

Fp8BlockLinear::Fp8BlockLinear(Fp8Ops& ops, Fp8Workspace& workspace, const BlockRecipe& recipe, std::string name,
                               bool keep_input)
    : ops_(ops), ws_(workspace), recipe_(recipe), name_(std::move(name)), keep_input_(keep_input) {
  KILN_CHECK(recipe.input == Format::e4m3 && recipe.weight == Format::e4m3, name_,
             ": the forward GEMM needs E4M3 input and weight (E5M2 x E5M2 products do not exist)");
}

BlockLayout Fp8BlockLinear::input_transpose(std::int64_t N, std::int64_t IC) const {
  return {recipe_.wgrad_input_2d ? ScalingMode::block_128x128 : ScalingMode::block_1x128, IC, N};
}

Fp8BlockLinear::Operand Fp8BlockLinear::kept_input(std::int64_t N, std::int64_t IC) {
  const BlockLayout l = input_transpose(N, IC);
  const std::size_t bytes = Carver::bytes({l});
  if (kept_.bytes() < bytes) {
    if (kept_.data()) ops_.synchronize();  // the old copy may still be read
    kept_ = ops_.alloc(bytes);
  }
  kept_rows_ = N;
  kept_cols_ = IC;
  return Carver(static_cast<std::uint8_t*>(kept_.data()), ops_.device()).take(l, recipe_.input);
}

void Fp8BlockLinear::use_master_weight(const TensorView& master, const TensorView& compute) {
  KILN_CHECK(master.dtype == DType::f32 && master.ndim() == 2 && master.contiguous() && compute.shape == master.shape &&
                 compute.contiguous() && size_of(compute.dtype) >= 2,
             name_, ": use_master_weight needs an f32 master and a compute copy of at least two bytes per element of "
                    "the same shape, got ", master.str(), " and ", compute.str());
  master_ = master;
  compute_ = compute;
  cache_.valid = false;
}

void Fp8BlockLinear::place_codes(std::int64_t OC, std::int64_t IC, bool in_compute) {
  const BlockLayout rl{ScalingMode::block_128x128, OC, IC}, cl{ScalingMode::block_128x128, IC, OC};
  const auto n = static_cast<std::size_t>(OC * IC);
  if (cache_.rows != OC || cache_.cols != IC || !cache_.row_scales.data()) {
    if (cache_.row_scales.data()) ops_.synchronize();  // another shape: the old codes and scales may still be read
    cache_.row_scales = ops_.alloc(static_cast<std::size_t>(rl.count()) * 4);
    cache_.col_scales = ops_.alloc(static_cast<std::size_t>(cl.count()) * 4);
    cache_.own_rowwise = Buffer();
    cache_.own_colwise = Buffer();
  }
  if (in_compute) {
    cache_.rowwise = compute_.data;
    cache_.colwise = static_cast<std::uint8_t*>(compute_.data) + n;
  } else {
    if (!cache_.own_rowwise.data()) {
      cache_.own_rowwise = ops_.alloc(n);
      cache_.own_colwise = ops_.alloc(n);
    }
    cache_.rowwise = cache_.own_rowwise.data();
    cache_.colwise = cache_.own_colwise.data();
  }
  cache_.rows = OC;
  cache_.cols = IC;
}

// Both copies of the weight's codes (cache_'s shape and places) and their scales, as the quantisation's output.
BlockQuantizeArgs Fp8BlockLinear::weight_codes() const {
  const Device dev = ops_.device();
  const DType wt = dtype_of(recipe_.weight);
  return {TensorView{},
          ScalingMode::block_128x128,
          recipe_.pow2,
          TensorView(cache_.rowwise, {cache_.rows, cache_.cols}, wt, dev),
          static_cast<float*>(cache_.row_scales.data()),
          TensorView(cache_.colwise, {cache_.cols, cache_.rows}, wt, dev),
          static_cast<float*>(cache_.col_scales.data())};
}

void Fp8BlockLinear::ensure_weight(const TensorView& w, std::int64_t version) {
  const std::int64_t OC = w.size(0), IC = w.size(1);
  if (cache_.valid && cache_.version == version && cache_.source == w.data && cache_.rows == OC && cache_.cols == IC)
    return;
  // The compute copy's memory holds both copies (2 bytes per element), made from the master.
  const bool in_compute = master_ && w.data == compute_.data && w.shape == compute_.shape;
  place_codes(OC, IC, in_compute);
  BlockQuantizeArgs q = weight_codes();
  q.x = in_compute ? master_ : w;
  ops_.quantize_blocks(q);
  cache_.valid = true;
  cache_.version = version;
  cache_.source = w.data;
}

void Fp8BlockLinear::check_gathered(std::int64_t OC, std::int64_t IC) const {
  KILN_CHECK(gathered_.tile_amax && gathered_.rows == OC && gathered_.cols == IC, name_,
             ": a u8 weight [", OC, ", ", IC, "] is read as gathered codes, which need use_gathered_codes for that shape");
}

void Fp8BlockLinear::update_weight(AdamWQuantizeArgs u, std::int64_t version) {
  KILN_CHECK(master_, name_, ": update_weight needs use_master_weight");
  u.param = master_;
  place_codes(master_.size(0), master_.size(1), true);
  ops_.adamw_quantize_blocks(u, weight_codes());
  cache_.valid = true;
  cache_.version = version;
  cache_.source = compute_.data;
}

void Fp8BlockLinear::use_gathered_codes(std::int64_t rows, std::int64_t cols, float* tile_amax) {
  const BlockLayout rl{ScalingMode::block_128x128, rows, cols}, cl{ScalingMode::block_128x128, cols, rows};
  gathered_.rows = rows;
  gathered_.cols = cols;
  gathered_.tile_amax = tile_amax;
  gathered_.scale = ops_.alloc(static_cast<std::size_t>(rl.count()) * 4);
  cache_.row_scales = ops_.alloc(static_cast<std::size_t>(rl.count()) * 4);
  cache_.col_scales = ops_.alloc(static_cast<std::size_t>(cl.count()) * 4);
  cache_.valid = false;
}

BlockPart Fp8BlockLinear::part_of(const TensorView& part, std::int64_t first) const {
  KILN_CHECK(gathered_.tile_amax, name_, ": a weight part needs use_gathered_codes");
  KILN_CHECK(part.dtype == DType::f32 && part.contiguous() && first >= 0 &&
                 first + part.numel() <= gathered_.rows * gathered_.cols,
             name_, ": a part ", part.str(), " from element ", first, " of a [", gathered_.rows, ", ", gathered_.cols,
             "] weight");
  return BlockPart{part.as<float>(), part.numel(), first, gathered_.rows, gathered_.cols};
}

void Fp8BlockLinear::weight_part_amax(const TensorView& part, std::int64_t first) {
  ops_.block_part_amax(part_of(part, first), gathered_.tile_amax);
}

void Fp8BlockLinear::scales_from_amax() {
  ops_.block_scales(gathered_.tile_amax, gathered_.rows, gathered_.cols, recipe_.weight, recipe_.pow2,
                    static_cast<float*>(gathered_.scale.data()), static_cast<float*>(cache_.row_scales.data()),
                    static_cast<float*>(cache_.col_scales.data()));
}

void Fp8BlockLinear::quantize_weight_part(const TensorView& part, std::int64_t first, void* codes) {
  ops_.quantize_block_part(part_of(part, first), static_cast<const float*>(gathered_.scale.data()), recipe_.weight,
                           static_cast<std::uint8_t*>(codes));
}

void Fp8BlockLinear::forward(const ops::LinearForward& a, std::int64_t weight_version) {
  const DType act = ops_.act_dtype();
  const QuantizeSource x = to_source(a.x);
  const Shape xs = source_shape(x, (name_ + " forward input").c_str());
  KILN_CHECK(a.weight.ndim() == 2, name_, " forward: weight ", a.weight.str());
  const std::int64_t N = xs[0], IC = xs[1], OC = a.weight.size(0);
  const bool gathered = a.weight.dtype == DType::u8;  // the weight's gathered codes (use_gathered_codes)
  if (const auto* t = std::get_if<TensorView>(&a.x)) expect_matrix(*t, act, N, IC, name_ + " forward x");
  expect_matrix(a.weight, gathered ? DType::u8 : act, OC, IC, name_ + " forward weight");
  expect_matrix(a.out, act, N, OC, name_ + " forward out");
  if (a.pre_gelu) expect_matrix(a.pre_gelu, act, N, OC, name_ + " forward pre_gelu");
  if (gathered)
    check_gathered(OC, IC);
  else
    ensure_weight(a.weight, weight_version);
  const void* w_rowwise = gathered ? a.weight.data : cache_.rowwise;
  // A LayerNorm's output is computed on load from its statistics, which the forward computes (and
  // leaves for the backward pass, as layernorm_forward would).
  if (const auto* ln = std::get_if<ops::LayerNormOnLoad>(&a.x)) ops_.layernorm_stats(*ln, nullptr);

  const BlockLayout xl{ScalingMode::block_1x128, N, IC};
  Carver c(ws_.get(Carver::bytes({xl})), ops_.device());
  const auto xq = c.take(xl, recipe_.input);
  BlockQuantizeArgs q{x, ScalingMode::block_1x128, recipe_.pow2, xq.codes, xq.scale_inv};
  if (keep_input_) {  // the weight gradient's operand too: from the same read where it is 1x128 as well
    const Operand kept = kept_input(N, IC);
    const ScalingMode mode = input_transpose(N, IC).mode;
    if (mode == ScalingMode::block_1x128) {
      q.colwise = kept.codes;
      q.col_scale_inv = kept.scale_inv;
    } else {
      ops_.quantize_blocks({x, mode, recipe_.pow2, {}, nullptr, kept.codes, kept.scale_inv});
    }
  }
  ops_.quantize_blocks(q);

  GemmArgs g = block_product(xq.codes, xq.scale_inv, ScalingMode::block_1x128,
                             TensorView(const_cast<void*>(w_rowwise), {OC, IC}, dtype_of(recipe_.weight), ops_.device()),
                             static_cast<const float*>(cache_.row_scales.data()), ScalingMode::block_128x128, a.out,
                             "fp8_block_gemm_fwd");
  g.bias = a.bias;
  if (a.pre_gelu) {
    g.epilogue = ops::Epilogue::gelu;
    g.aux = a.pre_gelu;
  } else if (a.bias) {
    g.epilogue = ops::Epilogue::bias;
  }
  ops_.gemm(g);
}

void Fp8BlockLinear::backward(const ops::LinearBackward& a) {
  const DType act = ops_.act_dtype();
  // The input is not read where its transpose was kept from the forward (keep_input).
  const QuantizeSource x = keep_input_ ? QuantizeSource{} : to_source(a.x), dout = to_source(a.dout);
  const Shape gs = source_shape(dout, (name_ + " backward output gradient").c_str());
  KILN_CHECK(a.weight.ndim() == 2, name_, " backward: weight ", a.weight.str());
  const Shape xs = keep_input_ ? Shape{gs[0], a.weight.size(1)} : source_shape(x, (name_ + " backward input").c_str());
  const std::int64_t N = xs[0], IC = xs[1], OC = a.weight.size(0);
  KILN_CHECK(gs == Shape({N, OC}), name_, " backward: the output gradient ", gs.str(), " for the input ", xs.str(),
             " and weight ", a.weight.str());
  KILN_CHECK(!keep_input_ || (kept_.data() && kept_rows_ == N && kept_cols_ == IC), name_, ": backward of [", N, ", ",
             IC, "] without the forward's kept input (its last forward was [", kept_rows_, ", ", kept_cols_, "])");
  if (const auto* t = std::get_if<TensorView>(&a.x); t && !keep_input_) expect_matrix(*t, act, N, IC, name_ + " backward x");
  if (const auto* t = std::get_if<TensorView>(&a.dout)) expect_matrix(*t, act, N, OC, name_ + " backward dout");
  const bool gathered = a.weight.dtype == DType::u8;
  expect_matrix(a.weight, gathered ? DType::u8 : act, OC, IC, name_ + " backward weight");
  KILN_CHECK(a.dweight.dtype != DType::bf16, name_, ": a bf16 gradient (optim.grads = \"bf16\") is not supported by the block-scaled FP8 linears yet");
  expect_matrix(a.dweight, DType::f32, OC, IC, name_ + " backward dweight");
  if (a.dx) expect_matrix(a.dx, act, N, IC, name_ + " backward dx");
  if (a.dx_gelu_pre) expect_matrix(a.dx_gelu_pre, act, N, IC, name_ + " backward dx_gelu_pre");
  if (a.dbias) KILN_CHECK(a.dbias.dtype == DType::f32 && a.dbias.numel() == OC, name_, " backward dbias ", a.dbias.str());
  // The forward made the weight's copies; another tensor (a library caller) is quantised again.
  if (gathered)
    check_gathered(OC, IC);
  else if (!cache_.valid || cache_.source != a.weight.data)
    ensure_weight(a.weight, cache_.version);

  // The output gradient along OC (data gradient) and along N (weight gradient), the input along N;
  // gathered codes' transpose (its scales are cache_.col_scales).
  const BlockLayout gr{ScalingMode::block_1x128, N, OC}, gc{ScalingMode::block_1x128, OC, N}, xc = input_transpose(N, IC),
      wt{ScalingMode::block_128x128, IC, OC};
  const ScalingMode xc_mode = xc.mode;
  Carver c(ws_.get(Carver::bytes({gr, gc}) + (keep_input_ ? 0 : Carver::bytes({xc})) +
                   (gathered && a.dx ? Carver::bytes({wt}) : 0)),
           ops_.device());
  const auto g_row = c.take(gr, recipe_.grad), g_col = c.take(gc, recipe_.grad);
  // With keep_input, the forward's transpose (its shape checked above: nothing grows).
  const Operand x_col = keep_input_ ? kept_input(N, IC) : c.take(xc, recipe_.input);
  const void* w_colwise = cache_.colwise;
  if (gathered && a.dx) {
    const auto t = c.take(wt, recipe_.weight);
    ops_.transpose(TensorView(t.codes.data, {IC, OC}, DType::u8, ops_.device()), a.weight);
    w_colwise = t.codes.data;
  }
  // The output gradient's two copies and the bias gradient in one pass (the rowwise copy only for
  // the data gradient); a prologue's values (dGELU, dSwiGLU) computed as they are loaded.
  BlockQuantizeArgs gq{dout, ScalingMode::block_1x128, recipe_.pow2, a.dx ? g_row.codes : TensorView{},
                       a.dx ? g_row.scale_inv : nullptr, g_col.codes, g_col.scale_inv};
  gq.dbias = a.dbias;
  ops_.quantize_blocks(gq);
  // The input's copy before dx is written (dx may share memory with what the input is computed from).
  if (!keep_input_) ops_.quantize_blocks({x, xc_mode, recipe_.pow2, {}, nullptr, x_col.codes, x_col.scale_inv});

  // dgrad before wgrad, so that what the caller queues on dx (ops::LinearBackward::dgrad_queued) runs
  // beside the weight gradient: dx[N, IC] = dout @ W = dout[N, OC] @ (W^T)[IC, OC]^T, the weight's
  // transposed tiles.
  if (a.dx) {
    GemmArgs d = block_product(g_row.codes, g_row.scale_inv, ScalingMode::block_1x128,
                               TensorView(const_cast<void*>(w_colwise), {IC, OC}, dtype_of(recipe_.weight),
                                          ops_.device()),
                               static_cast<const float*>(cache_.col_scales.data()), ScalingMode::block_128x128, a.dx,
                               "fp8_block_gemm_dgrad");
    if (a.dx_gelu_pre) {
      d.epilogue = ops::Epilogue::dgelu;
      d.aux = a.dx_gelu_pre;
    }
    ops_.gemm(d);
    if (a.dgrad_queued) a.dgrad_queued();
  }

  // wgrad: dW[OC, IC] (+)= dout^T @ x, both 1x128 along the tokens (x^T 128x128 with wgrad_input_2d).
  GemmArgs w = block_product(g_col.codes, g_col.scale_inv, ScalingMode::block_1x128, x_col.codes, x_col.scale_inv,
                             xc_mode, a.dweight, "fp8_block_gemm_wgrad");
  w.f32_result = true;
  w.accumulate = !a.dweight_overwrite;
  ops_.gemm(w);
}

}  // namespace kiln::fp8
