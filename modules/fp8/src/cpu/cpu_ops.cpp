// The CPU emulation of the FP8 operations: the same encode() the CUDA cast matches bit for bit, and
// GEMMs of the dequantised values in fp32 (what the GPU computes, up to accumulation order). Loops
// are parallel over independent outputs only, so results do not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <thread>
#include <vector>

#include "kiln/core/error.hpp"
#include "kiln/fp8/ops.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/ops/grad_staging.hpp"
#include "kiln/ops/grads.hpp"
#include "kiln/ops/moments.hpp"
#include "../ops_checks.hpp"

namespace kiln::fp8 {

namespace {

constexpr std::int64_t kParallelWork = 1 << 15;  // elements (or multiply-adds) worth a parallel loop

float load(const TensorView& t, std::int64_t i) {
  return t.dtype == DType::bf16 ? bf16_bits_to_float(t.as<std::uint16_t>()[i]) : t.as<float>()[i];
}

void expect_input(const TensorView& t, const char* what) {
  if (t.device != Device::cpu || (t.dtype != DType::f32 && t.dtype != DType::bf16) || !t.contiguous())
    KILN_THROW(what, ": expected a contiguous f32 or bf16 host tensor, got ", t.str());
}

Format format_of(const TensorView& t, const char* what) {
  if (t.dtype == DType::e4m3) return Format::e4m3;
  if (t.dtype == DType::e5m2) return Format::e5m2;
  KILN_THROW(what, ": expected an e4m3 or e5m2 tensor, got ", t.str());
}

class CpuOps final : public Fp8Ops {
 public:
  explicit CpuOps(const CpuOpsOptions& o)
      : round_(o.round_bf16), threads_(o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))) {}

  Device device() const override { return Device::cpu; }
  DType act_dtype() const override { return DType::f32; }
  Buffer alloc(std::size_t bytes) override { return Buffer(Device::cpu, bytes); }
  void copy(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void zero(void* dst, std::size_t bytes) override { std::memset(dst, 0, bytes); }
  void synchronize() override {}

  void amax(const TensorView& x, float* amax) override {
    expect_input(x, "fp8 amax x");
    *amax = amax_max(*amax, max_abs(x));
  }

  void scale_from_amax(const float* amax, float* scale, float* scale_inv, float fp8_max, int margin) override {
    *scale = compute_scale(fp8_max, *amax, margin, *scale);
    *scale_inv = reciprocal(*scale);
  }

  void quantize(const TensorView& x, const Fp8TensorView& out, float* amax) override {
    expect_input(x, "fp8 quantize x");
    KILN_CHECK(x.ndim() == 2 || x.ndim() == 3, "fp8 quantize: x must be [rows, cols] or [batch, rows, cols], got ",
               x.str());
    KILN_CHECK(out.scale, "fp8 quantize: no scale");
    const bool batched = x.ndim() == 3;
    const std::int64_t B = batched ? x.size(0) : 1, R = x.size(batched ? 1 : 0), C = x.size(batched ? 2 : 1);
    const Shape row_shape = batched ? Shape{B, R, C} : Shape{R, C}, col_shape = batched ? Shape{B, C, R} : Shape{C, R};
    if (out.rowwise)
      KILN_CHECK(out.rowwise.dtype == dtype_of(out.format) && out.rowwise.shape == row_shape,
                 "fp8 quantize: rowwise ", out.rowwise.str(), " for x ", x.str());
    if (out.colwise)
      KILN_CHECK(out.colwise.dtype == dtype_of(out.format) && out.colwise.shape == col_shape,
                 "fp8 quantize: colwise ", out.colwise.str(), " for x ", x.str());
    const float s = *out.scale;
    const Format f = out.format;
    std::uint8_t* row = out.rowwise ? out.rowwise.as<std::uint8_t>() : nullptr;
    std::uint8_t* col = out.colwise ? out.colwise.as<std::uint8_t>() : nullptr;
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t at = b * R * C;
#pragma omp parallel for num_threads(threads_) schedule(static) if (R * C >= kParallelWork)
      for (std::int64_t r = 0; r < R; ++r)
        for (std::int64_t c = 0; c < C; ++c) {
          const std::uint8_t q = fp8::quantize(load(x, at + r * C + c), s, f);
          if (row) row[at + r * C + c] = q;
          if (col) col[at + c * R + r] = q;
        }
    }
    if (amax) *amax = amax_max(*amax, max_abs(x));
  }

