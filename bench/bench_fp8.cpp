// FP8 benchmark on one GPU.
//  1. The quantisation kernels at GPT-2 124M (N=16384 tokens, C=768) and 1.3B (N=8192, C=2048)
//     sizes: achieved GB/s (bytes read + written) against a device-to-device copy of the same
//     tensor (the bandwidth ceiling, ~4.3 TB/s on an H200).
//  2. The kernels that compute while quantising (GELU on load, dGELU), and AdamW fused with the
//     weight quantisation against AdamW and the cast apart.
//  3. The experts' grouped casts at moe-1b's sizes (`bench_fp8 grouped`: these alone).
//  (`bench_fp8 block`: block scaling alone, its GEMMs against per-tensor ones and its casts.)
//  4. GEMM TFLOP/s, cuBLASLt FP8 against kiln's bf16 runner, at the model's linear-layer shapes
//     (forward, dgrad, wgrad) and at M x N x K = 16384 x 8192 x 2048 (reference on an H200: FP8
//     1,255 TFLOP/s, bf16 726).
// Each entry: warm-up, then the median of CUDA-event timings of single calls, L2 flushed before each.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kiln/fp8/cuda/block_gemm.hpp"
#include "kiln/fp8/cuda/gemm.hpp"
#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/ops/cuda/cublaslt.hpp"
#include "kiln/ops/cuda/gemm.hpp"
#include "kiln/ops/cuda/launchers.hpp"
#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "bench_timer.hpp"

namespace kiln::bench {
namespace {

constexpr int kWarmup = 3, kIters = 20;

// Median of single calls with L2 evicted before each.
class Timer : public EventTimer {
 public:
  explicit Timer(cudaStream_t s) : EventTimer(s, true, kWarmup, kIters) {}
};

// A device buffer of bf16 N(0, std) values (through an f32 staging copy), or of FP8 codes.
Buffer bf16_buffer(std::int64_t n, float std, cudaStream_t s) {
  std::vector<float> h(static_cast<std::size_t>(n));
  std::mt19937 gen(static_cast<unsigned>(n));
  std::normal_distribution<float> d(0.0f, std);
  for (auto& v : h) v = d(gen);
  Buffer f32(Device::cuda, h.size() * 4), out(Device::cuda, h.size() * 2);
  KILN_CUDA_CHECK(cudaMemcpy(f32.data(), h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  cuda::convert_f32_to_bf16(static_cast<cuda::bf16*>(out.data()), static_cast<float*>(f32.data()), n, s);
  KILN_CUDA_CHECK(cudaStreamSynchronize(s));
  return out;
}

std::string dims(std::int64_t a, std::int64_t b) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "[%lld,%lld]", static_cast<long long>(a), static_cast<long long>(b));
  return buf;
}

std::string mnk(std::int64_t m, std::int64_t n, std::int64_t k) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%lldx%lldx%lld", static_cast<long long>(m), static_cast<long long>(n),
                static_cast<long long>(k));
  return buf;
}

void quantize_table(Timer& timer, cudaStream_t s, const Buffer& scales) {
  std::printf("\n%-44s %-14s %9s %9s %9s\n", "quantize (bf16 in)", "shape", "ms", "GB/s", "copy GB/s");
  struct Size {
    const char* model;
    std::int64_t N, C;
  };
  const float* scale = static_cast<const float*>(scales.data());
  float* amax = static_cast<float*>(scales.data()) + 1;
  for (const Size& m : {Size{"124M", 16384, 768}, Size{"1.3B", 8192, 2048}}) {
    struct Entry {
      std::string what;
      std::int64_t rows, cols;
      bool row, col;
    };
    const std::int64_t N = m.N, C = m.C;
    const Entry entries[] = {
        {"x -> rowwise e4m3 + amax (forward)", N, C, true, false},
        {"x -> colwise e4m3 (backward, wgrad)", N, C, false, true},
        {"dout -> rowwise + colwise e5m2 + amax", N, C, true, true},
        {"fc x -> rowwise e4m3 + amax", N, 4 * C, true, false},
        {"fc dout -> rowwise + colwise e5m2 + amax", N, 4 * C, true, true},
        {"W_qkv -> rowwise + colwise e4m3 + amax", 3 * C, C, true, true},
        {"W_fc -> rowwise + colwise e4m3 + amax", 4 * C, C, true, true},
    };
    for (const Entry& e : entries) {
      const std::int64_t n = e.rows * e.cols;
      Buffer x = bf16_buffer(n, 1.0f, s), row(Device::cuda, static_cast<std::size_t>(n)),
             col(Device::cuda, static_cast<std::size_t>(n)), copy(Device::cuda, static_cast<std::size_t>(n) * 2);
      const fp8::Format f = e.col && e.row && e.what.find("dout") != std::string::npos ? fp8::Format::e5m2 : fp8::Format::e4m3;
      const bool want_amax = e.what.find("amax") != std::string::npos;
      const double ms = timer.median_ms([&] {
        fp8::cuda::cast_transpose(x.data(), DType::bf16, e.row ? static_cast<std::uint8_t*>(row.data()) : nullptr,
                                  e.col ? static_cast<std::uint8_t*>(col.data()) : nullptr, f, scale,
                                  want_amax ? amax : nullptr, e.rows, e.cols, s);
      });
      const double copy_ms = timer.median_ms(
          [&] { KILN_CUDA_CHECK(cudaMemcpyAsync(copy.data(), x.data(), static_cast<std::size_t>(n) * 2, cudaMemcpyDeviceToDevice, s)); });
      const double bytes = 2.0 * n + double(n) * ((e.row ? 1 : 0) + (e.col ? 1 : 0));
      std::printf("%-5s %-38s %-14s %9.4f %9.1f %9.1f\n", m.model, e.what.c_str(), dims(e.rows, e.cols).c_str(), ms,
                  bytes / (ms * 1e-3) / 1e9, 4.0 * n / (copy_ms * 1e-3) / 1e9);
    }
    Buffer x = bf16_buffer(N * 4 * C, 1.0f, s);
    const double ms = timer.median_ms([&] { fp8::cuda::amax(x.data(), DType::bf16, N * 4 * C, amax, s); });
    std::printf("%-5s %-38s %-14s %9.4f %9.1f\n", m.model, "amax only (current scaling)", dims(N, 4 * C).c_str(), ms,
                2.0 * N * 4 * C / (ms * 1e-3) / 1e9);
  }
}

