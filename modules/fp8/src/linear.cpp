// Fp8Linear: the three FP8 GEMMs of a linear layer and the scaling decisions around them.
#include "kiln/fp8/linear.hpp"

#include "kiln/core/error.hpp"
#include "kiln/tensor/alignment.hpp"
#include "ops_checks.hpp"
#include "scaling.hpp"

namespace kiln::fp8 {

std::uint8_t* Fp8Workspace::get(std::size_t bytes) {
  if (bytes <= lent_bytes_) return lent_;
  if (buf_.bytes() < bytes) {
    ops_.synchronize();  // the old buffer may still be read by queued work
    buf_ = Buffer();     // freed before the larger one is taken
    buf_ = ops_.alloc(bytes);
  }
  return static_cast<std::uint8_t*>(buf_.data());
}

Fp8Linear::Fp8Linear(Fp8Ops& ops, Fp8MetaStore& meta, int first_slot, Fp8Workspace& workspace,
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

Fp8TensorView Fp8Linear::view(const ScalingSlot& s, void* rowwise, void* colwise, std::int64_t rows,
                              std::int64_t cols) const {
  Fp8TensorView v;
  const Device dev = ops_.device();
  if (rowwise) v.rowwise = TensorView(rowwise, {rows, cols}, dtype_of(s.format), dev);
  if (colwise) v.colwise = TensorView(colwise, {cols, rows}, dtype_of(s.format), dev);
  v.format = s.format;
  v.scale = s.scale;
  v.scale_inv = s.scale_inv;
  return v;
}

float* Fp8Linear::prepare_scale(const ScalingSlot& s, const TensorView& t, ops::Prologue f) {
  return prepare_scale(s, [&](float* into) {
    if (f == ops::Prologue::gelu)
      ops_.amax_gelu(t, into);
    else if (f == ops::Prologue::swiglu)
      ops_.amax_swiglu(t, into);
    else
      ops_.amax(t, into);
  });
}

void Fp8Linear::quantize_input(const Input& in, const Fp8TensorView& out, float* amax) {
  if (in.prologue == ops::Prologue::gelu)
    ops_.quantize_gelu(in.x, out, amax);
  else if (in.prologue == ops::Prologue::swiglu)
    ops_.quantize_swiglu(in.x, out, amax);
  else
    ops_.quantize(in.x, out, amax);
}

Fp8Linear::Input Fp8Linear::input_of(const ops::LinearInput& x, const char* pass) const {
  Input in;
  in.prologue = ops::prologue_of(x);
  if (const auto* t = std::get_if<TensorView>(&x)) in.x = *t;
  if (const auto* g = std::get_if<ops::GeluOnLoad>(&x)) in.x = g->pre;
  if (const auto* g = std::get_if<ops::SwigluOnLoad>(&x)) in.x = g->gate_up;
  if (const auto* l = std::get_if<ops::LayerNormOnLoad>(&x)) {
    in.x = l->x;
    in.layernorm = l;
  }
  in.what = cat(name_, " ", pass, " x (", ops::name_of(in.prologue), ")");
  KILN_CHECK(in.x.ndim() == 2, in.what, ": expected [rows, cols], got ", in.x.str());
  const bool swiglu = in.prologue == ops::Prologue::swiglu;
  in.N = in.x.size(0);
  in.IC = swiglu ? in.x.size(1) / 2 : in.x.size(1);
  KILN_CHECK(!swiglu || in.x.size(1) % 2 == 0, in.what, ": expected [N, 2 IC], got ", in.x.str());
  return in;
}

float* Fp8Linear::prepare_scale(const ScalingSlot& s, const std::function<void(float*)>& amax) {
  return fp8::prepare_scale(ops_, meta_, recipe_, s, amax);
}

bool Fp8Linear::weight_cached(const TensorView& w) const {
  return cache_.valid && cache_.source == w.data && cache_.rows == w.size(0) && cache_.cols == w.size(1);
}

void Fp8Linear::use_master_weight(const TensorView& master, const TensorView& compute) {
  KILN_CHECK(master.dtype == DType::f32 && master.ndim() == 2 && master.contiguous() && compute.ndim() == 2 &&
                 compute.shape == master.shape && compute.contiguous() && size_of(compute.dtype) >= 2 &&
                 aligned16(compute.data) && master.numel() % 16 == 0,
             name_, ": use_master_weight needs an f32 master and a 16-byte aligned compute copy of at least two bytes "
                    "per element of the same shape, got ", master.str(), " and ", compute.str());
  master_ = master;
  compute_ = compute;
  cache_.valid = false;
}

void Fp8Linear::ensure_weight(const TensorView& w, std::int64_t version) {
  if (weight_cached(w) && cache_.version == version) return;
  const std::int64_t OC = w.size(0), IC = w.size(1);
  const std::size_t bytes = static_cast<std::size_t>(OC * IC);
  // The compute copy's memory holds both FP8 copies (2 bytes per element), made from the master.
  const bool in_compute = master_ && w.data == compute_.data && w.shape == compute_.shape;
  const TensorView src = in_compute ? master_ : w;
  if (in_compute) {
    cache_.rowwise = compute_.data;
    cache_.colwise = static_cast<std::uint8_t*>(compute_.data) + bytes;
  } else {
    if (cache_.own_rowwise.bytes() < bytes) {
      ops_.synchronize();
      cache_.own_rowwise = ops_.alloc(bytes);
      cache_.own_colwise = ops_.alloc(bytes);
    }
    cache_.rowwise = cache_.own_rowwise.data();
    cache_.colwise = cache_.own_colwise.data();
  }
  const ScalingSlot s = slot(TensorRole::weight);
  float* record = prepare_scale(s, src);
  ops_.quantize(src, view(s, cache_.rowwise, cache_.colwise, OC, IC), record);
  cache_.valid = true;
  cache_.version = version;
  cache_.source = w.data;
  cache_.rows = OC;
  cache_.cols = IC;
}

void Fp8Linear::update_weight(AdamWQuantizeArgs u, std::int64_t version) {
  KILN_CHECK(master_, name_, ": update_weight needs use_master_weight");
  const std::int64_t OC = master_.size(0), IC = master_.size(1);
  u.param = master_;
  const ScalingSlot s = slot(TensorRole::weight);
  const bool quantise = recipe_.kind == RecipeKind::delayed && meta_.ready(s.index);
  if (quantise) {
    cache_.rowwise = compute_.data;
    cache_.colwise = static_cast<std::uint8_t*>(compute_.data) + OC * IC;
    u.out = view(s, cache_.rowwise, cache_.colwise, OC, IC);
    u.amax = s.amax;
  } else {
    u.out = {};
    u.amax = nullptr;
  }
  ops_.adamw_quantize(u);
  cache_.valid = quantise;
  cache_.version = version;
  cache_.source = compute_.data;
  cache_.rows = OC;
  cache_.cols = IC;
}

bool Fp8Linear::weight_scale_from_tensor() const {
  return recipe_.kind == RecipeKind::current || !meta_.ready(slot(TensorRole::weight).index);
}

float* Fp8Linear::weight_amax() {
  const ScalingSlot s = slot(TensorRole::weight);
  if (recipe_.kind == RecipeKind::current) {
    ops_.zero(s.amax_now, sizeof(float));
    return s.amax_now;
  }
  return s.amax;  // delayed scaling's first step: recorded as this step's
}

void Fp8Linear::weight_scale_from_amax() {
  const ScalingSlot s = slot(TensorRole::weight);
  ops_.scale_from_amax(recipe_.kind == RecipeKind::current ? s.amax_now : s.amax, s.scale, s.scale_inv, s.fp8_max,
                       recipe_.margin);
  if (recipe_.kind == RecipeKind::delayed) meta_.set_ready(s.index);
}

void Fp8Linear::quantize_weight_part(const TensorView& master_part, void* codes) {
  const ScalingSlot s = slot(TensorRole::weight);
  const std::int64_t n = master_part.numel();
  const bool record = recipe_.kind == RecipeKind::delayed && meta_.ready(s.index);
  ops_.quantize(master_part.reshape({1, n}), view(s, codes, nullptr, 1, n), record ? s.amax : nullptr);
}

void Fp8Linear::update_weight_part(AdamWQuantizeArgs u, void* codes) {
  const ScalingSlot s = slot(TensorRole::weight);
  KILN_CHECK(recipe_.kind == RecipeKind::delayed && meta_.ready(s.index), name_,
             ": a fused update of a weight part needs delayed scaling with a known scale");
  // A flat part, or a whole weight [rows, cols] (its rowwise codes alone).
  if (u.param.ndim() != 2) {
    const std::int64_t n = u.param.numel();
    for (TensorView* t : {&u.param, &u.grad, &u.m, &u.v}) *t = t->reshape({1, n});
  }
  u.out = view(s, codes, nullptr, u.param.size(0), u.param.size(1));
  u.amax = s.amax;
  ops_.adamw_quantize(u);
}

void Fp8Linear::forward(const ops::LinearForward& a, std::int64_t weight_version, bool replay) {
  gemm_forward(quantize_forward(a, weight_version, replay), a);
}

void Fp8Linear::forward_pieces(const ops::LinearForward& a, std::int64_t weight_version, bool replay,
                               std::span<const ops::RowsOut> pieces, const ops::PieceQueued& queued) {
  const TensorView xq = quantize_forward(a, weight_version, replay);
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    const ops::RowsOut& p = pieces[k];
    gemm_forward(xq.rows(p.begin, p.rows), ops::forward_rows(a, p.begin, p.rows, p.out));
    queued(k);
  }
}

void Fp8Linear::prepare_forward_weight(const TensorView& w, std::int64_t weight_version, bool replay) {
  KILN_CHECK(w.ndim() == 2, name_, " forward: weight ", w.str());
  if (w.dtype == DType::u8) {  // the gathered codes themselves (a replay gets the same again)
    cache_.rowwise = w.data;
    cache_.valid = false;
    return;
  }
  // A replay (activation recompute) reuses the original forward's FP8 weight and scales.
  KILN_CHECK(!replay || (weight_cached(w) && cache_.version == weight_version), name_,
             ": a replayed forward needs the weight of the original one");
  ensure_weight(w, weight_version);
}

void Fp8Linear::forward_gathered(const ops::LinearForward& a, const TensorView& local, std::int64_t weight_version,
                                 bool replay, const ops::RowGather& g) {
  const TensorView full = ops::plain_tensor(a.x);
  KILN_CHECK(full && full.ndim() == 2 && local.ndim() == 2 && local.size(1) == full.size(1) && g.first_row >= 0 &&
                 g.first_row + local.size(0) <= full.size(0),
             name_, " forward_gathered: rows ", local.str(), " at row ", g.first_row, " of the input ", full.str());
  const std::int64_t N = full.size(0), IC = full.size(1), Nl = local.size(0);
  expect_matrix(local, ops_.act_dtype(), Nl, IC, name_ + " forward_gathered local x");
  prepare_forward_weight(a.weight, weight_version, replay);
  const ScalingSlot s = slot(TensorRole::input);
  void* xq = ws_.get(static_cast<std::size_t>(N * IC));
  const TensorView codes(xq, {N, IC}, DType::u8, ops_.device()), x8(xq, {N, IC}, dtype_of(s.format), ops_.device());
  const TensorView mine = codes.rows(g.first_row, Nl);  // this rank's rows, quantised here
  // The scale where it comes from the tensor now: the largest of every rank's amax of its rows.
  float* record = replay ? nullptr : prepare_scale(s, [&](float* into) {
    ops_.amax(local, into);
    g.max(into);
  });
  ops_.quantize(local, view(s, mine.data, nullptr, Nl, IC), record);
  if (g.gather_pieces) {  // each piece's product as soon as its codes are here
    g.gather_pieces(codes, mine, [&](std::int64_t begin, std::int64_t rows) {
      gemm_forward(x8.rows(begin, rows), ops::forward_rows(a, begin, rows, a.out.rows(begin, rows)));
    });
  } else {
    g.all_gather(codes, mine);
    gemm_forward(x8, a);
  }
  if (keep_input_) ops_.transpose(TensorView(kept_input(N, IC), {IC, N}, DType::u8, ops_.device()), codes);
}

TensorView Fp8Linear::quantize_forward(const ops::LinearForward& a, std::int64_t weight_version, bool replay) {
  const DType act = ops_.act_dtype();
  // The input, or the pre-activation it is the GELU or SwiGLU of, or the residual it is the
  // LayerNorm of (any of them then computed while quantising).
  const Input in = input_of(a.x, "forward");
  const TensorView& x = in.x;
  const std::int64_t N = in.N, IC = in.IC;
  expect_matrix(x, act, N, x.size(1), in.what);
  prepare_forward_weight(a.weight, weight_version, replay);
  const ScalingSlot s = slot(TensorRole::input);
  void* xq = ws_.get(static_cast<std::size_t>(N * IC));
  const Fp8TensorView out = view(s, xq, keep_input_ ? kept_input(N, IC) : nullptr, N, IC);
  if (in.layernorm) {
    // The statistics first: in the pass that measures the output's amax where the scale needs it
    // now (prepare_scale then returns no record), else on their own (a replay too: the recompute
    // may not have kept them; it records no amax).
    const ops::LayerNormOnLoad& ln = *in.layernorm;
    float* record = replay ? nullptr : prepare_scale(s, [&](float* into) { ops_.layernorm_stats(ln, into); });
    if (replay || record) ops_.layernorm_stats(ln, nullptr);
    ops_.quantize_layernorm(ln, out, record);
  } else {
    float* record = replay ? nullptr : prepare_scale(s, x, in.prologue);
    quantize_input(in, out, record);
  }
  return TensorView(xq, {N, IC}, dtype_of(s.format), ops_.device());
}

void* Fp8Linear::kept_input(std::int64_t rows, std::int64_t cols) {
  const auto bytes = static_cast<std::size_t>(rows * cols);
  if (kept_.bytes() < bytes) {
    ops_.synchronize();
    kept_ = ops_.alloc(bytes);
  }
  kept_rows_ = rows;
  kept_cols_ = cols;
  return kept_.data();
}

void Fp8Linear::forward_quantized(const Fp8TensorView& x, const ops::LinearForward& a, std::int64_t weight_version) {
  const ScalingSlot s = slot(TensorRole::input);
  const TensorView input = ops::plain_tensor(a.x);
  KILN_CHECK(input, name_, " forward_quantized: the producer quantised the input; a ",
             ops::name_of(ops::prologue_of(a.x)), " prologue makes no sense");
  KILN_CHECK(x.rowwise && x.format == s.format && x.scale_inv == s.scale_inv, name_,
             " forward_quantized: the input must be a rowwise ", name_of(s.format),
             " tensor quantised with this layer's input scale");
  expect_matrix(x.rowwise, dtype_of(s.format), input.size(0), input.size(1), name_ + " forward_quantized x");
  ensure_weight(a.weight, weight_version);
  if (keep_input_) {  // the producer wrote the rowwise copy only: the colwise one from the input
    const std::int64_t N = input.size(0), IC = input.size(1);
    ops_.quantize(input, view(s, nullptr, kept_input(N, IC), N, IC), nullptr);
  }
  gemm_forward(x.rowwise, a);
}

void Fp8Linear::gemm_forward(const TensorView& xq, const ops::LinearForward& a) {
  const DType act = ops_.act_dtype();
  const std::int64_t N = xq.size(0), IC = xq.size(1), OC = a.weight.size(0);
  expect_matrix(a.weight, a.weight.dtype == DType::u8 ? DType::u8 : act, OC, IC, name_ + " forward weight");
  expect_matrix(a.out, act, N, OC, name_ + " forward out");
  if (a.bias) KILN_CHECK(a.bias.dtype == act && a.bias.numel() == OC, name_, " forward bias ", a.bias.str());
  if (a.pre_gelu) expect_matrix(a.pre_gelu, act, N, OC, name_ + " forward pre_gelu");
  const ScalingSlot sx = slot(TensorRole::input), sw = slot(TensorRole::weight);
  GemmArgs g;
  g.x = xq;
  g.x_scale_inv = sx.scale_inv;
  g.y = TensorView(cache_.rowwise, {OC, IC}, dtype_of(sw.format), ops_.device());
  g.y_scale_inv = sw.scale_inv;
  g.d = a.out;
  g.bias = a.bias;
  if (a.pre_gelu) {
    g.epilogue = ops::Epilogue::gelu;
    g.aux = a.pre_gelu;
  } else if (a.bias) {
    g.epilogue = ops::Epilogue::bias;
  }
  g.fast_accum = recipe_.fast_accum_forward;
  g.what = a.pre_gelu ? "fp8_gemm_forward_gelu" : "fp8_gemm_forward";
  ops_.gemm(g);
}

void Fp8Linear::backward(const ops::LinearBackward& a) {
  const DType act = ops_.act_dtype();
  const Input in = input_of(a.x, "backward");
  const TensorView& x = in.x;
  KILN_CHECK(a.weight.ndim() == 2, name_, " backward: weight ", a.weight.str());
  const std::int64_t N = in.N, IC = in.IC, OC = a.weight.size(0);
  if (!keep_input_) expect_matrix(x, act, N, x.size(1), in.what);
  const bool gathered = a.weight.dtype == DType::u8;  // the weight's gathered codes
  expect_matrix(a.weight, gathered ? DType::u8 : act, OC, IC, name_ + " backward weight");
  // The output gradient, or the gradient of its GELU (ops::DgeluOnLoad) with the pre-activation, or
  // of its SwiGLU (ops::DswigluOnLoad) with the SwiGLU's input (this layer's output).
  // Or, for an LM head, the cross-entropy's gradient made from the logits (ops::XentOnLoad).
  const auto* dgelu = std::get_if<ops::DgeluOnLoad>(&a.dout);
  const auto* dswiglu = std::get_if<ops::DswigluOnLoad>(&a.dout);
  const auto* xent = std::get_if<ops::XentOnLoad>(&a.dout);
  const TensorView dout = dgelu     ? dgelu->dgelu
                          : dswiglu ? dswiglu->dswiglu
                          : xent    ? xent->logits
                                    : std::get<TensorView>(a.dout);
  if (dswiglu) {
    expect_matrix(dout, act, N, OC / 2, name_ + " backward dout (dswiglu-on-load: the SwiGLU output's gradient)");
    expect_matrix(dswiglu->gate_up, act, N, OC, name_ + " backward dout's SwiGLU input (dswiglu-on-load)");
    KILN_CHECK(OC % 2 == 0 && !a.dbias, name_, ": dswiglu-on-load needs an even output width and no bias");
  } else {
    expect_matrix(dout, act, N, OC, name_ + " backward dout");
  }
  // The parameter gradients: f32, or both bf16 (optim.grads = "bf16"; the GEMM and the bias sum add
  // in f32 and round once).
  const DType grad = a.dweight.dtype == DType::bf16 ? DType::bf16 : DType::f32;
  expect_matrix(a.dweight, grad, OC, IC, name_ + " backward dweight");
  if (a.dx) expect_matrix(a.dx, act, N, IC, name_ + " backward dx");
  if (a.dx_gelu_pre) expect_matrix(a.dx_gelu_pre, act, N, IC, name_ + " backward dx_gelu_pre");
  if (a.dbias)
    KILN_CHECK(a.dbias.dtype == grad && a.dbias.numel() == OC, name_, " backward dbias: expected ", OC, " ",
               name_of(grad), " (dweight's dtype), got ", a.dbias.str());
  // The forward pass made the weight's copies; a different tensor (a library caller) is re-quantised.
  // Gathered codes give the colwise copy by a transpose, for the data gradient.
  void* weight_colwise = nullptr;
  if (gathered) {
    if (a.dx) {
      KILN_CHECK(transposed_, name_, ": a gathered FP8 weight needs a transpose scratch (use_transpose_scratch)");
      weight_colwise = transposed_->get(static_cast<std::size_t>(OC * IC));
      ops_.transpose(TensorView(weight_colwise, {IC, OC}, DType::u8, ops_.device()), a.weight);
    }
  } else {
    if (!weight_cached(a.weight)) ensure_weight(a.weight, cache_.version);
    weight_colwise = cache_.colwise;
  }

  const ScalingSlot sx = slot(TensorRole::input), sw = slot(TensorRole::weight), sg = slot(TensorRole::grad_output);
  const Device dev = ops_.device();
  // grad_output: both copies (dgrad reads rowwise, wgrad colwise), its amax and the bias gradient
  // in one pass, with the deferred dGELU folded in. Where the scale must first come from this very
  // tensor's amax (current scaling, or delayed scaling's first step), the dGELU is applied first.
  TensorView gelu_pre = dgelu ? dgelu->pre : TensorView{};
  const bool scale_first = recipe_.kind == RecipeKind::current || !meta_.ready(sg.index);
  if (gelu_pre) {
    expect_matrix(gelu_pre, act, N, OC, name_ + " backward dout's pre-activation (dgelu-on-load)");
    if (scale_first) {
      ops_.dgelu(dout, gelu_pre);
      gelu_pre = {};
    }
  }
  // The cross-entropy's gradient: written over the logits first where the scale needs its amax.
  if (xent) {
    KILN_CHECK(!a.dbias, name_, ": an LM head taking its cross-entropy gradient on load has no bias");
    if (scale_first) {
      ops_.xent_grad(*xent);
      xent = nullptr;
    }
  }
  // Scratch: grad_output rowwise and colwise, then (unless kept) the input's colwise copy.
  const auto gbytes = static_cast<std::size_t>(N * OC);
  std::uint8_t* scratch = ws_.get(2 * gbytes + (keep_input_ ? 0 : static_cast<std::size_t>(N * IC)));
  void* gr = scratch;
  void* gc = scratch + gbytes;
  if (dswiglu) {
    // The SwiGLU's backward computed as the gradient is quantised: as one expert's rows of a grouped
    // quantisation, whose padded transpose is the colwise copy where N is a multiple of 16; else the
    // rowwise codes, transposed.
    const std::int32_t rows[2] = {0, static_cast<std::int32_t>(N)};
    KILN_CHECK(N <= 0x7fffffff, name_, ": ", N, " rows do not fit the grouped quantisation");
    const bool whole = N % 16 == 0;
    float* record = prepare_scale(sg, [&](float* into) {
      ops_.quantize_grouped({*dswiglu, rows, 1, view(sg, nullptr, nullptr, N, OC), into});
    });
    Fp8TensorView g = view(sg, gr, nullptr, N, OC);
    if (whole) g.colwise = TensorView(gc, {N * OC}, dtype_of(sg.format), dev);
    ops_.quantize_grouped({*dswiglu, rows, 1, g, record});
    if (!whole) ops_.transpose(TensorView(gc, {OC, N}, dtype_of(sg.format), dev), g.rowwise);
  } else {
    float* record = prepare_scale(sg, dout);
    ops_.quantize_grad({dout, gelu_pre, view(sg, gr, gc, N, OC), record, a.dbias, xent});
  }
  // The input's colwise copy: kept from the forward, or quantised again with the forward's scale
  // (its amax is already recorded).
  void* xc = nullptr;
  if (keep_input_) {
    KILN_CHECK(kept_.data() && kept_rows_ == N && kept_cols_ == IC, name_, ": backward of [", N, ",", IC,
               "] without the forward's kept input");
    xc = kept_.data();
  } else {
    xc = scratch + 2 * gbytes;
    const Fp8TensorView out = view(sx, nullptr, xc, N, IC);
    if (in.layernorm)
      ops_.quantize_layernorm(*in.layernorm, out, nullptr);
    else
      quantize_input(in, out, nullptr);
  }

  if (a.dx) {
    GemmArgs g;  // dx[N, IC] = dout[N, OC] @ W[OC, IC]: K = OC, Y = W^T stored [IC, OC]
    g.what = "fp8_gemm_dgrad";
    g.x = TensorView(gr, {N, OC}, dtype_of(sg.format), dev);
    g.x_scale_inv = sg.scale_inv;
    g.y = TensorView(weight_colwise, {IC, OC}, dtype_of(sw.format), dev);
    g.y_scale_inv = sw.scale_inv;
    g.d = a.dx;
    if (a.dx_gelu_pre) {
      g.epilogue = ops::Epilogue::dgelu;
      g.aux = a.dx_gelu_pre;
    }
    ops_.gemm(g);
    if (a.dgrad_queued) a.dgrad_queued();
  }
  GemmArgs w;  // dW[OC, IC] += dout^T[OC, N] @ x[N, IC] (or =): K = N, both operands transposed copies
  w.what = "fp8_gemm_wgrad";
  w.x = TensorView(gc, {OC, N}, dtype_of(sg.format), dev);
  w.x_scale_inv = sg.scale_inv;
  w.y = TensorView(xc, {IC, N}, dtype_of(sx.format), dev);
  w.y_scale_inv = sx.scale_inv;
  w.d = a.dweight;
  w.f32_result = true;  // a gradient: f32, or bf16 (as the bf16 GEMM's: ops::Backend::linear_backward)
  w.accumulate = !a.dweight_overwrite;
  ops_.gemm(w);
}

}  // namespace kiln::fp8