  void quantize_grouped(const GroupedQuantizeArgs& a) override {
    const Shape shape = grouped_source_shape(a.x, "fp8 quantize_grouped");
    KILN_CHECK(a.out.scale, "fp8 quantize_grouped: no scale");
    const std::int64_t R = shape[0], C = shape[1], E = a.experts;
    const std::int32_t* off = a.offsets_host;
    check_offsets(off, E, R, "fp8 quantize_grouped");
    const std::int64_t used = off[E], padded = segment_row(off, a.experts);
    // The values of the rows used: the rows themselves, or computed from the prologue's tensors.
    std::vector<float> computed;
    const TensorView x = source_values(to_source(a.x), used, C, computed);
    if (a.out.rowwise)
      KILN_CHECK(a.out.rowwise.dtype == dtype_of(a.out.format) && a.out.rowwise.shape == Shape({used, C}),
                 "fp8 quantize_grouped: rowwise ", a.out.rowwise.str(), " for [", used, ",", C, "]");
    if (a.out.colwise)
      KILN_CHECK(a.out.colwise.dtype == dtype_of(a.out.format) && a.out.colwise.shape == Shape({padded * C}),
                 "fp8 quantize_grouped: colwise ", a.out.colwise.str(), " for ", padded * C, " codes");
    const float s = *a.out.scale;
    std::uint8_t* row = a.out.rowwise ? a.out.rowwise.as<std::uint8_t>() : nullptr;
    std::uint8_t* col = a.out.colwise ? a.out.colwise.as<std::uint8_t>() : nullptr;
    const std::uint8_t zero = fp8::quantize(0.0f, s, a.out.format);
    for (int e = 0; e < a.experts; ++e) {
      const std::int64_t P = segment_rows(off, e), base = C * segment_row(off, e);
#pragma omp parallel for num_threads(threads_) schedule(static) if (P * C >= kParallelWork)
      for (std::int64_t p = 0; p < P; ++p) {
        const std::int64_t r = off[e] + p;
        const bool real = r < off[e + 1];
        for (std::int64_t c = 0; c < C; ++c) {
          const std::uint8_t q = real ? fp8::quantize(load(x, r * C + c), s, a.out.format) : zero;
          if (row && real) row[r * C + c] = q;
          if (col) col[base + c * P + p] = q;
        }
      }
    }
    if (a.amax) *a.amax = amax_max(*a.amax, max_abs(x.rows(0, used)));
  }

  void quantize_gelu(const TensorView& pre, const Fp8TensorView& out, float* amax) override {
    std::vector<float> g = gelu_of(pre);
    quantize(TensorView(g.data(), pre.shape, DType::f32, Device::cpu), out, amax);
  }
  void amax_gelu(const TensorView& pre, float* amax) override {
    std::vector<float> g = gelu_of(pre);
    this->amax(TensorView(g.data(), pre.shape, DType::f32, Device::cpu), amax);
  }

  void quantize_swiglu(const TensorView& pre, const Fp8TensorView& out, float* amax) override {
    std::vector<float> y = swiglu_of(pre);
    quantize(TensorView(y.data(), {pre.size(0), pre.size(1) / 2}, DType::f32, Device::cpu), out, amax);
  }
  void amax_swiglu(const TensorView& pre, float* amax) override {
    std::vector<float> y = swiglu_of(pre);
    this->amax(TensorView(y.data(), {pre.size(0), pre.size(1) / 2}, DType::f32, Device::cpu), amax);
  }

  void quantize_grad(const GradQuantizeArgs& a) override {
    expect_input(a.dy, "fp8 quantize_grad dy");
    KILN_CHECK(a.dy.ndim() == 2, "fp8 quantize_grad: dy must be 2-D, got ", a.dy.str());
    KILN_CHECK(a.out.rowwise && a.out.colwise, "fp8 quantize_grad: both copies are needed");
    if (a.xent) {
      KILN_CHECK(a.xent->logits.data == a.dy.data && !a.gelu_pre && !a.dbias,
                 "fp8 quantize_grad: a cross-entropy gradient reads its logits as dy, with no dGELU or bias");
      xent_grad(*a.xent);
    }
    if (a.gelu_pre) dgelu(a.dy, a.gelu_pre);
    quantize(a.dy, a.out, a.amax);
    if (a.dbias) bias_grad(a.dbias, a.dy);
  }

