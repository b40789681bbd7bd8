// What cuBLASLt's heuristic leaves on the table for the experts' GEMMs: for each product of
// pipelines/moe-1b.toml's experts (8 experts of 4096 rows, FC1 1024 -> 5632, FC2 2816 -> 1024; the
// forward, data-gradient and weight-gradient products with kiln's operand types and layouts, FP8
// as fp8::cuda::Fp8GemmRunner runs them and bf16 as ops' GroupedGemm does), the heuristic's
// candidates in its order, each timed alone and as kiln runs the experts (eight products on four
// streams), and whether its result has the same bits as the first's. Prints one line per
// candidate, then kiln's choice on an imbalanced split against the fastest same-bits candidate.
// With CHECK_ROWS set: for each product, how many row counts (3584..4608) the algorithm chosen for
// their bucket (kiln::cuda::LtRaggedAlgos) does not take (cublasLtMatmulAlgoCheck).
// "ms": the memsets cuBLASLt queues with one call of the candidate (a call captured into a graph, its
// memset nodes counted); each is a step of its own on the stream, between the GEMM and the work before
// it. After the candidates, the heuristic's first when no workspace is offered, the same columns.
//   bench_lt_algos [candidates] [iters]
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <random>
#include <vector>

#include "bench_timer.hpp"
#include "kiln/ops/cuda/cublaslt.hpp"
#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/cuda_check.hpp"

using namespace kiln;

namespace {

// One product in cuBLASLt's column-major terms: C[m, n] = op(A)[m, k] op(B)[k, n].
struct Product {
  const char* name;
  int m, n, k;
  cublasOperation_t ta, tb;
  int lda, ldb, ldc;
  cudaDataType_t a, b, c;
  bool fp8, fast_accum;
  bool rows_are_k;  // the experts' rows are k (a weight gradient), else n
  std::size_t a_elems() const { return std::size_t(m) * k; }
  std::size_t b_elems() const { return std::size_t(k) * n; }
};

// kiln's FP8 product D[M, N] = X[M, K] @ Y[N, K]^T (Fp8GemmRunner: A = Y, B = X, both K-major).
Product fp8(const char* name, int M, int N, int K, cudaDataType_t x, cudaDataType_t y, cudaDataType_t d, bool fast,
            bool wgrad) {
  return {name, N, M, K, CUBLAS_OP_T, CUBLAS_OP_N, K, K, N, y, x, d, true, fast, wgrad};
}

// FP8 codes of modest values (the top exponent bit cleared: no Inf or NaN in either format).
void fill_codes(Buffer& b, unsigned seed) {
  std::vector<std::uint8_t> h(b.bytes());
  std::mt19937 gen(seed);
  for (auto& v : h) v = static_cast<std::uint8_t>(gen() & 0xBF);
  KILN_CUDA_CHECK(cudaMemcpy(b.data(), h.data(), h.size(), cudaMemcpyHostToDevice));
}

template <class T>
T algo_attr(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T v{};
  std::size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &v, sizeof(v), &written);
  return v;
}

}  // namespace

// The memset nodes of one call captured from stream s.
int memsets_in(cudaStream_t s, const std::function<void()>& call) {
  cudaGraph_t g = nullptr;
  KILN_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  call();
  KILN_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  std::size_t n = 0;
  KILN_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  KILN_CUDA_CHECK(cudaGraphGetNodes(g, nodes.data(), &n));
  int memsets = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType t{};
    KILN_CUDA_CHECK(cudaGraphNodeGetType(node, &t));
    memsets += t == cudaGraphNodeTypeMemset;
  }
  KILN_CUDA_CHECK(cudaGraphDestroy(g));
  return memsets;
}

