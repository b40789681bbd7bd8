// Fp8BlockLinear: the three block-scaled FP8 GEMMs of a linear layer (kiln/fp8/block_linear.hpp).
#include "kiln/fp8/block_linear.hpp"

#include <utility>

#include "kiln/core/error.hpp"
#include "ops_checks.hpp"

namespace kiln::fp8 {

namespace {

constexpr std::size_t round256(std::size_t n) { return (n + 255) / 256 * 256; }

// Carves [rows, cols] codes and their block scales out of a scratch area, each 256-byte aligned.
class Carver {
 public:
  struct Part {
    TensorView codes;
    float* scale_inv;
  };
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

// D = X @ Y^T of block-scaled operands (no epilogue yet).
GemmArgs block_product(const TensorView& x, const float* x_scale_inv, ScalingMode x_mode, const TensorView& y,
                       const float* y_scale_inv, ScalingMode y_mode, const TensorView& d, const char* what) {
  GemmArgs g;
  g.x = x;
  g.x_scale_inv = x_scale_inv;
  g.x_mode = x_mode;
  g.y = y;
  g.y_scale_inv = y_scale_inv;
  g.y_mode = y_mode;
  g.d = d;
  g.what = what;
  return g;
}

}  // namespace

Fp8BlockLinear::Fp8BlockLinear(Fp8Ops& ops, Fp8Workspace& workspace, const BlockRecipe& recipe, std::string name)
    : ops_(ops), ws_(workspace), recipe_(recipe), name_(std::move(name)) {
  KILN_CHECK(recipe.input == Format::e4m3 && recipe.weight == Format::e4m3, name_,
             ": the forward GEMM needs E4M3 input and weight (E5M2 x E5M2 products do not exist)");
}

void Fp8BlockLinear::ensure_weight(const TensorView& w, std::int64_t version) {
  const std::int64_t OC = w.size(0), IC = w.size(1);
  if (cache_.valid && cache_.version == version && cache_.source == w.data && cache_.rows == OC && cache_.cols == IC)
    return;
  const BlockLayout rl{ScalingMode::block_128x128, OC, IC}, cl{ScalingMode::block_128x128, IC, OC};
  if (cache_.rows != OC || cache_.cols != IC || !cache_.rowwise.data()) {
    cache_.rowwise = ops_.alloc(static_cast<std::size_t>(OC * IC));
    cache_.colwise = ops_.alloc(static_cast<std::size_t>(OC * IC));
    cache_.row_scales = ops_.alloc(static_cast<std::size_t>(rl.count()) * 4);
    cache_.col_scales = ops_.alloc(static_cast<std::size_t>(cl.count()) * 4);
  }
  const Device dev = ops_.device();
  const DType wt = dtype_of(recipe_.weight);
  ops_.quantize_blocks({w, ScalingMode::block_128x128, recipe_.pow2, TensorView(cache_.rowwise.data(), {OC, IC}, wt, dev),
                        static_cast<float*>(cache_.row_scales.data()), TensorView(cache_.colwise.data(), {IC, OC}, wt, dev),
                        static_cast<float*>(cache_.col_scales.data())});
  cache_.valid = true;
  cache_.version = version;
  cache_.source = w.data;
  cache_.rows = OC;
  cache_.cols = IC;
}

void Fp8BlockLinear::forward(const ops::LinearForward& a, std::int64_t weight_version) {
  const DType act = ops_.act_dtype();
  const auto* xp = std::get_if<TensorView>(&a.x);
  KILN_CHECK(xp, name_, ": block-scaled FP8 layers take their input as a tensor (no prologue), not ",
             ops::name_of(ops::prologue_of(a.x)));
  const TensorView& x = *xp;
  KILN_CHECK(x.ndim() == 2 && a.weight.ndim() == 2, name_, " forward: x ", x.str(), ", weight ", a.weight.str());
  const std::int64_t N = x.size(0), IC = x.size(1), OC = a.weight.size(0);
  expect_matrix(x, act, N, IC, name_ + " forward x");
  expect_matrix(a.weight, act, OC, IC, name_ + " forward weight");
  expect_matrix(a.out, act, N, OC, name_ + " forward out");
  if (a.pre_gelu) expect_matrix(a.pre_gelu, act, N, OC, name_ + " forward pre_gelu");
  ensure_weight(a.weight, weight_version);

  const BlockLayout xl{ScalingMode::block_1x128, N, IC};
  Carver c(ws_.get(Carver::bytes({xl})), ops_.device());
  const auto xq = c.take(xl, recipe_.input);
  ops_.quantize_blocks({x, ScalingMode::block_1x128, recipe_.pow2, xq.codes, xq.scale_inv});

  GemmArgs g = block_product(xq.codes, xq.scale_inv, ScalingMode::block_1x128,
                             TensorView(cache_.rowwise.data(), {OC, IC}, dtype_of(recipe_.weight), ops_.device()),
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
  const auto* xp = std::get_if<TensorView>(&a.x);
  const auto* dp = std::get_if<TensorView>(&a.dout);
  KILN_CHECK(xp && dp, name_, ": block-scaled FP8 layers take their input and output gradient as tensors (no prologue)");
  const TensorView &x = *xp, &dout = *dp;
  KILN_CHECK(x.ndim() == 2 && a.weight.ndim() == 2, name_, " backward: x ", x.str(), ", weight ", a.weight.str());
  const std::int64_t N = x.size(0), IC = x.size(1), OC = a.weight.size(0);
  expect_matrix(x, act, N, IC, name_ + " backward x");
  expect_matrix(a.weight, act, OC, IC, name_ + " backward weight");
  expect_matrix(dout, act, N, OC, name_ + " backward dout");
  expect_matrix(a.dweight, DType::f32, OC, IC, name_ + " backward dweight");
  if (a.dx) expect_matrix(a.dx, act, N, IC, name_ + " backward dx");
  if (a.dx_gelu_pre) expect_matrix(a.dx_gelu_pre, act, N, IC, name_ + " backward dx_gelu_pre");
  if (a.dbias) KILN_CHECK(a.dbias.dtype == DType::f32 && a.dbias.numel() == OC, name_, " backward dbias ", a.dbias.str());
  // The forward made the weight's copies; another tensor (a library caller) is quantised again.
  if (!cache_.valid || cache_.source != a.weight.data) ensure_weight(a.weight, cache_.version);

  if (a.dbias) ops_.bias_grad(a.dbias, dout);
  // The output gradient along OC (data gradient) and along N (weight gradient), the input along N.
  const BlockLayout gr{ScalingMode::block_1x128, N, OC}, gc{ScalingMode::block_1x128, OC, N},
      xc{ScalingMode::block_1x128, IC, N};
  Carver c(ws_.get(Carver::bytes({gr, gc, xc})), ops_.device());
  const auto g_row = c.take(gr, recipe_.grad), g_col = c.take(gc, recipe_.grad), x_col = c.take(xc, recipe_.input);
  // The output gradient's two copies in one pass (the rowwise one only for the data gradient).
  ops_.quantize_blocks({dout, ScalingMode::block_1x128, recipe_.pow2, a.dx ? g_row.codes : TensorView{},
                        a.dx ? g_row.scale_inv : nullptr, g_col.codes, g_col.scale_inv});
  ops_.quantize_blocks({x, ScalingMode::block_1x128, recipe_.pow2, {}, nullptr, x_col.codes, x_col.scale_inv});

  // wgrad: dW[OC, IC] (+)= dout^T @ x, both 1x128 along the tokens.
  GemmArgs w = block_product(g_col.codes, g_col.scale_inv, ScalingMode::block_1x128, x_col.codes, x_col.scale_inv,
                             ScalingMode::block_1x128, a.dweight, "fp8_block_gemm_wgrad");
  w.f32_result = true;
  w.accumulate = !a.dweight_overwrite;
  ops_.gemm(w);

  if (!a.dx) return;
  // dgrad: dx[N, IC] = dout @ W = dout[N, OC] @ (W^T)[IC, OC]^T, the weight's transposed tiles.
  GemmArgs d = block_product(g_row.codes, g_row.scale_inv, ScalingMode::block_1x128,
                             TensorView(cache_.colwise.data(), {IC, OC}, dtype_of(recipe_.weight), ops_.device()),
                             static_cast<const float*>(cache_.col_scales.data()), ScalingMode::block_128x128, a.dx,
                             "fp8_block_gemm_dgrad");
  if (a.dx_gelu_pre) {
    d.epilogue = ops::Epilogue::dgelu;
    d.aux = a.dx_gelu_pre;
  }
  ops_.gemm(d);
}

}  // namespace kiln::fp8