  void dgelu(const TensorView& dy, const TensorView& pre) override {
    expect_input(dy, "fp8 dgelu dy");
    expect_input(pre, "fp8 dgelu pre");
    KILN_CHECK(dy.dtype == DType::f32 && pre.dtype == DType::f32 && pre.numel() == dy.numel(), "fp8 dgelu: dy ",
               dy.str(), ", pre ", pre.str());
    float* d = dy.as<float>();
    const float* p = pre.as<float>();
    const std::int64_t n = dy.numel();
#pragma omp parallel for num_threads(threads_) schedule(static) if (n >= kParallelWork)
    for (std::int64_t i = 0; i < n; ++i) d[i] = store(d[i] * ops::gelu_grad(p[i]));
  }

  void xent_grad(const ops::XentOnLoad& x) override {
    expect_input(x.logits, "fp8 xent_grad logits");
    KILN_CHECK(x.logits.ndim() == 2 && x.lse.dtype == DType::f32 && x.targets.dtype == DType::i32 &&
                   x.lse.numel() == x.logits.size(0) && x.targets.numel() == x.logits.size(0) && x.vocab_begin >= 0,
               "fp8 xent_grad: logits ", x.logits.str(), ", lse ", x.lse.str(), ", targets ", x.targets.str());
    const std::int64_t N = x.logits.size(0), V = x.logits.size(1);
    const std::int64_t Vr = std::clamp<std::int64_t>(x.vocab_real - x.vocab_begin, 0, V);
    float* logits = x.logits.as<float>();
    const float* lse = x.lse.as<float>();
    const auto* targets = x.targets.as<std::int32_t>();
#pragma omp parallel for num_threads(threads_) schedule(static) if (N * V >= kParallelWork)
    for (std::int64_t n = 0; n < N; ++n) {
      float* row = logits + n * V;
      const bool ignored = targets[n] < 0;  // no gradient in the row
      const std::int64_t t = targets[n] - x.vocab_begin;
      for (std::int64_t v = 0; v < V; ++v)
        row[v] = ignored || v >= Vr ? 0.0f : store(ops::xent_grad(row[v], lse[n], v == t, x.dloss));
    }
  }

  void dequantize(const TensorView& out, const TensorView& q, const float* scale_inv) override {
    const Format f = format_of(q, "fp8 dequantize q");
    KILN_CHECK(out.dtype == DType::f32 && out.numel() == q.numel(), "fp8 dequantize ", q.str(), " -> ", out.str());
    const std::uint8_t* in = q.as<std::uint8_t>();
    float* o = out.as<float>();
    const float si = *scale_inv;
    for (std::int64_t i = 0; i < q.numel(); ++i) o[i] = decode(in[i], f) * si;
  }

  void transpose(const TensorView& out, const TensorView& in) override {
    check_transpose_args(out, in, Device::cpu);
    const std::uint8_t* src = in.as<std::uint8_t>();
    std::uint8_t* dst = out.as<std::uint8_t>();
    const std::int64_t rows = in.size(0), cols = in.size(1);
#pragma omp parallel for num_threads(threads_) schedule(static) if (rows * cols >= kParallelWork)
    for (std::int64_t c = 0; c < cols; ++c)
      for (std::int64_t r = 0; r < rows; ++r) dst[c * rows + r] = src[r * cols + c];
  }

  void gemm_grouped(std::span<const GemmArgs> gs) override {
    for (const GemmArgs& g : gs) {
      KILN_CHECK(g.epilogue == ops::Epilogue::none, "fp8 gemm_grouped: the products take no epilogue");
      gemm(g);
    }
  }

