// Times kiln's CUDA kernels and cuBLASLt GEMMs at GPT-2 124M (N=16384 tokens, C=768) and 1.3B
// (N=8192, C=2048) sizes, V=50304. Each entry: warm-up, then the median of CUDA-event timings of
// single calls, with L2 flushed before each call. Prints one table: op, shape, ms, achieved GB/s
// (bytes read + written, counted as the minimum traffic of the op) and TFLOP/s for GEMMs. A
// device-to-device cudaMemcpy is the bandwidth ceiling.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cross_entropy_variants.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/ops/cuda/gemm.hpp"
#include "kiln/ops/cuda/launchers.hpp"
#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "bench_timer.hpp"

namespace kiln::bench {
namespace {

using bf16 = cuda::bf16;  // hides kiln::bf16 (the host storage type) in this namespace

constexpr int kWarmup = 3, kIters = 15;

// Median of single calls with L2 evicted before each.
class Timer : public EventTimer {
 public:
  explicit Timer(cudaStream_t s) : EventTimer(s, true, kWarmup, kIters) {}
};

void row(const std::string& op, const std::string& shape, double ms, double bytes, double flops = 0) {
  std::printf("%-34s %-28s %9.4f %9.1f", op.c_str(), shape.c_str(), ms, bytes / (ms * 1e-3) / 1e9);
  if (flops > 0) std::printf(" %9.1f", flops / (ms * 1e-3) / 1e12);
  std::printf("\n");
}

std::string dims(std::initializer_list<std::int64_t> d) {
  std::string s = "[";
  for (auto v : d) {
    if (s.size() > 1) s += ',';
    s += std::to_string(v);
  }
  s += ']';
  return s;
}

// Device buffers filled with N(0, std) values (bf16 ones through an f32 staging copy).
struct Buffers {
  cudaStream_t s;
  std::vector<Buffer> keep;
  std::uint64_t seed = 1;
  float* f32(std::int64_t n, float std = 1.0f) {
    keep.emplace_back(Device::cuda, static_cast<std::size_t>(n) * 4);
    auto* p = static_cast<float*>(keep.back().data());
    cuda::init_normal_f32(p, n, std, {seed++, 0, nullptr}, 0, s);
    return p;
  }
  bf16* act(std::int64_t n, float std = 1.0f) {
    Buffer tmp(Device::cuda, static_cast<std::size_t>(n) * 4);
    cuda::init_normal_f32(static_cast<float*>(tmp.data()), n, std, {seed++, 0, nullptr}, 0, s);
    keep.emplace_back(Device::cuda, static_cast<std::size_t>(n) * 2);
    auto* p = static_cast<bf16*>(keep.back().data());
    cuda::convert_f32_to_bf16(p, static_cast<float*>(tmp.data()), n, s);
    KILN_CUDA_CHECK(cudaStreamSynchronize(s));
    return p;
  }
  template <class T>
  T* upload(const std::vector<T>& host) {
    keep.emplace_back(Device::cuda, host.size() * sizeof(T));
    KILN_CUDA_CHECK(cudaMemcpy(keep.back().data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return static_cast<T*>(keep.back().data());
  }
};

struct Config {
  const char* name;
  int N, C, T;
  std::int64_t params;
};

void bench_config(const Config& cfg, cudaStream_t s, Timer& timer, cuda::GemmRunner& gemm) {
  const int N = cfg.N, C = cfg.C, T = cfg.T, V = 50304, Vr = 50257;
  const double nc2 = 2.0 * N * C;  // bytes of one [N, C] bf16 tensor
  std::printf("\n== %s: N=%d tokens, C=%d, T=%d, V=%d, %lld parameters ==\n", cfg.name, N, C, T, V,
              static_cast<long long>(cfg.params));
  Buffers buf{s};

  // ---- bandwidth ceiling ----
  {
    const std::int64_t n = static_cast<std::int64_t>(N) * 4 * C;  // bf16 elements of the MLP activation
    bf16* a = buf.act(n);
    bf16* b = buf.act(n);
    double ms = timer.median_ms([&] { KILN_CUDA_CHECK(cudaMemcpyAsync(b, a, n * 2, cudaMemcpyDeviceToDevice, s)); });
    row("cudaMemcpy D2D (ceiling)", dims({N, 4 * C}) + " bf16", ms, 2.0 * n * 2);
  }

  // ---- elementwise ----
  {
    const std::int64_t n = cfg.params;
    float* f = buf.f32(n);
    bf16* h = buf.act(n);
    row("convert f32->bf16", dims({n}), timer.median_ms([&] { cuda::convert_f32_to_bf16(h, f, n, s); }), 6.0 * n);
    row("convert bf16->f32", dims({n}), timer.median_ms([&] { cuda::convert_bf16_to_f32(f, h, n, s); }), 6.0 * n);
    row("fill_f32", dims({n}), timer.median_ms([&] { cuda::fill_f32(f, 0.5f, n, s); }), 4.0 * n);
    row("init_normal_f32 (compute bound)", dims({n}),
        timer.median_ms([&] { cuda::init_normal_f32(f, n, 0.02f, {7, 0, nullptr}, 0, s); }), 4.0 * n);
    const std::int64_t parts = cuda::sum_squares_partials(n);
    float* partials = buf.f32(parts);
    row("sum_squares_f32", dims({n}), timer.median_ms([&] { cuda::sum_squares_f32(partials, f, n, s); }), 4.0 * n);
  }

  // ---- embedding ----
  {
    std::mt19937 gen(1);
    std::uniform_int_distribution<int> dist(0, Vr - 1);
    std::vector<std::int32_t> tokens(N);
    for (auto& t : tokens) t = dist(gen);
    std::int32_t* tok = buf.upload(tokens);
    bf16* wte = buf.act(static_cast<std::int64_t>(V) * C);
    bf16* wpe = buf.act(static_cast<std::int64_t>(T) * C);
    bf16* out = buf.act(static_cast<std::int64_t>(N) * C);
    row("embedding_forward", dims({N, C}),
        timer.median_ms([&] { cuda::embedding_forward(out, tok, wte, wpe, N, T, C, 0, V, true, s); }), 2 * nc2 + 2.0 * T * C);
    // The backward's buckets (the backend makes them on the device each call) are made once here;
    // their cost is timed on its own.
    std::vector<std::int32_t> sorted(tokens.begin(), tokens.end());
    std::sort(sorted.begin(), sorted.end());
    const int U = static_cast<int>(std::unique(sorted.begin(), sorted.end()) - sorted.begin());
    const std::size_t scratch_bytes = cuda::embedding_buckets_scratch(N, V);
    buf.keep.emplace_back(Device::cuda, (3 * static_cast<std::size_t>(N) + 1) * 4 + scratch_bytes);
    auto* buckets = static_cast<std::int32_t*>(buf.keep.back().data());
    std::int32_t *order = buckets, *ends = order + N, *ids = ends + N;
    int* runs = ids + N;
    auto make_buckets = [&] { cuda::embedding_buckets(order, ends, ids, runs, tok, 0, V, N, runs + 1, scratch_bytes, s); };
    make_buckets();
    float* dwte = buf.f32(static_cast<std::int64_t>(V) * C);
    float* dwpe = buf.f32(static_cast<std::int64_t>(T) * C);
    row("embedding_buckets (radix sort)", dims({N}) + " U=" + std::to_string(U), timer.median_ms(make_buckets),
        16.0 * N);
    row("embedding_backward", dims({N, C}) + " U=" + std::to_string(U),
        timer.median_ms([&] { cuda::embedding_backward(dwte, dwpe, out, order, ends, ids, runs, V, N, T, C, s); }),
        nc2 + 8.0 * U * C + 8.0 * T * C);
  }

  // ---- layernorm, residual, dropout ----
  {
    const std::int64_t n = static_cast<std::int64_t>(N) * C;
    bf16 *x = buf.act(n), *out = buf.act(n), *dout = buf.act(n), *dx = buf.act(n), *res = buf.act(n);
    bf16 *w = buf.act(C), *b = buf.act(C);
    float *mean = buf.f32(N), *rstd = buf.f32(N, 0.1f), *dw = buf.f32(C), *db = buf.f32(C);
    float* scratch = buf.f32(cuda::layernorm_backward_scratch(N, C));
    cuda::layernorm_forward(out, mean, rstd, x, w, b, N, C, 1e-5f, s);
    row("layernorm_forward", dims({N, C}),
        timer.median_ms([&] { cuda::layernorm_forward(out, mean, rstd, x, w, b, N, C, 1e-5f, s); }), 2 * nc2 + 8.0 * N);
    row("layernorm_backward", dims({N, C}), timer.median_ms([&] {
          cuda::layernorm_backward(dx, dw, db, scratch, dout, x, w, mean, rstd, N, C, s);
        }),
        4 * nc2 + 8.0 * N);
    ops::DropoutArgs none, drop;
    drop.p = 0.1f;
    drop.rng = {99, 0, nullptr};
    row("residual_forward", dims({N, C}),
        timer.median_ms([&] { cuda::residual_forward(out, res, x, N, C, none, s); }), 3 * nc2);
    row("residual_forward dropout 0.1", dims({N, C}),
        timer.median_ms([&] { cuda::residual_forward(out, res, x, N, C, drop, s); }), 3 * nc2);
    row("dropout_backward 0.1", dims({N, C}),
        timer.median_ms([&] { cuda::dropout_backward(dx, dout, N, C, drop, s); }), 2 * nc2);
    const std::int64_t n4 = 4 * n;  // the MLP activation, recomputed by gelu_forward in the backward
    bf16 *pre = buf.act(n4), *act4 = buf.act(n4);
    row("gelu_forward", dims({N, 4 * C}), timer.median_ms([&] { cuda::gelu_forward(act4, pre, n4, s); }), 4.0 * n4);
  }

  // ---- bias gradient ----
  for (int OC : {C, 4 * C}) {
    bf16* dout = buf.act(static_cast<std::int64_t>(N) * OC);
    float* dbias = buf.f32(OC);
    float* scratch = buf.f32(cuda::bias_grad_scratch(N, OC));
    auto* tickets = reinterpret_cast<unsigned*>(buf.f32(cuda::bias_grad_tickets(OC)));
    KILN_CUDA_CHECK(cudaMemsetAsync(tickets, 0, cuda::bias_grad_tickets(OC) * sizeof(unsigned), s));
    row("bias_grad", dims({N, OC}),
        timer.median_ms([&] { cuda::bias_grad(dbias, scratch, tickets, dout, N, OC, s); }),
        2.0 * N * OC);
  }

  // ---- cross-entropy (logits overwritten by dlogits each call; same cost) ----
  {
    bf16* logits = buf.act(static_cast<std::int64_t>(N) * V, 2.0f);
    std::vector<std::int32_t> targets(N);
    std::mt19937 gen(2);
    for (auto& t : targets) t = std::uniform_int_distribution<int>(0, Vr - 1)(gen);
    auto* tgt = buf.upload(targets);
    float* losses = buf.f32(N);
    row("cross_entropy (1 read + 1 write)", dims({N, V}),
        timer.median_ms([&] { cuda::cross_entropy(losses, logits, tgt, N, V, Vr, 1.0f / N, s); }),
        2.0 * 2.0 * N * V);
    using enum cuda::CrossEntropyVariant;
    const std::pair<const char*, cuda::CrossEntropyVariant> variants[] = {
        {"  ce: registers", row_in_registers}, {"  ce: stream 512", streaming_512}, {"  ce: stream 256", streaming_256},
        {"  ce: shared mem 512", shared_512},  {"  ce: shared mem 256", shared_256}};
    for (const auto& [name, variant] : variants)
      row(name, dims({N, V}), timer.median_ms([&] {
            cuda::cross_entropy_variant(variant, losses, logits, tgt, N, V, Vr, 1.0f / N, s);
          }),
          2.0 * 2.0 * N * V);
  }

  // ---- adamw over all parameters ----
  {
    const std::int64_t P = cfg.params;
    float *p = buf.f32(P, 0.02f), *g = buf.f32(P, 1e-3f), *m = buf.f32(P, 0.0f), *v = buf.f32(P, 0.0f);
    bf16* pb = buf.act(P);
    const std::int64_t half = P / 2 / 4 * 4;  // the first segment's work rounds to itself
    std::vector<cuda::AdamWSegmentDev> segs = {{0, half, 0.1f, 0}, {half, P - half, 0.0f, half}};
    auto* d_segs = buf.upload(segs);
    const std::int64_t work = half + (P - half + 3) / 4 * 4;
    row("adamw (+bf16 copy)", dims({P}), timer.median_ms([&] {
          cuda::adamw(p, pb, g, false, m, v, false, d_segs, 2, work, 3e-4f, 0.9f, 0.95f, 1e-8f, 1.0f, 0.1f, 0.01f, nullptr, s);
        }),
        P * (4.0 * 4 + 4.0 * 3 + 2));
  }

  // ---- GEMMs (cuBLASLt) ----
  struct G {
    const char* op;
    int M, N, K;
    bool ta, tb, f32acc;
    ops::Epilogue epi;
  };
  const std::vector<G> gemms = {
      {"fwd qkv x@W^T +bias", N, 3 * C, C, false, true, false, ops::Epilogue::bias},
      {"fwd fc x@W^T +bias", N, 4 * C, C, false, true, false, ops::Epilogue::bias},
      {"fwd fc x@W^T +bias +GELU(aux)", N, 4 * C, C, false, true, false, ops::Epilogue::gelu},
      {"fwd proj x@W^T +bias", N, C, 4 * C, false, true, false, ops::Epilogue::bias},
      {"fwd lm_head x@wte^T", N, V, C, false, true, false, ops::Epilogue::none},
      {"dx fc dout@W", N, C, 4 * C, false, false, false, ops::Epilogue::none},
      {"dx proj dout@W *GELU'(aux)", N, 4 * C, C, false, false, false, ops::Epilogue::dgelu},
      {"dx lm_head dlogits@wte", N, C, V, false, false, false, ops::Epilogue::none},
      {"dW fc dout^T@x (f32 +=)", 4 * C, C, N, true, false, true, ops::Epilogue::none},
      {"dW qkv dout^T@x (f32 +=)", 3 * C, C, N, true, false, true, ops::Epilogue::none},
      {"dW lm_head dlogits^T@x (f32 +=)", V, C, N, true, false, true, ops::Epilogue::none},
      {"dW proj (f32 +=)", C, 4 * C, N, true, false, true, ops::Epilogue::none},
  };
  for (const auto& e : gemms) {
    cuda::GemmDesc g;
    g.M = e.M;
    g.N = e.N;
    g.K = e.K;
    g.trans_a = e.ta;
    g.trans_b = e.tb;
    g.A = buf.act(static_cast<std::int64_t>(e.M) * e.K, 0.1f);
    g.B = buf.act(static_cast<std::int64_t>(e.K) * e.N, 0.1f);
    g.d_f32 = e.f32acc;
    g.accumulate = e.f32acc;
    g.D = e.f32acc ? static_cast<void*>(buf.f32(static_cast<std::int64_t>(e.M) * e.N))
                   : static_cast<void*>(buf.act(static_cast<std::int64_t>(e.M) * e.N));
    g.epilogue = e.epi;
    if (e.epi == ops::Epilogue::bias || e.epi == ops::Epilogue::gelu) g.bias = buf.act(e.N);
    if (e.epi == ops::Epilogue::gelu || e.epi == ops::Epilogue::dgelu)
      g.aux = buf.act(static_cast<std::int64_t>(e.M) * e.N);

    const double a = 2.0 * e.M * e.K, b = 2.0 * e.K * e.N, d = (e.f32acc ? 8.0 : 2.0) * e.M * e.N;
    const double aux = g.aux ? 2.0 * e.M * e.N : 0.0;
    row(std::string("gemm ") + e.op, "M=" + std::to_string(e.M) + " N=" + std::to_string(e.N) + " K=" +
            std::to_string(e.K),
        timer.median_ms([&] { gemm.run(g, s); }), a + b + d + aux, 2.0 * e.M * e.N * e.K);
  }
  KILN_CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace
}  // namespace kiln::bench

int main() {
  using namespace kiln;
  using namespace kiln::bench;
  try {
    if (!ops::cuda_available()) {
      std::printf("bench_kernels: no CUDA device is visible\n");
      return 1;
    }
    auto backend = ops::make_cuda_backend(0);
    auto s = static_cast<cudaStream_t>(backend->stream());
    cublasLtHandle_t lt;
    KILN_CUBLAS_CHECK(cublasLtCreate(&lt));
    constexpr std::size_t kWorkspace = 32u << 20;  // as the backend
    Buffer workspace(Device::cuda, kWorkspace);
    {
      cuda::GemmRunner gemm(lt, workspace.data(), kWorkspace);
      Timer timer(s);
      std::printf("device: %s\n", backend->name().c_str());
      std::printf("%-34s %-28s %9s %9s %9s\n", "op", "shape", "ms", "GB/s", "TFLOP/s");
      bench_config({"GPT-2 124M", 16384, 768, 1024, 124'439'808}, s, timer, gemm);
      bench_config({"GPT-2 1.3B", 8192, 2048, 2048, 1'315'000'000}, s, timer, gemm);
    }
    cublasLtDestroy(lt);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_kernels: %s\n", e.what());
    return 1;
  }
}