// The quantisations that compute as they go, at the 1.3B model's sizes: FC2's input quantised as
// gelu(FC1's pre-activation) on load (rowwise in the forward, colwise in the backward), FC1's output
// gradient with the dGELU and the bias gradient, and the optimizer's step over the FC weight alone
// (AdamW with the bf16 copy, as the ops backend runs it) against the fused AdamW + FP8 copies.
void fused_table(Timer& timer, cudaStream_t s, const Buffer& scales) {
  std::printf("\n%-52s %-14s %9s %9s\n", "1.3B: computed while quantising", "shape", "ms", "GB/s");
  const float* scale = static_cast<const float*>(scales.data());
  float* amax = static_cast<float*>(scales.data()) + 1;
  const std::int64_t N = 8192, F = 4 * 2048, C = 2048;
  const std::int64_t n = N * F;
  Buffer pre = bf16_buffer(n, 1.0f, s), dy = bf16_buffer(n, 1e-3f, s), row(Device::cuda, static_cast<std::size_t>(n)),
         col(Device::cuda, static_cast<std::size_t>(n)), dbias(Device::cuda, static_cast<std::size_t>(F) * 4),
         partial(Device::cuda, static_cast<std::size_t>(fp8::cuda::grad_partials(N, F)) * 4);
  auto line = [&](const char* what, std::int64_t r, std::int64_t c, double bytes, double ms) {
    std::printf("%-52s %-14s %9.4f %9.1f\n", what, dims(r, c).c_str(), ms, bytes / (ms * 1e-3) / 1e9);
  };
  auto* r8 = static_cast<std::uint8_t*>(row.data());
  auto* c8 = static_cast<std::uint8_t*>(col.data());
  const auto* pre16 = static_cast<const cuda::bf16*>(pre.data());
  line("fc2 x = gelu(pre) -> rowwise e4m3 + amax", N, F, 3.0 * n, timer.median_ms([&] {
         fp8::cuda::cast_transpose_gelu(pre16, r8, nullptr, fp8::Format::e4m3, scale, amax, N, F, s);
       }));
  line("fc2 x = gelu(pre) -> colwise e4m3", N, F, 3.0 * n, timer.median_ms([&] {
         fp8::cuda::cast_transpose_gelu(pre16, nullptr, c8, fp8::Format::e4m3, scale, nullptr, N, F, s);
       }));
  fp8::cuda::CastTransposeGrad g;
  g.dy = static_cast<const cuda::bf16*>(dy.data());
  g.gelu_pre = pre16;
  g.rowwise = r8;
  g.colwise = c8;
  g.format = fp8::Format::e5m2;
  g.scale = scale;
  g.amax = amax;
  g.dbias = static_cast<float*>(dbias.data());
  g.partial = static_cast<float*>(partial.data());
  g.rows = N;
  g.cols = F;
  line("fc dout * gelu'(pre) -> both e5m2 + amax + dbias", N, F, 6.0 * n,
       timer.median_ms([&] { fp8::cuda::cast_transpose_grad(g, s); }));

  {  // QKV's / FC1's input for the weight gradient: LayerNorm(x) from the forward's statistics
    Buffer x = bf16_buffer(N * C, 1.0f, s), w = bf16_buffer(C, 1.0f, s), b = bf16_buffer(C, 0.1f, s),
           stats(Device::cuda, static_cast<std::size_t>(N) * 8);
    std::vector<float> h(static_cast<std::size_t>(2 * N), 1.0f);
    for (std::int64_t r = 0; r < N; ++r) h[static_cast<std::size_t>(r)] = 0.01f;  // mean; rstd 1
    KILN_CUDA_CHECK(cudaMemcpy(stats.data(), h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    fp8::cuda::LayerNormOfDev ln;
    ln.x = static_cast<const cuda::bf16*>(x.data());
    ln.weight = static_cast<const cuda::bf16*>(w.data());
    ln.bias = static_cast<const cuda::bf16*>(b.data());
    ln.mean = static_cast<const float*>(stats.data());
    ln.rstd = static_cast<const float*>(stats.data()) + N;
    line("ln x = LayerNorm(res) -> colwise e4m3 (backward)", N, C, 3.0 * N * C, timer.median_ms([&] {
           fp8::cuda::cast_transpose_layernorm(ln, nullptr, c8, fp8::Format::e4m3, scale, nullptr, N, C, s);
         }));
  }

  const std::int64_t W = F * C;  // the FC weight [4C, C]
  Buffer p(Device::cuda, static_cast<std::size_t>(W) * 4), gr(Device::cuda, static_cast<std::size_t>(W) * 4),
      m(Device::cuda, static_cast<std::size_t>(W) * 4), v(Device::cuda, static_cast<std::size_t>(W) * 4),
      p16(Device::cuda, static_cast<std::size_t>(W) * 2), seg(Device::cuda, 64);
  for (Buffer* b : {&p, &gr, &m, &v}) KILN_CUDA_CHECK(cudaMemsetAsync(b->data(), 0, b->bytes(), s));
  const cuda::AdamWSegmentDev table{0, W, 0.1f, 0};
  KILN_CUDA_CHECK(cudaMemcpy(seg.data(), &table, sizeof(table), cudaMemcpyHostToDevice));
  line("W_fc: AdamW + bf16 copy (ops backend)", F, C, 30.0 * W, timer.median_ms([&] {
         cuda::adamw(static_cast<float*>(p.data()), static_cast<cuda::bf16*>(p16.data()), static_cast<float*>(gr.data()),
                     false, m.data(), v.data(), false, static_cast<const cuda::AdamWSegmentDev*>(seg.data()), 1, W, 1e-4f, 0.9f, 0.95f, 1e-8f, 1.0f,
                     0.1f, 0.05f, nullptr, s);
       }));
  line("W_fc: f32 master -> both e4m3 + amax (unfused)", F, C, 6.0 * W, timer.median_ms([&] {
         fp8::cuda::cast_transpose(p.data(), DType::f32, r8, c8, fp8::Format::e4m3, scale, amax, F, C, s);
       }));
  fp8::cuda::AdamWQuantizeDev a;
  a.param = static_cast<float*>(p.data());
  a.grad = static_cast<const float*>(gr.data());
  a.m = static_cast<float*>(m.data());
  a.v = static_cast<float*>(v.data());
  a.rowwise = r8;
  a.colwise = c8;
  a.scale = scale;
  a.amax = amax;
  a.rows = F;
  a.cols = C;
  a.lr = 1e-4f;
  a.beta1 = 0.9f;
  a.beta2 = 0.95f;
  a.eps = 1e-8f;
  a.weight_decay = 0.1f;
  a.step = 10;
  line("W_fc: AdamW + both e4m3 + amax (fused)", F, C, 30.0 * W,
       timer.median_ms([&] { fp8::cuda::adamw_quantize(a, s); }));
}

void gemm_table(Timer& timer, cudaStream_t s, cublasLtHandle_t lt, void* ws, std::size_t ws_bytes,
                const Buffer& scales) {
  cuda::GemmRunner bf16(lt, ws, ws_bytes);
  fp8::cuda::Fp8GemmRunner f8(lt, ws, ws_bytes);
  std::printf("\n%-34s %-22s %10s %10s %10s %8s\n", "GEMM (D = X Y^T, M x N x K)", "shape", "bf16 TF/s", "fp8 TF/s",
              "fp8 fast", "speedup");
  struct Shape3 {
    std::string what;
    std::int64_t M, N, K;
    bool wgrad;  // D f32 accumulated, E5M2 x E4M3
    bool dgrad;  // E5M2 x E4M3
    bool dgelu = false;  // the dgrad of FC2 with the dGELU epilogue, as in training
  };
  std::vector<Shape3> shapes;
  for (auto [model, N, C] : {std::tuple<const char*, std::int64_t, std::int64_t>{"124M", 16384, 768}, {"1.3B", 8192, 2048}}) {
    const std::string m = model;
    shapes.push_back({m + " qkv fwd", N, 3 * C, C, false, false});
    shapes.push_back({m + " attn_proj fwd", N, C, C, false, false});
    shapes.push_back({m + " fc fwd", N, 4 * C, C, false, false});
    shapes.push_back({m + " fc_proj fwd", N, C, 4 * C, false, false});
    shapes.push_back({m + " fc dgrad", N, C, 4 * C, false, true});
    shapes.push_back({m + " fc_proj dgrad", N, 4 * C, C, false, true});
    shapes.push_back({m + " fc_proj dgrad + dgelu", N, 4 * C, C, false, true, true});
    shapes.push_back({m + " fc wgrad", 4 * C, C, N, true, false});
    shapes.push_back({m + " qkv wgrad", 3 * C, C, N, true, false});
  }
  shapes.push_back({"square-ish reference", 16384, 8192, 2048, false, false});
  const float* si = static_cast<const float*>(scales.data());
  for (const auto& sh : shapes) {
    const std::int64_t M = sh.M, N = sh.N, K = sh.K;
    Buffer xa = bf16_buffer(M * K, 1.0f, s), ya = bf16_buffer(N * K, 0.02f, s);
    Buffer xq(Device::cuda, static_cast<std::size_t>(M * K)), yq(Device::cuda, static_cast<std::size_t>(N * K));
    KILN_CUDA_CHECK(cudaMemsetAsync(xq.data(), 0x31, xq.bytes(), s));
    KILN_CUDA_CHECK(cudaMemsetAsync(yq.data(), 0x29, yq.bytes(), s));
    Buffer d(Device::cuda, static_cast<std::size_t>(M * N) * 4);
    KILN_CUDA_CHECK(cudaMemsetAsync(d.data(), 0, d.bytes(), s));
    cuda::GemmDesc g;  // the same product in bf16: D[M, N] = X[M, K] Y[N, K]^T
    g.M = static_cast<int>(M);
    g.N = static_cast<int>(N);
    g.K = static_cast<int>(K);
    g.A = static_cast<const cuda::bf16*>(xa.data());
    g.B = static_cast<const cuda::bf16*>(ya.data());
    g.trans_b = true;
    g.D = d.data();
    g.d_f32 = sh.wgrad;
    g.accumulate = sh.wgrad;
    Buffer aux;
    if (sh.dgelu) {
      aux = bf16_buffer(M * N, 1.0f, s);
      g.epilogue = ops::Epilogue::dgelu;
      g.aux = static_cast<cuda::bf16*>(aux.data());
    }
    const double bf_ms = timer.median_ms([&] { bf16.run(g, s); });
    fp8::GemmArgs a;
    a.x = TensorView(xq.data(), {M, K}, sh.wgrad || sh.dgrad ? DType::e5m2 : DType::e4m3, Device::cuda);
    a.y = TensorView(yq.data(), {N, K}, DType::e4m3, Device::cuda);
    a.x_scale_inv = si;
    a.y_scale_inv = si;
    a.d = TensorView(d.data(), {M, N}, sh.wgrad ? DType::f32 : DType::bf16, Device::cuda);
    a.accumulate = sh.wgrad;
    a.f32_result = sh.wgrad;
    if (sh.dgelu) {
      a.epilogue = ops::Epilogue::dgelu;
      a.aux = TensorView(aux.data(), {M, N}, DType::bf16, Device::cuda);
    }
    const double f8_ms = timer.median_ms([&] { f8.run(a, s); });
    a.fast_accum = true;
    const double fast_ms = timer.median_ms([&] { f8.run(a, s); });
    const double flops = 2.0 * M * N * K;
    std::printf("%-34s %-22s %10.1f %10.1f %10.1f %7.2fx\n", sh.what.c_str(),
                mnk(M, N, K).c_str(),
                flops / (bf_ms * 1e-3) / 1e12, flops / (f8_ms * 1e-3) / 1e12, flops / (fast_ms * 1e-3) / 1e12,
                bf_ms / std::min(f8_ms, fast_ms));
  }
}

// The block-scaled products of 1.3B's and Llama 1B's linear layers (forward and data gradient:
// 1x128 x 128x128; weight gradient: 1x128 x 1x128), and one product's operands: codes of modest
// values, D zeroed, every block scale 1.
struct BlockShape {
  std::string what;
  std::int64_t M, N, K;
  bool wgrad;
  fp8::ScalingMode y_mode() const { return wgrad ? fp8::ScalingMode::block_1x128 : fp8::ScalingMode::block_128x128; }
};
std::vector<BlockShape> block_shapes() {
  std::vector<BlockShape> shapes;
  for (auto [model, N, C, F] : {std::tuple<const char*, std::int64_t, std::int64_t, std::int64_t>{"1.3B", 8192, 2048, 8192},
                                {"llama1B", 8192, 2048, 2 * 8192}}) {
    const std::string m = model;
    shapes.push_back({m + " qkv fwd", N, 3 * C, C, false});
    shapes.push_back({m + " fc1 fwd", N, F, C, false});
    shapes.push_back({m + " fc2 fwd", N, C, F / (m == "llama1B" ? 2 : 1), false});
    shapes.push_back({m + " fc1 dgrad", N, C, F, false});
    shapes.push_back({m + " fc1 wgrad", F, C, N, true});
  }
  return shapes;
}
struct BlockOperands {
  Buffer xq, yq, d, scales;
  BlockOperands(const BlockShape& sh, cudaStream_t s)
      : xq(Device::cuda, static_cast<std::size_t>(sh.M * sh.K)),
        yq(Device::cuda, static_cast<std::size_t>(sh.N * sh.K)),
        d(Device::cuda, static_cast<std::size_t>(sh.M * sh.N) * 4) {
    KILN_CUDA_CHECK(cudaMemsetAsync(xq.data(), 0x31, xq.bytes(), s));
    KILN_CUDA_CHECK(cudaMemsetAsync(yq.data(), 0x29, yq.bytes(), s));
    KILN_CUDA_CHECK(cudaMemsetAsync(d.data(), 0, d.bytes(), s));
    const fp8::BlockLayout lx{fp8::ScalingMode::block_1x128, sh.M, sh.K}, ly{sh.y_mode(), sh.N, sh.K};
    std::vector<float> ones(static_cast<std::size_t>(std::max(lx.count(), ly.count())), 1.0f);
    scales = Buffer(Device::cuda, ones.size() * 4);
    KILN_CUDA_CHECK(cudaMemcpy(scales.data(), ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
  }
};

void block_quant_table(Timer& timer, cudaStream_t s);

// Block scaling (`bench_fp8 block`, issue 29): cuBLASLt's block-scaled GEMMs (1x128 x 128x128 for
// the forward and data gradient, 1x128 x 1x128 for the weight gradient) against the per-tensor FP8
// GEMM at 1.3B's and Llama 1B's linear-layer shapes, and the block quantisation kernels' GB/s.
void block_table(Timer& timer, cudaStream_t s, cublasLtHandle_t lt, void* ws, std::size_t ws_bytes,
                 const Buffer& scales, bool probe = false) {
  fp8::cuda::Fp8GemmRunner f8(lt, ws, ws_bytes);
  fp8::cuda::BlockGemm own;
  std::printf("\n%-30s %-22s %11s %11s %11s %11s %8s %8s\n", "block GEMM (D = X Y^T)", "shape", "tensor TF/s",
              "fast TF/s", "block TF/s", "kiln TF/s", "block/t", "kiln/t");
  const float* one = static_cast<const float*>(scales.data());
  for (const auto& sh : block_shapes()) {
    const std::int64_t M = sh.M, N = sh.N, K = sh.K;
    const fp8::ScalingMode ym = sh.y_mode();
    BlockOperands operands(sh, s);
    Buffer &xq = operands.xq, &yq = operands.yq, &d = operands.d, &sb = operands.scales;
    fp8::GemmArgs a;
    a.x = TensorView(xq.data(), {M, K}, sh.wgrad ? DType::e5m2 : DType::e4m3, Device::cuda);
    a.y = TensorView(yq.data(), {N, K}, DType::e4m3, Device::cuda);
    a.x_scale_inv = a.y_scale_inv = one;
    a.d = TensorView(d.data(), {M, N}, sh.wgrad ? DType::f32 : DType::bf16, Device::cuda);
    a.accumulate = a.f32_result = sh.wgrad;
    const double t_ms = timer.median_ms([&] { f8.run(a, s); });
    a.fast_accum = true;
    const double fast_ms = timer.median_ms([&] { f8.run(a, s); });
    a.fast_accum = false;
    a.x_scale_inv = a.y_scale_inv = static_cast<const float*>(sb.data());
    a.x_mode = fp8::ScalingMode::block_1x128;
    a.y_mode = ym;
    double b_ms = -1;
    try {
      b_ms = timer.median_ms([&] { f8.run(a, s); });
    } catch (const std::exception& e) {
      std::printf("%-30s %s\n", sh.what.c_str(), e.what());
      continue;
    }
    const double k_ms = own.takes(a) ? timer.median_ms([&] { own.run(a, s); }) : -1;
    if (probe) {  // kiln's kernel without its stores, without its promotions, without both
      double ms[3];
      for (int pr = 1; pr <= 3; ++pr) {
        own.set_probe(pr);
        ms[pr - 1] = timer.median_ms([&] { own.run(a, s); });
      }
      own.set_probe(0);
      const double f = 2.0 * M * N * K / 1e9;
      std::printf("  probe %-22s kiln %.1f, no stores %.1f, no promotion %.1f, neither %.1f TF/s\n", sh.what.c_str(),
                  f / k_ms, f / ms[0], f / ms[1], f / ms[2]);
      using Tile = fp8::cuda::BlockGemm::Tile;  // each tile (BlockGemm::set_tile)
      double tms[2];
      for (int t = 0; t < 2; ++t) {
        own.set_tile(t == 0 ? Tile::m256n128 : Tile::m192n128);
        tms[t] = timer.median_ms([&] { own.run(a, s); });
      }
      own.set_tile(Tile::automatic);
      int sms = 0;
      KILN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
      std::printf("  tiles %-22s 256x128 %.1f, 192x128 %.1f TF/s (automatic: %s)\n", sh.what.c_str(), f / tms[0],
                  f / tms[1], fp8::cuda::BlockGemm::automatic_tile(M, N, sms) == Tile::m192n128 ? "192x128" : "256x128");
    }
    const double flops = 2.0 * M * N * K;
    std::printf("%-30s %-22s %11.1f %11.1f %11.1f %11.1f %7.2fx %7.2fx\n", sh.what.c_str(), mnk(M, N, K).c_str(),
                flops / (t_ms * 1e-3) / 1e12, flops / (fast_ms * 1e-3) / 1e12, flops / (b_ms * 1e-3) / 1e12,
                k_ms > 0 ? flops / (k_ms * 1e-3) / 1e12 : 0.0, t_ms / b_ms, k_ms > 0 ? t_ms / k_ms : 0.0);
  }
  block_quant_table(timer, s);
}

// The block quantisation kernels alone (`bench_fp8 block-quant`): GB/s of bytes read and written.
void block_quant_table(Timer& timer, cudaStream_t s) {
  std::printf("\n%-40s %-14s %9s %9s\n", "block quantisation (bf16 in; GB/s read + written)", "shape", "ms", "GB/s");
  for (auto [R, C] : {std::pair<std::int64_t, std::int64_t>{8192, 2048}, {8192, 8192}, {2048, 8192}}) {
    Buffer x = bf16_buffer(R * C, 1.0f, s), q(Device::cuda, static_cast<std::size_t>(R * C)),
           qt(Device::cuda, static_cast<std::size_t>(R * C));
    for (auto mode : {fp8::ScalingMode::block_1x128, fp8::ScalingMode::block_128x128}) {
      const fp8::BlockLayout l{mode, R, C};
      Buffer sc(Device::cuda, static_cast<std::size_t>(l.count()) * 4 + 256),
          sct(Device::cuda, static_cast<std::size_t>(fp8::BlockLayout{mode, C, R}.count()) * 4 + 256);
      for (int copies : {1, 3}) {  // rowwise; both
        fp8::cuda::BlockCast k{x.data(), DType::bf16, R, C, mode};
        k.rowwise = static_cast<std::uint8_t*>(q.data());
        k.row_scale_inv = static_cast<float*>(sc.data());
        if (copies == 3) {
          k.colwise = static_cast<std::uint8_t*>(qt.data());
          k.col_scale_inv = static_cast<float*>(sct.data());
        }
        const double ms = timer.median_ms([&] { fp8::cuda::quantize_blocks(k, s); });
        const std::string what = std::string(mode == fp8::ScalingMode::block_1x128 ? "1x128" : "128x128") +
                                 (copies == 3 ? " -> e4m3 both" : " -> e4m3 rowwise");
        std::printf("%-40s %-14s %9.4f %9.1f\n", what.c_str(), dims(R, C).c_str(), ms,
                    (2.0 + (copies == 3 ? 2.0 : 1.0)) * R * C / (ms * 1e-3) / 1e9);
      }
    }
    // Computing on load (both copies): dGELU with the bias gradient (two bf16 tensors read), GELU.
    Buffer pre = bf16_buffer(R * C, 1.0f, s), part(Device::cuda, static_cast<std::size_t>(fp8::cuda::block_partials(R, C)) * 4),
           db(Device::cuda, static_cast<std::size_t>(C) * 4);
    const fp8::BlockLayout l{fp8::ScalingMode::block_1x128, R, C}, tl{fp8::ScalingMode::block_1x128, C, R};
    Buffer sc(Device::cuda, static_cast<std::size_t>(l.count()) * 4 + 256), sct(Device::cuda, static_cast<std::size_t>(tl.count()) * 4 + 256);
    fp8::cuda::BlockCast k{x.data(), DType::bf16, R, C, fp8::ScalingMode::block_1x128};
    k.rowwise = static_cast<std::uint8_t*>(q.data());
    k.row_scale_inv = static_cast<float*>(sc.data());
    k.colwise = static_cast<std::uint8_t*>(qt.data());
    k.col_scale_inv = static_cast<float*>(sct.data());
    k.source = ops::Prologue::dgelu;
    k.aux = pre.data();
    k.dbias = static_cast<float*>(db.data());
    k.partial = static_cast<float*>(part.data());
    double ms = timer.median_ms([&] { fp8::cuda::quantize_blocks(k, s); });
    std::printf("%-40s %-14s %9.4f %9.1f\n", "1x128 dgelu + dbias -> both", dims(R, C).c_str(), ms, 6.0 * R * C / (ms * 1e-3) / 1e9);
    k.source = ops::Prologue::gelu;
    k.dbias = k.partial = nullptr;
    ms = timer.median_ms([&] { fp8::cuda::quantize_blocks(k, s); });
    std::printf("%-40s %-14s %9.4f %9.1f\n", "1x128 gelu -> both", dims(R, C).c_str(), ms, 4.0 * R * C / (ms * 1e-3) / 1e9);
    // dSwiGLU (x: the output's gradient [R, C / 2], aux: the gate and up values [R, C]): 3 R C bytes read
    // once each, 2 R C written.
    k.source = ops::Prologue::dswiglu;
    ms = timer.median_ms([&] { fp8::cuda::quantize_blocks(k, s); });
    std::printf("%-40s %-14s %9.4f %9.1f\n", "1x128 dswiglu -> both", dims(R, C).c_str(), ms, 5.0 * R * C / (ms * 1e-3) / 1e9);
    // The optimizer's step of an f32 master weight with its 128x128 codes (30 bytes an element), the
    // step alone (28), and the codes from the updated f32 master (6).
    Buffer pm(Device::cuda, static_cast<std::size_t>(R * C) * 4), g(Device::cuda, static_cast<std::size_t>(R * C) * 4),
        mm(Device::cuda, static_cast<std::size_t>(R * C) * 4), vv(Device::cuda, static_cast<std::size_t>(R * C) * 4);
    for (Buffer* b : {&pm, &g, &mm, &vv}) KILN_CUDA_CHECK(cudaMemsetAsync(b->data(), 0, b->bytes(), s));
    fp8::cuda::AdamWQuantizeDev u;
    u.param = static_cast<float*>(pm.data());
    u.grad = static_cast<const float*>(g.data());
    u.m = static_cast<float*>(mm.data());
    u.v = static_cast<float*>(vv.data());
    u.rows = R;
    u.cols = C;
    u.lr = 1e-4f, u.beta1 = 0.9f, u.beta2 = 0.95f, u.eps = 1e-8f;
    const fp8::BlockLayout wl{fp8::ScalingMode::block_128x128, R, C}, wtl{fp8::ScalingMode::block_128x128, C, R};
    fp8::cuda::BlockCast w{nullptr, DType::f32, R, C, fp8::ScalingMode::block_128x128};
    w.rowwise = static_cast<std::uint8_t*>(q.data());
    w.row_scale_inv = static_cast<float*>(sc.data());
    w.colwise = static_cast<std::uint8_t*>(qt.data());
    w.col_scale_inv = static_cast<float*>(sct.data());
    (void)wl, (void)wtl;
    ms = timer.median_ms([&] { fp8::cuda::quantize_blocks_adamw(w, u, s); });
    std::printf("%-40s %-14s %9.4f %9.1f\n", "adamw + 128x128 -> both (fused)", dims(R, C).c_str(), ms, 30.0 * R * C / (ms * 1e-3) / 1e9);
    ms = timer.median_ms([&] { fp8::cuda::adamw_quantize(u, s); });
    std::printf("%-40s %-14s %9.4f %9.1f\n", "adamw alone", dims(R, C).c_str(), ms, 28.0 * R * C / (ms * 1e-3) / 1e9);
    w.x = pm.data();
    ms = timer.median_ms([&] { fp8::cuda::quantize_blocks(w, s); });
    std::printf("%-40s %-14s %9.4f %9.1f\n", "128x128 from f32 -> both", dims(R, C).c_str(), ms, 6.0 * R * C / (ms * 1e-3) / 1e9);
  }
}

// What cuBLASLt's heuristic leaves on the table for block-scaled products (`bench_fp8 block-algos`):
// each candidate it returns (up to 32) for block_shapes(), timed alone.
void block_algos(Timer& timer, cudaStream_t s, cublasLtHandle_t lt, void* ws, std::size_t ws_bytes) {
  std::printf("\n%-20s %-22s %3s %5s %5s %6s %6s %7s %7s %9s\n", "block GEMM candidates", "shape", "#", "algo", "tile",
              "stages", "splitK", "swizzle", "cluster", "TFLOP/s");
  auto attr = [](const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t at) {
    int v = 0;
    std::size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&a, at, &v, sizeof(v), &written);
    return v;
  };
  for (const auto& sh : block_shapes()) {
    const std::int64_t M = sh.M, N = sh.N, K = sh.K;
    BlockOperands operands(sh, s);
    Buffer &xq = operands.xq, &yq = operands.yq, &d = operands.d, &sb = operands.scales;
    cublasLtMatmulDesc_t op;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cuda::set_attr(op, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<std::int32_t>(CUBLAS_OP_T));
    cuda::set_attr(op, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<std::int32_t>(CUBLAS_OP_N));
    cuda::set_attr(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(sb.data()));
    cuda::set_attr(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(sb.data()));
    cuda::set_attr(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                   static_cast<std::int32_t>(sh.wgrad ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                                      : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F));
    cuda::set_attr(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, static_cast<std::int32_t>(CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F));
    const auto dt = sh.wgrad ? CUDA_R_32F : CUDA_R_16BF;
    cuda::LtLayout a(CUDA_R_8F_E4M3, K, N, K), b(CUDA_R_8F_E4M3, K, M, K), c(dt, N, M, N);
    cuda::LtPreference pref;
    pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(ws_bytes));
    std::vector<cublasLtMatmulHeuristicResult_t> results(32);
    int found = 0;
    KILN_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, op, a.l, b.l, c.l, c.l, pref.p, 32, results.data(), &found));
    const float alpha = 1.0f, beta = sh.wgrad ? 1.0f : 0.0f;
    const double flops = 2.0 * M * N * K;
    for (int i = 0; i < found; ++i) {
      const auto& r = results[static_cast<std::size_t>(i)];
      if (r.state != CUBLAS_STATUS_SUCCESS) continue;
      bool ok = true;
      const double ms = timer.median_ms([&] {
        if (cublasLtMatmul(lt, op, &alpha, yq.data(), a.l, xq.data(), b.l, &beta, d.data(), c.l, d.data(), c.l, &r.algo, ws,
                           ws_bytes, s) != CUBLAS_STATUS_SUCCESS)
          ok = false;
      });
      std::printf("%-20s %-22s %3d %5d %5d %6d %6d %7d %7d %9.1f%s\n", sh.what.c_str(), mnk(M, N, K).c_str(), i,
                  attr(r.algo, CUBLASLT_ALGO_CONFIG_ID), attr(r.algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
                  attr(r.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID), attr(r.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                  attr(r.algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING), attr(r.algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
                  flops / (ms * 1e-3) / 1e12, ok ? "" : " (failed)");
    }
    cublasLtMatmulDescDestroy(op);
  }
}

// The experts' grouped casts at moe-1b's sizes (16384 tokens x top-2 = 32768 rows over 8 experts of
// uneven load, d 1024, expert width 2816): FC1's input, FC2's input as the SwiGLU of FC1's output,
// FC2's output gradient and FC1's output gradient through the SwiGLU's backward, each into both
// copies with the amax, as a training step runs them; GB/s of bytes read + written against a copy.
void grouped_table(Timer& timer, cudaStream_t s, const Buffer& scales) {
  std::printf("\n%-52s %-14s %9s %9s %9s\n", "moe-1b grouped (8 experts)", "out shape", "ms", "GB/s", "copy GB/s");
  const float* scale = static_cast<const float*>(scales.data());
  float* amax = static_cast<float*>(scales.data()) + 1;
  const int E = 8;
  const std::int64_t R = 32768, C = 1024, H = 2816;
  std::vector<std::int32_t> offsets(E + 1, 0);
  const int share[E] = {3901, 4517, 3377, 4703, 4099, 3671, 4213, 0};
  for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + (e + 1 < E ? share[e] : static_cast<std::int32_t>(R) - offsets[e]);
  Buffer x = bf16_buffer(R * C, 1.0f, s), gate_up = bf16_buffer(R * 2 * H, 1.0f, s), g = bf16_buffer(R * H, 1e-3f, s),
         row(Device::cuda, static_cast<std::size_t>(R * 2 * H)), col(Device::cuda, static_cast<std::size_t>((R + 16 * E) * 2 * H)),
         copy(Device::cuda, static_cast<std::size_t>(R * 2 * H) * 2);
  struct Entry {
    const char* what;
    fp8::cuda::CastSource source;
    const void* x;
    const void* grad;
    std::int64_t cols;     // the output's
    double read_elems;     // bf16 elements read per row
    fp8::Format format;
  };
  const Entry entries[] = {
      {"fc1 x -> both e4m3 + amax", fp8::cuda::CastSource::plain, x.data(), nullptr, C, double(C), fp8::Format::e4m3},
      {"fc2 x = swiglu(gate_up) -> both e4m3 + amax", fp8::cuda::CastSource::swiglu, gate_up.data(), nullptr, H,
       double(2 * H), fp8::Format::e4m3},
      {"fc2 dout -> both e5m2 + amax", fp8::cuda::CastSource::plain, x.data(), nullptr, C, double(C), fp8::Format::e5m2},
      {"fc1 dout = dswiglu(g, gate_up) -> both e5m2 + amax", fp8::cuda::CastSource::dswiglu, gate_up.data(), g.data(),
       2 * H, double(3 * H), fp8::Format::e5m2},
  };
  for (const Entry& e : entries) {
    const std::int64_t load_cols = e.source == fp8::cuda::CastSource::dswiglu ? e.cols / 2 : e.cols;
    const std::vector<std::int32_t> plan = fp8::cuda::grouped_cast_plan(offsets.data(), E, 0, load_cols);
    fp8::cuda::GroupedCast a;
    a.x = e.x;
    a.source = e.source;
    a.grad = e.grad;
    std::copy(plan.begin(), plan.end(), a.inline_plan.v);
    a.experts = E;
    a.used_rows = plan[E];
    a.padded_rows = plan[2 * (E + 1) - 1];
    a.tiles = plan[3 * (E + 1) - 1];
    a.tiled = true;
    a.cols = e.cols;
    a.rowwise = static_cast<std::uint8_t*>(row.data());
    a.colwise = static_cast<std::uint8_t*>(col.data());
    a.format = e.format;
    a.scale = scale;
    a.amax = amax;
    const double ms = timer.median_ms([&] { fp8::cuda::cast_transpose_grouped(a, s); });
    const double bytes = R * (2.0 * e.read_elems + 2.0 * e.cols);
    const std::size_t copy_bytes = static_cast<std::size_t>(R * 2 * H) * 2;  // gate_up, the largest input
    const double copy_ms = timer.median_ms(
        [&] { KILN_CUDA_CHECK(cudaMemcpyAsync(copy.data(), gate_up.data(), copy_bytes, cudaMemcpyDeviceToDevice, s)); });
    std::printf("%-52s %-14s %9.4f %9.1f %9.1f\n", e.what, dims(R, e.cols).c_str(), ms, bytes / (ms * 1e-3) / 1e9,
                2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9);
  }
}

}  // namespace
}  // namespace kiln::bench

int main(int argc, char** argv) {
  using namespace kiln;
  try {
    cudaStream_t s;
    KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaDeviceProp prop{};
    KILN_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("kiln FP8 benchmark on %s (median of %d calls, L2 flushed)\n", prop.name, bench::kIters);
    bench::Timer timer(s);
    Buffer scales(Device::cuda, 256);
    const float init[2] = {1.0f, 0.0f};  // scale (and scale_inv) 1, amax 0
    KILN_CUDA_CHECK(cudaMemcpy(scales.data(), init, sizeof(init), cudaMemcpyHostToDevice));
    const std::string only = argc > 1 ? argv[1] : "";
    if (only == "grouped") {  // the experts' grouped casts alone
      bench::grouped_table(timer, s, scales);
      return 0;
    }
    if (only == "block-quant") {  // the block quantisation kernels alone
      bench::block_quant_table(timer, s);
      return 0;
    }
    if (only == "block-algos") {  // cuBLASLt's candidates for block-scaled products
      cublasLtHandle_t lt;
      KILN_CUBLAS_CHECK(cublasLtCreate(&lt));
      Buffer ws(Device::cuda, 32u << 20);
      bench::block_algos(timer, s, lt, ws.data(), 32u << 20);
      cublasLtDestroy(lt);
      return 0;
    }
    if (only == "block" || only == "block-probe") {  // block scaling alone (with kiln's kernel taken apart)
      cublasLtHandle_t lt;
      KILN_CUBLAS_CHECK(cublasLtCreate(&lt));
      Buffer ws(Device::cuda, 32u << 20);
      bench::block_table(timer, s, lt, ws.data(), 32u << 20, scales, only == "block-probe");
      cublasLtDestroy(lt);
      return 0;
    }
    bench::quantize_table(timer, s, scales);
    bench::fused_table(timer, s, scales);
    bench::grouped_table(timer, s, scales);
    cublasLtHandle_t lt;
    KILN_CUBLAS_CHECK(cublasLtCreate(&lt));
    constexpr std::size_t kWs = 32u << 20;
    Buffer ws(Device::cuda, kWs);
    bench::gemm_table(timer, s, lt, ws.data(), kWs, scales);
    cublasLtDestroy(lt);
    cudaStreamDestroy(s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_fp8: %s\n", e.what());
    return 1;
  }
  return 0;
}