  void quantize_blocks(const BlockQuantizeArgs& a) override {
    const Shape shape = source_shape(a.x, "fp8 quantize_blocks");
    const std::int64_t R = shape[0], C = shape[1];
    std::vector<float> computed;
    const TensorView x = source_values(a.x, R, C, computed);
    // The outputs' rows (padded with zero rows where they have more than x).
    const std::int64_t Rr = a.rowwise ? a.rowwise.size(0) : R, Rc = a.colwise ? a.colwise.size(1) : R;
    KILN_CHECK(a.rowwise.ndim() <= 2 && a.colwise.ndim() <= 2 && Rr >= R && Rc >= R && (!a.dbias || (Rr == R && Rc == R)),
               "fp8 quantize_blocks: rowwise ", a.rowwise.str(), " and colwise ", a.colwise.str(), " for x ",
               shape.str(), a.dbias ? " with dbias (padded outputs take none)" : "");
    const std::int64_t Rp = std::max(Rr, Rc);
    std::vector<float> xf(static_cast<std::size_t>(Rp * C), 0.0f);
    for (std::int64_t i = 0; i < R * C; ++i) xf[static_cast<std::size_t>(i)] = load(x, i);
    if (a.rowwise) {
      KILN_CHECK(a.rowwise.shape == Shape({Rr, C}) && a.rowwise.contiguous() && a.row_scale_inv,
                 "fp8 quantize_blocks: rowwise ", a.rowwise.str(), " (and its scales) for x ", shape.str());
      quantize_blocks_reference(xf.data(), {a.mode, Rr, C}, format_of(a.rowwise, "fp8 quantize_blocks rowwise"), a.pow2,
                                a.rowwise.as<std::uint8_t>(), a.row_scale_inv);
    }
    if (a.colwise) {
      KILN_CHECK(a.colwise.shape == Shape({C, Rc}) && a.colwise.contiguous() && a.col_scale_inv,
                 "fp8 quantize_blocks: colwise ", a.colwise.str(), " (and its scales) for the transpose of x ", shape.str());
      std::vector<float> xt(static_cast<std::size_t>(C * Rc));
      for (std::int64_t r = 0; r < Rc; ++r)
        for (std::int64_t c = 0; c < C; ++c) xt[static_cast<std::size_t>(c * Rc + r)] = xf[static_cast<std::size_t>(r * C + c)];
      quantize_blocks_reference(xt.data(), {a.mode, C, Rc}, format_of(a.colwise, "fp8 quantize_blocks colwise"), a.pow2,
                                a.colwise.as<std::uint8_t>(), a.col_scale_inv);
    }
    if (a.dbias) bias_grad(a.dbias, TensorView(xf.data(), {R, C}, DType::f32, Device::cpu));
  }

  void block_part_amax(const BlockPart& p, float* tile_amax) override { block_part_amax_reference(p, tile_amax); }
  void block_scales(const float* tile_amax, std::int64_t rows, std::int64_t cols, Format f, bool pow2, float* scale,
                    float* row_scale_inv, float* col_scale_inv) override {
    block_scales_reference(tile_amax, rows, cols, f, pow2, scale, row_scale_inv, col_scale_inv);
  }
  void quantize_block_part(const BlockPart& p, const float* scale, Format f, std::uint8_t* codes) override {
    quantize_block_part_reference(p, scale, f, codes);
  }

  // A product's formats and M, N, K, its arguments checked (either scaling).
  struct GemmShape {
    Format fx, fy;
    std::int64_t M, N, K;
  };
  static GemmShape check_gemm(const GemmArgs& g) {
    const Format fx = format_of(g.x, "fp8 gemm x"), fy = format_of(g.y, "fp8 gemm y");
    KILN_CHECK(fx == Format::e4m3 || fy == Format::e4m3, "fp8 gemm: E5M2 x E5M2 products are not supported");
    KILN_CHECK(g.x.ndim() == 2 && g.y.ndim() == 2 && g.x.size(1) == g.y.size(1), "fp8 gemm: x ", g.x.str(), " and y ",
               g.y.str(), " must share K (the inner dimension)");
    const std::int64_t M = g.x.size(0), N = g.y.size(0), K = g.x.size(1);
    KILN_CHECK(g.d.dtype == DType::f32 && g.d.shape == Shape({M, N}) && g.d.contiguous(), "fp8 gemm: d ", g.d.str(),
               " for [", M, ",", N, "] (f32; or bf16 where f32_result: a gradient)");
    KILN_CHECK(g.x_scale_inv && g.y_scale_inv, "fp8 gemm: missing operand scales");
    KILN_CHECK(!g.accumulate || g.f32_result, "fp8 gemm: accumulating needs an f32 result");
    KILN_CHECK(!g.f32_result || g.epilogue == ops::Epilogue::none, "fp8 gemm: epilogues write activations, not f32 results");
    if (g.bias) KILN_CHECK(g.bias.dtype == DType::f32 && g.bias.numel() == N, "fp8 gemm: bias ", g.bias.str());
    if (g.epilogue == ops::Epilogue::gelu || g.epilogue == ops::Epilogue::dgelu)
      KILN_CHECK(g.aux.dtype == DType::f32 && g.aux.shape == Shape({M, N}), "fp8 gemm: aux ", g.aux.str());
    KILN_CHECK((g.x_mode == ScalingMode::per_tensor) == (g.y_mode == ScalingMode::per_tensor),
               "fp8 gemm: both operands block-scaled, or neither");
    return {fx, fy, M, N, K};
  }

