// The experts' GEMMs of a mixture of experts, three ways, on one GPU: cuBLAS's grouped batched GEMM
// (one call, a group per expert), one cublasGemmEx per expert, and one strided batched GEMM over rows
// padded to the largest expert's. Shapes of pipelines/moe-1b.toml (C 1024, SwiGLU 2816, 8 experts,
// 32768 routed rows), balanced and imbalanced. Prints TFLOP/s per method and GEMM.
//   bench_grouped_gemm [iters]
#include <cublas_v2.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_random.hpp"
#include "bench_timer.hpp"
#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/cuda_check.hpp"

using namespace kiln;

namespace {

using bf16 = std::uint16_t;

struct Problem {
  const char* name;
  int K, N;       // out[rows, N] = x[rows, K] @ W_e^T, W_e [N, K]
  bool wgrad;     // dW_e[N, K] += dout[rows, N]^T @ x[rows, K] (f32 out)
};

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  // KILN_HANDLE=kiln: the handle as kiln's GroupedGemm sets it up (a 32 MiB workspace of its own,
  // no reduced-precision reductions); else cuBLAS's defaults.
  const bool kiln_handle = std::getenv("KILN_HANDLE") && std::string(std::getenv("KILN_HANDLE")) == "kiln";
  cublasHandle_t h;
  KILN_CUBLAS_CHECK(cublasCreate(&h));
  cudaStream_t s;
  KILN_CUDA_CHECK(cudaStreamCreate(&s));
  KILN_CUBLAS_CHECK(cublasSetStream(h, s));
  Buffer ws(Device::cuda, 32u << 20);
  if (kiln_handle) {
    KILN_CUBLAS_CHECK(cublasSetWorkspace(h, ws.data(), ws.bytes()));
    KILN_CUBLAS_CHECK(cublasSetMathMode(
        h, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  }
  std::printf("handle: %s\n", kiln_handle ? "kiln's (32 MiB workspace, no reduced-precision reductions)" : "cuBLAS defaults");
  bench::EventTimer timer(s, false, 3, iters);
  const int E = 8, R = 32768;
  const std::vector<std::vector<int>> splits = {
      std::vector<int>(E, R / E),
      {5500, 3000, 4100, 4600, 3600, 4300, 2900, 4768}};  // cv ~0.2
  const Problem problems[] = {{"fc1 fwd [R,1024]x[5632,1024]^T", 1024, 5632, false},
                              {"fc2 fwd [R,2816]x[1024,2816]^T", 2816, 1024, false},
                              {"fc1 wgrad dW[5632,1024]", 1024, 5632, true}};
  Buffer x(Device::cuda, std::size_t(2) * R * 2816 * 2), w(Device::cuda, std::size_t(E) * 5632 * 2816 * 2),
      d(Device::cuda, std::size_t(R) * 5632 * 4 * 2), dw(Device::cuda, std::size_t(E) * 5632 * 1024 * 4);
  bench::fill_random_bf16(x);
  bench::fill_random_bf16(w);
  void** ptrs;
  KILN_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptrs), 3 * 64 * sizeof(void*)));
  const float one = 1.0f, zero = 0.0f;
  std::printf("%-34s %-10s %10s %10s %10s\n", "gemm", "split", "grouped", "per-expert", "padded");
  for (const auto& p : problems)
    for (std::size_t si = 0; si < splits.size(); ++si) {
      const auto& rows = splits[si];
      std::vector<int> off(E + 1, 0);
      int most = 0;
      for (int e = 0; e < E; ++e) off[e + 1] = off[e] + rows[e], most = std::max(most, rows[e]);
      const double flops = 2.0 * R * p.K * p.N;
      auto* X = static_cast<char*>(x.data());
      auto* W = static_cast<char*>(w.data());
      auto* D = static_cast<char*>(d.data());
      auto* DW = static_cast<char*>(dw.data());
      // One cublasGemmEx per expert.
      auto per_expert = [&] {
        for (int e = 0; e < E; ++e) {
          if (!p.wgrad)
            KILN_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, p.N, rows[e], p.K, &one,
                                           W + std::size_t(e) * p.N * p.K * 2, CUDA_R_16BF, p.K,
                                           X + std::size_t(off[e]) * p.K * 2, CUDA_R_16BF, p.K, &zero,
                                           D + std::size_t(off[e]) * p.N * 2, CUDA_R_16BF, p.N, CUBLAS_COMPUTE_32F,
                                           CUBLAS_GEMM_DEFAULT));
          else
            KILN_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, p.K, p.N, rows[e], &one,
                                           X + std::size_t(off[e]) * p.K * 2, CUDA_R_16BF, p.K,
                                           D + std::size_t(off[e]) * p.N * 2, CUDA_R_16BF, p.N, &one,
                                           DW + std::size_t(e) * p.N * p.K * 4, CUDA_R_32F, p.K, CUBLAS_COMPUTE_32F,
                                           CUBLAS_GEMM_DEFAULT));
        }
      };
      // The grouped call (data GEMMs only: it cannot write f32).
      std::vector<cublasOperation_t> ta(E, CUBLAS_OP_T), tb(E, CUBLAS_OP_N);
      std::vector<int> m(E, p.N), n(rows), k(E, p.K), lda(E, p.K), ldb(E, p.K), ldc(E, p.N), gs(E, 1);
      std::vector<float> al(E, 1.0f), be(E, 0.0f);
      std::vector<void*> host(3 * 64);
      for (int e = 0; e < E; ++e) {
        host[e] = W + std::size_t(e) * p.N * p.K * 2;
        host[64 + e] = X + std::size_t(off[e]) * p.K * 2;
        host[128 + e] = D + std::size_t(off[e]) * p.N * 2;
      }
      KILN_CUDA_CHECK(cudaMemcpy(ptrs, host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice));
      auto grouped = [&] {
        KILN_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
            h, ta.data(), tb.data(), m.data(), n.data(), k.data(), al.data(), const_cast<const void**>(ptrs), CUDA_R_16BF,
            lda.data(), const_cast<const void**>(ptrs + 64), CUDA_R_16BF, ldb.data(), be.data(), ptrs + 128, CUDA_R_16BF,
            ldc.data(), E, gs.data(), CUBLAS_COMPUTE_32F));
      };
      // One strided batched GEMM over rows padded to the largest expert's (16-row multiples).
      const int pad = (most + 15) / 16 * 16;
      auto padded = [&] {
        if (!p.wgrad)
          KILN_CUBLAS_CHECK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, p.N, pad, p.K, &one, W, CUDA_R_16BF,
                                                       p.K, std::int64_t(p.N) * p.K, X, CUDA_R_16BF, p.K,
                                                       std::int64_t(pad) * p.K, &zero, D, CUDA_R_16BF, p.N,
                                                       std::int64_t(pad) * p.N, E, CUBLAS_COMPUTE_32F,
                                                       CUBLAS_GEMM_DEFAULT));
        else
          KILN_CUBLAS_CHECK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_T, p.K, p.N, pad, &one, X, CUDA_R_16BF,
                                                       p.K, std::int64_t(pad) * p.K, D, CUDA_R_16BF, p.N,
                                                       std::int64_t(pad) * p.N, &one, DW, CUDA_R_32F, p.K,
                                                       std::int64_t(p.N) * p.K, E, CUBLAS_COMPUTE_32F,
                                                       CUBLAS_GEMM_DEFAULT));
      };
      const double tg = p.wgrad ? 0 : timer.median_ms(grouped);
      const double te = timer.median_ms(per_expert);
      const double tp = timer.median_ms(padded);
      auto tf = [&](double ms) { return ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0; };
      std::printf("%-34s %-10s %9.0fT %9.0fT %9.0fT   (ms %.3f %.3f %.3f; pad %d of mean %d)\n", p.name,
                  si == 0 ? "balanced" : "cv 0.2", tf(tg), tf(te), tf(tp), tg, te, tp, pad, R / E);
    }
  cudaFree(ptrs);
  cublasDestroy(h);
  return 0;
}