int main(int argc, char** argv) {
  const int want = argc > 1 ? std::atoi(argv[1]) : 16, iters = argc > 2 ? std::atoi(argv[2]) : 20;
  constexpr int E = 8, kLanes = 4;
  const std::size_t kWorkspace = 32u << 20;
  const auto e4 = CUDA_R_8F_E4M3, e5 = CUDA_R_8F_E5M2;
  const auto b16 = CUDA_R_16BF, f32 = CUDA_R_32F;
  const auto T = CUBLAS_OP_T, N = CUBLAS_OP_N;
  // bf16 as GroupedGemm lays them out (FC1 stored [E, 5632, 1024], FC2 [E, 2816, 1024] in-out).
  const Product products[] = {
      fp8("fp8 fc1 fwd", 4096, 5632, 1024, e4, e4, b16, true, false),
      fp8("fp8 fc2 fwd", 4096, 1024, 2816, e4, e4, b16, true, false),
      fp8("fp8 fc1 dgrad", 4096, 1024, 5632, e5, e4, b16, false, false),
      fp8("fp8 fc2 dgrad", 4096, 2816, 1024, e5, e4, b16, false, false),
      fp8("fp8 fc1 wgrad", 5632, 1024, 4096, e5, e4, f32, false, true),
      fp8("fp8 fc2 wgrad", 1024, 2816, 4096, e5, e4, f32, false, true),
      // moe-1b's attention linears (dense, 16384 rows): QKV and the output projection
      fp8("fp8 qkv fwd", 16384, 1536, 1024, e4, e4, b16, true, false),
      fp8("fp8 o fwd", 16384, 1024, 1024, e4, e4, b16, true, false),
      fp8("fp8 qkv dgrad", 16384, 1024, 1536, e5, e4, b16, false, false),
      fp8("fp8 qkv wgrad", 1536, 1024, 16384, e5, e4, f32, false, true),
      {"bf16 fc1 fwd", 5632, 4096, 1024, T, N, 1024, 1024, 5632, b16, b16, b16, false, false, false},
      {"bf16 fc2 fwd", 1024, 4096, 2816, N, N, 1024, 2816, 1024, b16, b16, b16, false, false, false},
      {"bf16 fc1 dgrad", 1024, 4096, 5632, N, N, 1024, 5632, 1024, b16, b16, b16, false, false, false},
      {"bf16 fc2 dgrad", 2816, 4096, 1024, T, N, 1024, 1024, 2816, b16, b16, b16, false, false, false},
      {"bf16 fc1 wgrad", 1024, 5632, 4096, N, T, 1024, 5632, 1024, b16, b16, f32, false, false, true},
      {"bf16 fc2 wgrad", 1024, 2816, 4096, N, T, 1024, 2816, 1024, b16, b16, f32, false, false, true},
  };
  cublasLtHandle_t h;
  KILN_CUBLAS_CHECK(cublasLtCreate(&h));
  cudaStream_t main_stream, lanes[kLanes];
  KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking));
  for (auto& s : lanes) KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t fork, joined[kLanes];
  KILN_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  for (auto& e : joined) KILN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  std::vector<Buffer> workspaces;
  for (int i = 0; i < kLanes; ++i) workspaces.emplace_back(Device::cuda, kWorkspace);
  Buffer one(Device::cuda, 256);
  const float onef = 1.0f;
  KILN_CUDA_CHECK(cudaMemcpy(one.data(), &onef, 4, cudaMemcpyHostToDevice));
  Buffer x(Device::cuda, std::size_t(E) * 5632 * 4224 * 2), y(Device::cuda, std::size_t(E) * 5632 * 4224 * 2),
      d(Device::cuda, std::size_t(E) * 5632 * 4224 * 4);
  fill_codes(x, 1);  // as bf16 these are modest values too (the high byte's top exponent bit clear)
  fill_codes(y, 2);
  bench::EventTimer timer(main_stream, false, 3, iters);
  std::printf("%-12s %3s %5s %5s %6s %6s %6s %7s %7s %8s %3s %9s %9s %s\n", "product", "#", "algo", "tile", "stages",
              "splitK", "reduce", "swizzle", "cluster", "ws(KiB)", "ms", "alone", "8 on 4", "against #0");
  for (const Product& p : products) {
    cublasLtMatmulDesc_t op;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cuda::set_attr(op, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<std::int32_t>(p.ta));
    cuda::set_attr(op, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<std::int32_t>(p.tb));
    if (p.fp8) {
      cuda::set_attr(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<std::int8_t>(p.fast_accum ? 1 : 0));
      cuda::set_attr(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(one.data()));
      cuda::set_attr(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(one.data()));
    }
    struct Made {
      cuda::LtLayout a, b, c;
    };
    // A product's layouts at (m, n, k), leading dimensions tight where they follow a changed size.
    auto make_ld = [&](int m, int n, int k, int lda, int ldb, int ldc) {
      return Made{{p.a, p.ta == CUBLAS_OP_N ? m : k, p.ta == CUBLAS_OP_N ? k : m, lda},
                  {p.b, p.tb == CUBLAS_OP_N ? k : n, p.tb == CUBLAS_OP_N ? n : k, ldb},
                  {p.c, m, n, ldc}};
    };
    auto make = [&](int m, int n, int k) {
      return make_ld(m, n, k, p.ta == CUBLAS_OP_N ? m : k, p.tb == CUBLAS_OP_N ? k : n, m);
    };
    const Made full = make_ld(p.m, p.n, p.k, p.lda, p.ldb, p.ldc);
    const cuda::LtLayout &a = full.a, &b = full.b, &c = full.c;
    if (std::getenv("CHECK_ROWS")) {  // which row counts the rounded shape's algorithm refuses
      int refused = 0, first = -1, counts = 0;
      for (int rows = 3584; rows <= 4608; rows += p.fp8 && p.rows_are_k ? 16 : 1, ++counts) {
        const int r128 = cuda::LtRaggedAlgos::bucket(rows);
        const Made r = p.rows_are_k ? make(p.m, p.n, r128) : make(p.m, r128, p.k);
        const Made x = p.fp8 && p.rows_are_k ? make(p.m, p.n, rows)
                       : p.rows_are_k        ? make_ld(p.m, p.n, rows, p.lda, p.ldb, p.ldc)
                                             : make_ld(p.m, rows, p.k, p.lda, p.ldb, p.ldc);
        const auto algo = cuda::lt_first_algo(h, op, r.a.l, r.b.l, r.c.l, kWorkspace);
        cublasLtMatmulHeuristicResult_t check{};
        if (!algo || cublasLtMatmulAlgoCheck(h, op, x.a.l, x.b.l, x.c.l, x.c.l, &*algo, &check) != CUBLAS_STATUS_SUCCESS) {
          ++refused;
          if (first < 0) first = rows;
        }
      }
      std::printf("%-14s the rounded shape's algorithm refused for %d of %d row counts (first %d)\n", p.name, refused,
                  counts, first);
      cublasLtMatmulDescDestroy(op);
      continue;
    }
    cuda::LtPreference pref;
    pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(kWorkspace));
    std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<std::size_t>(want));
    int found = 0;
    KILN_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(h, op, a.l, b.l, c.l, c.l, pref.p, want, results.data(), &found));
    const double flop = 2.0 * p.m * p.n * p.k;
    const std::size_t esz = p.fp8 ? 1 : 2, ys = p.a_elems() * esz, xs = p.b_elems() * esz,
                      ds = std::size_t(p.m) * p.n * (p.c == CUDA_R_32F ? 4 : 2);
    const float alpha = 1.0f, beta = 0.0f;
    auto gemm = [&](const cublasLtMatmulAlgo_t& algo, int e, cudaStream_t s, void* ws) {
      const cublasStatus_t st = cublasLtMatmul(h, op, &alpha, static_cast<char*>(y.data()) + e * ys, a.l,
                                               static_cast<char*>(x.data()) + e * xs, b.l, &beta,
                                               static_cast<char*>(d.data()) + e * ds, c.l,
                                               static_cast<char*>(d.data()) + e * ds, c.l, &algo, ws,
                                               ws ? kWorkspace : 0, s);
      KILN_CHECK(st == CUBLAS_STATUS_SUCCESS, p.name, ": ", cublasLtGetStatusName(st));
    };
    std::vector<std::uint8_t> first(ds), out(ds);
    int best = 0;
    double best_tflops = 0;
    for (int i = 0; i < found; ++i) {
      const cublasLtMatmulAlgo_t& algo = results[static_cast<std::size_t>(i)].algo;
      if (results[static_cast<std::size_t>(i)].state != CUBLAS_STATUS_SUCCESS) continue;
      gemm(algo, 0, main_stream, workspaces[0].data());
      KILN_CUDA_CHECK(cudaStreamSynchronize(main_stream));
      KILN_CUDA_CHECK(cudaMemcpy((i == 0 ? first : out).data(), d.data(), ds, cudaMemcpyDeviceToHost));
      const bool same = i == 0 || first == out;
      const double alone = timer.median_ms([&] { gemm(algo, 0, main_stream, workspaces[0].data()); });
      const double grouped = timer.median_ms([&] {
        KILN_CUDA_CHECK(cudaEventRecord(fork, main_stream));
        for (int l = 0; l < kLanes; ++l) KILN_CUDA_CHECK(cudaStreamWaitEvent(lanes[l], fork));
        for (int e = 0; e < E; ++e) gemm(algo, e, lanes[e % kLanes], workspaces[static_cast<std::size_t>(e % kLanes)].data());
        for (int l = 0; l < kLanes; ++l) {
          KILN_CUDA_CHECK(cudaEventRecord(joined[l], lanes[l]));
          KILN_CUDA_CHECK(cudaStreamWaitEvent(main_stream, joined[l]));
        }
      });
      if (E * flop / grouped * 1e-9 > best_tflops && same) best = i, best_tflops = E * flop / grouped * 1e-9;
      const int memsets = memsets_in(main_stream, [&] { gemm(algo, 0, main_stream, workspaces[0].data()); });
      std::printf("%-12s %3d %5d %5d %6d %6d %6d %7d %7d %8zu %3d %9.0f %9.0f %s\n", p.name, i,
                  algo_attr<int>(algo, CUBLASLT_ALGO_CONFIG_ID), algo_attr<int>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
                  algo_attr<int>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                  algo_attr<int>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                  algo_attr<int>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                  algo_attr<int>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                  algo_attr<int>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
                  results[static_cast<std::size_t>(i)].workspaceSize / 1024, memsets, flop / alone * 1e-9,
                  E * flop / grouped * 1e-9, same ? "same bits" : "DIFFERENT bits");
    }
    {  // no workspace offered: the heuristic's first, its memsets, speed and bits
      cuda::LtPreference none;
      none.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, std::uint64_t{0});
      cublasLtMatmulHeuristicResult_t r0{};
      int got = 0;
      if (cublasLtMatmulAlgoGetHeuristic(h, op, a.l, b.l, c.l, c.l, none.p, 1, &r0, &got) == CUBLAS_STATUS_SUCCESS &&
          got > 0 && r0.state == CUBLAS_STATUS_SUCCESS) {
        gemm(r0.algo, 0, main_stream, nullptr);
        KILN_CUDA_CHECK(cudaStreamSynchronize(main_stream));
        KILN_CUDA_CHECK(cudaMemcpy(out.data(), d.data(), ds, cudaMemcpyDeviceToHost));
        const double alone = timer.median_ms([&] { gemm(r0.algo, 0, main_stream, nullptr); });
        const int memsets = memsets_in(main_stream, [&] { gemm(r0.algo, 0, main_stream, nullptr); });
        std::printf("%-12s  no workspace: algo %d tile %d splitK %d, %d memsets, %.0f TFLOP/s alone, %s\n", p.name,
                    algo_attr<int>(r0.algo, CUBLASLT_ALGO_CONFIG_ID), algo_attr<int>(r0.algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
                    algo_attr<int>(r0.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), memsets, flop / alone * 1e-9,
                    first == out ? "same bits as #0" : "DIFFERENT bits from #0");
      } else {
        std::printf("%-12s  no workspace: no algorithm\n", p.name);
      }
    }
    // An imbalanced split (load coefficient of variation ~0.04, as moe-1b's) of the 4096-row
    // dimension: kiln's choice (LtRaggedAlgos: the heuristic's first for the shape rounded to 128,
    // checked against the exact one) against the fastest same-bits candidate for 4096 rows.
    if (p.fp8 && p.rows_are_k) {  // FP8 weight gradients: the candidates above only
      cublasLtMatmulDescDestroy(op);
      continue;
    }
    const int split[E] = {4016, 4176, 4096, 3952, 4224, 4016, 4144, 4128};  // multiples of 16 (FP8's K)
    struct Shape3 {
      int m, n, k;
    };
    auto shape_of = [&](int rows) { return p.rows_are_k ? Shape3{p.m, p.n, rows} : Shape3{p.m, rows, p.k}; };
    cuda::LtRaggedAlgos ragged;
    double flop_split = 0;
    for (int r : split) flop_split += p.rows_are_k ? 2.0 * p.m * p.n * r : 2.0 * r * p.m * p.k;
    auto run_split = [&](bool kiln_choice, double* host_us) {
      auto t0 = std::chrono::steady_clock::now();
      KILN_CUDA_CHECK(cudaEventRecord(fork, main_stream));
      for (int l = 0; l < kLanes; ++l) KILN_CUDA_CHECK(cudaStreamWaitEvent(lanes[l], fork));
      for (int e = 0; e < E; ++e) {
        const Shape3 sh = shape_of(split[e]);
        const Made exact = make_ld(sh.m, sh.n, sh.k, p.lda, p.ldb, p.ldc);
        const cublasLtMatmulAlgo_t* algo = &results[static_cast<std::size_t>(best)].algo;
        if (kiln_choice) {
          const char* why = "";
          algo = ragged.find(h, op, 0, sh.m, sh.n, sh.k, p.rows_are_k ? cuda::LtRagged::k : cuda::LtRagged::n, make,
                             exact, kWorkspace, &why);
          KILN_CHECK(algo, p.name, ": ", why);
        }
        const float alpha = 1.0f, beta = 0.0f;
        const cublasStatus_t st = cublasLtMatmul(h, op, &alpha, y.data(), exact.a.l, x.data(), exact.b.l, &beta,
                                                 static_cast<char*>(d.data()) + e * ds, exact.c.l,
                                                 static_cast<char*>(d.data()) + e * ds, exact.c.l, algo,
                                                 workspaces[static_cast<std::size_t>(e % kLanes)].data(), kWorkspace,
                                                 lanes[e % kLanes]);
        KILN_CHECK(st == CUBLAS_STATUS_SUCCESS, p.name, " split: ", cublasLtGetStatusName(st));
      }
      for (int l = 0; l < kLanes; ++l) {
        KILN_CUDA_CHECK(cudaEventRecord(joined[l], lanes[l]));
        KILN_CUDA_CHECK(cudaStreamWaitEvent(main_stream, joined[l]));
      }
      if (host_us)
        *host_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / E;
    };
    double host_us = 0;
    run_split(true, nullptr);  // fills the cache
    KILN_CUDA_CHECK(cudaStreamSynchronize(main_stream));
    run_split(true, &host_us);
    const double kiln_ms = timer.median_ms([&] { run_split(true, nullptr); });
    const double best_ms = timer.median_ms([&] { run_split(false, nullptr); });
    std::printf("%-12s split cv 0.04, 8 on 4: kiln's choice %.0f TFLOP/s, candidate #%d %.0f TFLOP/s; host %.1f us a product\n",
                p.name, flop_split / kiln_ms * 1e-9, best, flop_split / best_ms * 1e-9, host_us);
    cublasLtMatmulDescDestroy(op);
  }
  return 0;
}