  // A bf16 gradient result (f32_result, optim.grads = "bf16"): the f32 product written or added into
  // an f32 copy of the old values, rounded back once (ops::GradStaging).
  bool gemm_into_bf16_gradient(const GemmArgs& g) {
    if (!g.f32_result || g.d.dtype != DType::bf16) return false;
    ops::GradStaging d(g.d);
    GemmArgs f = g;
    f.d = d.view();
    gemm(f);
    d.finish();
    return true;
  }

  void gemm(const GemmArgs& g) override {
    if (gemm_into_bf16_gradient(g)) return;
    if (g.x_mode != ScalingMode::per_tensor) return block_gemm(g);
    const GemmShape shape = check_gemm(g);  // (plain names: OpenMP regions cannot capture structured bindings)
    const Format fx = shape.fx, fy = shape.fy;
    const std::int64_t M = shape.M, N = shape.N, K = shape.K;
    const bool uses_aux = g.epilogue == ops::Epilogue::gelu || g.epilogue == ops::Epilogue::dgelu;
    const std::vector<float> xd = dequantized(g.x, fx, *g.x_scale_inv);
    const std::vector<float> yd = dequantized(g.y, fy, *g.y_scale_inv);
    float* d = g.d.as<float>();
    const float* bias = (g.epilogue == ops::Epilogue::bias || g.epilogue == ops::Epilogue::gelu) && g.bias ? g.bias.as<float>() : nullptr;
    float* aux = uses_aux ? g.aux.as<float>() : nullptr;
#pragma omp parallel for num_threads(threads_) schedule(static) if (M * N * K >= kParallelWork)
    for (std::int64_t m = 0; m < M; ++m) {
      const float* xr = xd.data() + m * K;
      for (std::int64_t n = 0; n < N; ++n) {
        const float* yr = yd.data() + n * K;
        float acc = 0;
#pragma omp simd reduction(+ : acc)
        for (std::int64_t k = 0; k < K; ++k) acc += xr[k] * yr[k];
        const std::int64_t i = m * N + n;
        if (bias) acc += bias[n];
        switch (g.epilogue) {
          case ops::Epilogue::none: d[i] = g.accumulate ? d[i] + acc : g.f32_result ? acc : store(acc); break;
          case ops::Epilogue::bias: d[i] = store(acc); break;
          case ops::Epilogue::gelu:
            aux[i] = store(acc);
            d[i] = store(ops::gelu(acc));
            break;
          case ops::Epilogue::dgelu: d[i] = store(acc * ops::gelu_grad(aux[i])); break;
        }
      }
    }
  }

  // A block-scaled product (kiln/fp8/block.hpp's reference), then written, stored or accumulated.
  void block_gemm(const GemmArgs& g) {
    const GemmShape shape = check_gemm(g);  // (plain names: OpenMP regions cannot capture structured bindings)
    const Format fx = shape.fx, fy = shape.fy;
    const std::int64_t M = shape.M, N = shape.N, K = shape.K;
    const bool uses_aux = g.epilogue == ops::Epilogue::gelu || g.epilogue == ops::Epilogue::dgelu;
    std::vector<float> r(static_cast<std::size_t>(M * N));
    block_gemm_reference(g.x.as<std::uint8_t>(), fx, g.x_scale_inv, g.x_mode, g.y.as<std::uint8_t>(), fy,
                         g.y_scale_inv, g.y_mode, M, N, K, r.data(), threads_);
    // The epilogue after the product, as the CUDA side runs it (a separate kernel on the stored
    // product: bias and GELU on the act-rounded value).
    float* d = g.d.as<float>();
    const float* bias = (g.epilogue == ops::Epilogue::bias || g.epilogue == ops::Epilogue::gelu) && g.bias ? g.bias.as<float>() : nullptr;
    float* aux = uses_aux ? g.aux.as<float>() : nullptr;
    for (std::int64_t m = 0; m < M; ++m)
      for (std::int64_t n = 0; n < N; ++n) {
        const std::int64_t i = m * N + n;
        const float v = r[static_cast<std::size_t>(i)];
        switch (g.epilogue) {
          case ops::Epilogue::none: d[i] = g.accumulate ? d[i] + v : g.f32_result ? v : store(v); break;
          case ops::Epilogue::bias: d[i] = store(store(v) + (bias ? bias[n] : 0.0f)); break;
          case ops::Epilogue::gelu:
            aux[i] = bias ? store(store(v) + bias[n]) : store(v);
            d[i] = store(ops::gelu(aux[i]));
            break;
          case ops::Epilogue::dgelu: d[i] = store(store(v) * ops::gelu_grad(aux[i])); break;
        }
      }
  }

  void bias_grad(const TensorView& dbias, const TensorView& dy) override {
    expect_input(dy, "fp8 bias_grad dy");
    KILN_CHECK(dy.ndim() == 2 && (dbias.dtype == DType::f32 || dbias.dtype == DType::bf16) && dbias.numel() == dy.size(1),
               "fp8 bias_grad ", dy.str(), " -> ", dbias.str(), " (dbias: f32 or bf16, a gradient)");
    const std::int64_t M = dy.size(0), N = dy.size(1);
    ops::GradStaging staged(dbias);  // f32 in place, bf16 through an f32 copy
    float* db = staged.data();
#pragma omp parallel for num_threads(threads_) schedule(static) if (M * N >= kParallelWork)
    for (std::int64_t n = 0; n < N; ++n) {
      float s = 0;
      for (std::int64_t m = 0; m < M; ++m) s += load(dy, m * N + n);
      db[n] += s;
    }
    staged.finish();
  }

  void update_delayed(const DelayedUpdateArgs& a) override {
    for (int i = 0; i < a.n; ++i) {
      float amax = a.history[i];
      if (a.algo == AmaxAlgo::max)
        for (int h = 1; h < a.len; ++h) amax = amax_max(amax, a.history[static_cast<std::int64_t>(h) * a.n + i]);
      a.scale[i] = compute_scale(a.fp8_max[i], amax, a.margin, a.scale[i]);
      a.scale_inv[static_cast<std::int64_t>(i) * a.scale_inv_stride] = reciprocal(a.scale[i]);
      for (int h = a.len - 1; h > 0; --h)
        a.history[static_cast<std::int64_t>(h) * a.n + i] = a.history[static_cast<std::int64_t>(h - 1) * a.n + i];
      a.history[i] = 0.0f;
    }
  }

  void quantize_layernorm(const ops::LayerNormOnLoad& ln, const Fp8TensorView& out, float* amax) override {
    expect_input(ln.x, "fp8 quantize_layernorm x");
    KILN_CHECK(ln.x.ndim() == 2, "fp8 quantize_layernorm: x must be 2-D [rows, cols], got ", ln.x.str());
    const std::int64_t R = ln.x.size(0), C = ln.x.size(1);
    for (const TensorView* t : {&ln.weight, &ln.bias}) {
      expect_input(*t, "fp8 quantize_layernorm weight/bias");
      KILN_CHECK(t->numel() == C, "fp8 quantize_layernorm weight/bias ", t->str(), " for x ", ln.x.str());
    }
    for (const TensorView* t : {&ln.mean, &ln.rstd})
      KILN_CHECK(t->device == Device::cpu && t->dtype == DType::f32 && t->numel() == R,
                 "fp8 quantize_layernorm mean/rstd ", t->str(), " for x ", ln.x.str());
    std::vector<float> y(static_cast<std::size_t>(R * C));
    const float *mean = ln.mean.as<float>(), *rstd = ln.rstd.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static) if (R * C >= kParallelWork)
    for (std::int64_t r = 0; r < R; ++r)
      for (std::int64_t c = 0; c < C; ++c)
        y[static_cast<std::size_t>(r * C + c)] =
            store(ops::layernorm_apply(load(ln.x, r * C + c), mean[r], rstd[r], load(ln.weight, c), load(ln.bias, c)));
    quantize(TensorView(y.data(), {R, C}, DType::f32, Device::cpu), out, amax);
  }

  // The CPU backend's layernorm_forward, statistics only (the same function).
  void layernorm_stats(const ops::LayerNormOnLoad& ln, float* amax) override {
    expect_input(ln.x, "fp8 layernorm_stats x");
    KILN_CHECK(ln.x.dtype == DType::f32 && ln.x.ndim() == 2, "fp8 layernorm_stats: x must be f32 [rows, cols], got ",
               ln.x.str());
    const std::int64_t R = ln.x.size(0), C = ln.x.size(1);
    for (const TensorView* t : {&ln.mean, &ln.rstd})
      KILN_CHECK(t->device == Device::cpu && t->dtype == DType::f32 && t->numel() == R,
                 "fp8 layernorm_stats mean/rstd ", t->str(), " for x ", ln.x.str());
    const float* x = ln.x.as<float>();
    float *mean = ln.mean.as<float>(), *rstd = ln.rstd.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t n = 0; n < R; ++n) ops::layernorm_row_stats(x + n * C, C, ln.eps, mean[n], rstd[n]);
    if (!amax) return;
    KILN_CHECK(ln.weight.numel() == C && ln.bias.numel() == C, "fp8 layernorm_stats weight/bias for x ", ln.x.str());
    float m = 0;
    for (std::int64_t n = 0; n < R; ++n)
      for (std::int64_t c = 0; c < C; ++c)
        m = amax_max(m, std::fabs(store(ops::layernorm_apply(x[n * C + c], mean[n], rstd[n], load(ln.weight, c),
                                                             load(ln.bias, c)))));
    *amax = amax_max(*amax, m);
  }

  void adamw_quantize(const AdamWQuantizeArgs& a) override {
    check_adamw_quantize_args(a, Device::cpu);
    ops::AdamWNumbers h{a.lr, a.grad_scale, 0, 0};
    ops::adamw_bias_corrections(a.beta1, a.beta2, a.step, h.bc1, h.bc2);
    if (!ops::adamw_numbers(a.scalars, h)) return;  // a non-finite gradient: the step is skipped
    float* p = a.param.as<float>();
    const std::int64_t n = a.param.numel();
    // Typed by the moments' storage and the gradient's (each f32 or bf16 bits, read as f32).
    ops::with_moments(a.m.dtype == DType::bf16, a.m.data, a.v.data, [&](auto* m, auto* v) {
      ops::with_grads(a.grad.dtype == DType::bf16, a.grad.data, [&](auto* g) {
#pragma omp parallel for num_threads(threads_) schedule(static) if (n >= kParallelWork)
        for (std::int64_t i = 0; i < n; ++i) {
          float mi = ops::moment_load(m, i), vi = ops::moment_load(v, i);
          ops::adamw_update(p[i], mi, vi, ops::grad_load(g, i) * h.grad_scale, h.lr, a.beta1, a.beta2, a.eps,
                            a.weight_decay, h.bc1, h.bc2);
          ops::moment_store(m, i, mi);
          ops::moment_store(v, i, vi);
        }
      });
    });
    if (a.out.rowwise) quantize(a.param, a.out, a.amax);
  }

 private:
  float store(float v) const { return round_ ? round_bf16(v) : v; }

  std::vector<float> gelu_of(const TensorView& pre) const {
    expect_input(pre, "fp8 gelu input");
    std::vector<float> g(static_cast<std::size_t>(pre.numel()));
    const std::int64_t n = pre.numel();
#pragma omp parallel for num_threads(threads_) schedule(static) if (n >= kParallelWork)
    for (std::int64_t i = 0; i < n; ++i) g[static_cast<std::size_t>(i)] = store(ops::gelu(load(pre, i)));
    return g;
  }

  // act(silu(gate) * up) of pre [R, 2F], as swiglu_forward stores it: [R, F].
  std::vector<float> swiglu_of(const TensorView& pre) const {
    expect_input(pre, "fp8 swiglu input");
    KILN_CHECK(pre.ndim() == 2 && pre.size(1) % 2 == 0, "fp8 swiglu input: expected [rows, 2 F], got ", pre.str());
    const std::int64_t R = pre.size(0), F = pre.size(1) / 2;
    std::vector<float> y(static_cast<std::size_t>(R * F));
#pragma omp parallel for num_threads(threads_) schedule(static) if (R * F >= kParallelWork)
    for (std::int64_t r = 0; r < R; ++r)
      for (std::int64_t f = 0; f < F; ++f)
        y[static_cast<std::size_t>(r * F + f)] = store(ops::swiglu(load(pre, r * 2 * F + f), load(pre, r * 2 * F + F + f)));
    return y;
  }

  // The first `rows` rows of a grouped quantisation's source [R, C]: the tensor itself, or its values
  // computed into `into` (f32), each rounded as the activation op that stores it rounds it.
  TensorView source_values(const QuantizeSource& src, std::int64_t rows, std::int64_t C, std::vector<float>& into) const {
    if (const auto* t = std::get_if<TensorView>(&src)) {
      expect_input(*t, "fp8 quantize x");
      return *t;
    }
    into.resize(static_cast<std::size_t>(rows * C));
    float* v = into.data();
    const std::int64_t n = rows * C;
    if (const auto* ln = std::get_if<ops::LayerNormOnLoad>(&src)) {
      expect_input(ln->x, "fp8 quantize LayerNorm input");
      const float *mean = ln->mean.as<float>(), *rstd = ln->rstd.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static) if (n >= kParallelWork)
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t c = 0; c < C; ++c)
          v[r * C + c] = store(ops::layernorm_apply(load(ln->x, r * C + c), mean[r], rstd[r], load(ln->weight, c),
                                                    load(ln->bias, c)));
    } else if (const auto* g = std::get_if<ops::GeluOnLoad>(&src)) {
      expect_input(g->pre, "fp8 quantize_grouped pre");
#pragma omp parallel for num_threads(threads_) schedule(static) if (n >= kParallelWork)
      for (std::int64_t i = 0; i < n; ++i) v[i] = store(ops::gelu(load(g->pre, i)));
    } else if (const auto* g = std::get_if<ops::DgeluOnLoad>(&src)) {
      expect_input(g->pre, "fp8 quantize_grouped pre");
#pragma omp parallel for num_threads(threads_) schedule(static) if (n >= kParallelWork)
      for (std::int64_t i = 0; i < n; ++i) v[i] = store(load(g->dgelu, i) * ops::gelu_grad(load(g->pre, i)));
    } else if (const auto* g = std::get_if<ops::SwigluOnLoad>(&src)) {
      expect_input(g->gate_up, "fp8 quantize_grouped gate_up");
#pragma omp parallel for num_threads(threads_) schedule(static) if (n >= kParallelWork)
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t c = 0; c < C; ++c)
          v[r * C + c] = store(ops::swiglu(load(g->gate_up, r * 2 * C + c), load(g->gate_up, r * 2 * C + C + c)));
    } else {
      const auto& d = std::get<ops::DswigluOnLoad>(src);
      expect_input(d.gate_up, "fp8 quantize_grouped gate_up");
      const std::int64_t F = C / 2;
#pragma omp parallel for num_threads(threads_) schedule(static) if (n >= kParallelWork)
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t f = 0; f < F; ++f) {
          const float g = load(d.gate_up, r * C + f), u = load(d.gate_up, r * C + F + f), go = load(d.dswiglu, r * F + f);
          v[r * C + f] = store(ops::dswiglu_gate(go, g, u));
          v[r * C + F + f] = store(ops::dswiglu_up(go, g));
        }
    }
    return TensorView(v, {rows, C}, DType::f32, Device::cpu);
  }

  float max_abs(const TensorView& x) const {
    std::uint32_t m = 0;
    const std::int64_t n = x.numel();
#pragma omp parallel for num_threads(threads_) schedule(static) reduction(max : m) if (n >= kParallelWork)
    for (std::int64_t i = 0; i < n; ++i) m = std::max(m, abs_bits(load(x, i)));
    return bits_float(m);
  }

  // decode(q) * scale_inv through a table of the 256 products (the same values, computed once).
  std::vector<float> dequantized(const TensorView& q, Format f, float scale_inv) const {
    KILN_CHECK(q.device == Device::cpu && q.contiguous(), "fp8 gemm operand ", q.str());
    float table[256];
    for (int c = 0; c < 256; ++c) table[c] = decode(static_cast<std::uint8_t>(c), f) * scale_inv;
    std::vector<float> out(static_cast<std::size_t>(q.numel()));
    const std::uint8_t* in = q.as<std::uint8_t>();
    const std::int64_t n = q.numel();
#pragma omp parallel for num_threads(threads_) schedule(static) if (n >= kParallelWork)
    for (std::int64_t i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = table[in[i]];
    return out;
  }

  bool round_;
  int threads_;
};

}  // namespace

std::unique_ptr<Fp8Ops> make_cpu_ops(const CpuOpsOptions& options) { return std::make_unique<CpuOps>(options); }

}  // namespace kiln::fp8
