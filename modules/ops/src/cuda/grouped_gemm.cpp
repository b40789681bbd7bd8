// GroupedGemm: the experts' linears on cuBLAS's column-major API (see grouped_gemm.hpp).
//
// A row-major [r, c] matrix is, byte for byte, a column-major [c, r] one (gemm.cpp). For expert e
// with M rows:
//   D[M, N] = X[M, K] @ op(W_e)  is the column-major  D^T[N, M] = op(W_e)^T X^T:
//     cuBLAS's A = W_e: stored [N, K] row-major (w_nk) = column-major [K, N], ld K, transposed (T);
//                       stored [K, N] row-major = column-major [N, K], ld N, as is (N);
//     cuBLAS's B = X rows: column-major [K, M], ld K, as is; C = D rows: column-major [N, M], ld N.
//   dW_e[P, Q] = A[M, P]^T @ B[M, Q]  is the column-major  dW^T[Q, P] = B^T A:
//     cuBLAS's A = B rows: column-major [Q, M], ld Q, as is; cuBLAS's B = A rows: column-major
//     [P, M], ld P, transposed; C = dW_e: column-major [Q, P], ld Q.
//
// The grouped call is asynchronous and reads its host arrays (sizes, leading dimensions, alpha,
// beta) before it returns, so they are reused at once: seen on an H200 with cuBLAS 13.0 (the call
// returned in 0.02 ms behind a 1 s kernel, and arrays overwritten right after it left the result
// unchanged). Its device pointer arrays are read when it runs: stream order protects them.
#include "grouped_gemm.hpp"

#include <iostream>

#include "kiln/tensor/alignment.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {

GroupedGemm::GroupedGemm(cudaStream_t stream, cublasLtHandle_t lt, void* workspace, std::size_t workspace_bytes,
                         bool grouped_call)
    : stream_(stream),
      lt_(lt),
      workspace_(workspace),
      workspace_bytes_(workspace_bytes),
      grouped_unsupported_(!grouped_call) {
  KILN_CUBLAS_CHECK(cublasCreate(&handle_));
  try {
    KILN_CUBLAS_CHECK(cublasSetStream(handle_, stream));
    // After cublasSetStream, which resets the workspace to cuBLAS's default pool.
    KILN_CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace, workspace_bytes));
    KILN_CUBLAS_CHECK(cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST));
    KILN_CUBLAS_CHECK(
        cublasSetMathMode(handle_, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                                             CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    pointers_ = Buffer(Device::cuda, 3 * static_cast<std::size_t>(kGroupedMaxGroups) * sizeof(void*));
  } catch (...) {
    cublasDestroy(handle_);
    throw;
  }
}

GroupedGemm::~GroupedGemm() {
  for (auto& [key, op] : lt_ops_) cublasLtMatmulDescDestroy(op);
  if (handle_) cublasDestroy(handle_);
}

namespace {
// Layouts made for one call and destroyed after it (cheap host objects).
struct Layout {
  cublasLtMatrixLayout_t l = nullptr;
  Layout(cudaDataType_t t, int rows, int cols, int ld) {
    KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, t, static_cast<std::uint64_t>(rows),
                                                 static_cast<std::uint64_t>(cols), ld));
  }
  ~Layout() { cublasLtMatrixLayoutDestroy(l); }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
};
int round128(int v) { return (v + 127) / 128 * 128; }
}  // namespace

const cublasLtMatmulAlgo_t& GroupedGemm::lt_algo(const LtCall& c, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                                                 cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t cl) {
  // The data GEMMs vary in n (rows), the weight gradients in k (rows): round the one that varies.
  const bool rows_in_k = c.c_f32;
  const int n = rows_in_k ? c.n : round128(c.n), k = rows_in_k ? round128(c.k) : c.k;
  const auto key = std::make_tuple(static_cast<int>(c.ta), static_cast<int>(c.tb), c.m, n, k, c.c_f32, c.beta != 0);
  auto heuristic = [&](cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc) {
    cublasLtMatmulPreference_t pref = nullptr;
    KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const auto bytes = static_cast<std::uint64_t>(workspace_bytes_);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof(bytes));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_, op, la, lb, lc, lc, pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    KILN_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS,
               "cuBLASLt has no algorithm for an expert GEMM [", c.m, ", ", c.n, ", ", c.k, "] (",
               cublasLtGetStatusName(st), ")");
    return result.algo;
  };
  auto it = lt_algos_.find(key);
  if (it == lt_algos_.end()) {
    // The heuristic's choice for the rounded shape (leading dimensions as the exact call's).
    const Layout ra(CUDA_R_16BF, c.ta == CUBLAS_OP_N ? c.m : k, c.ta == CUBLAS_OP_N ? k : c.m, c.lda);
    const Layout rb(CUDA_R_16BF, c.tb == CUBLAS_OP_N ? k : n, c.tb == CUBLAS_OP_N ? n : k, c.ldb);
    const Layout rc(c.c_f32 ? CUDA_R_32F : CUDA_R_16BF, c.m, n, c.ldc);
    it = lt_algos_.emplace(key, heuristic(ra.l, rb.l, rc.l)).first;
  }
  cublasLtMatmulHeuristicResult_t check{};
  if (cublasLtMatmulAlgoCheck(lt_, op, a, b, cl, cl, &it->second, &check) == CUBLAS_STATUS_SUCCESS &&
      check.workspaceSize <= workspace_bytes_)
    return it->second;
  // The rounded shape's algorithm does not take this one: the exact shape's, cached under it.
  const auto exact = std::make_tuple(static_cast<int>(c.ta), static_cast<int>(c.tb), c.m, c.n, c.k, c.c_f32,
                                     c.beta != 0);
  auto e = lt_algos_.find(exact);
  if (e == lt_algos_.end()) e = lt_algos_.emplace(exact, heuristic(a, b, cl)).first;
  return e->second;
}

void GroupedGemm::lt_gemm(const LtCall& c) {
  const auto key = std::make_tuple(static_cast<int>(c.ta), static_cast<int>(c.tb), c.c_f32);
  auto it = lt_ops_.find(key);
  if (it == lt_ops_.end()) {
    cublasLtMatmulDesc_t op = nullptr;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &c.ta, sizeof(c.ta));
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &c.tb, sizeof(c.tb));
    it = lt_ops_.emplace(key, op).first;
  }
  const Layout a(CUDA_R_16BF, c.ta == CUBLAS_OP_N ? c.m : c.k, c.ta == CUBLAS_OP_N ? c.k : c.m, c.lda);
  const Layout b(CUDA_R_16BF, c.tb == CUBLAS_OP_N ? c.k : c.n, c.tb == CUBLAS_OP_N ? c.n : c.k, c.ldb);
  const Layout cl(c.c_f32 ? CUDA_R_32F : CUDA_R_16BF, c.m, c.n, c.ldc);
  const cublasLtMatmulAlgo_t& algo = lt_algo(c, it->second, a.l, b.l, cl.l);
  const float alpha = 1.0f;
  KILN_CUBLAS_CHECK(cublasLtMatmul(lt_, it->second, &alpha, c.a, a.l, c.b, b.l, &c.beta, c.c, cl.l, c.c, cl.l, &algo,
                                   workspace_, workspace_bytes_, stream_));
}

bool GroupedGemm::one_call(const bf16* D, const bf16* X, const bf16* W, int E, int K, int N) const {
  return !grouped_unsupported_ && E <= kGroupedMaxGroups && K % 8 == 0 && N % 8 == 0 && aligned16(D) &&
         aligned16(X) && aligned16(W);
}

void GroupedGemm::per_expert(bf16* D, const bf16* X, const bf16* W, const std::int32_t* off, int E, int K, int N,
                             bool w_nk) {
  for (int e = 0; e < E; ++e) {
    const int rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    lt_gemm({.ta = w_nk ? CUBLAS_OP_T : CUBLAS_OP_N,
             .tb = CUBLAS_OP_N,
             .m = N,
             .n = rows,
             .k = K,
             .a = W + static_cast<std::int64_t>(e) * N * K,
             .lda = w_nk ? K : N,
             .b = X + static_cast<std::int64_t>(off[e]) * K,
             .ldb = K,
             .c = D + static_cast<std::int64_t>(off[e]) * N,
             .ldc = N});
  }
}

void GroupedGemm::rows_times_weight(bf16* D, const bf16* X, const bf16* W, const std::int32_t* off, int E, int K,
                                    int N, bool w_nk) {
  if (!one_call(D, X, W, E, K, N)) {
    per_expert(D, X, W, off, E, K, N, w_nk);
    return;
  }
  const auto n = static_cast<std::size_t>(E);
  transa_.assign(n, w_nk ? CUBLAS_OP_T : CUBLAS_OP_N);
  transb_.assign(n, CUBLAS_OP_N);
  m_.assign(n, N);
  k_.assign(n, K);
  lda_.assign(n, w_nk ? K : N);
  ldb_.assign(n, K);
  ldc_.assign(n, N);
  size_.assign(n, 1);
  alpha_.assign(n, 1.0f);
  beta_.assign(n, 0.0f);
  n_.resize(n);
  int groups = 0;
  for (int e = 0; e < E; ++e) {
    const int rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    table_.expert[groups] = e;
    table_.row0[groups] = off[e];
    n_[static_cast<std::size_t>(groups)] = rows;
    ++groups;
  }
  if (groups == 0) return;
  table_.a0 = reinterpret_cast<const char*>(W);
  table_.a_stride = static_cast<std::int64_t>(N) * K * static_cast<std::int64_t>(sizeof(bf16));
  table_.b0 = reinterpret_cast<const char*>(X);
  table_.b_stride = static_cast<std::int64_t>(K) * static_cast<std::int64_t>(sizeof(bf16));
  table_.c0 = reinterpret_cast<char*>(D);
  table_.c_stride = static_cast<std::int64_t>(N) * static_cast<std::int64_t>(sizeof(bf16));
  table_.groups = groups;
  auto** base = static_cast<void**>(pointers_.data());
  const void** a = const_cast<const void**>(base);
  const void** b = const_cast<const void**>(base + kGroupedMaxGroups);
  void** c = base + 2 * kGroupedMaxGroups;
  // Stream-ordered: the GEMM of an earlier call has read its pointers before these are written.
  grouped_gemm_pointers(a, b, c, table_, stream_);
  const cublasStatus_t st = cublasGemmGroupedBatchedEx(
      handle_, transa_.data(), transb_.data(), m_.data(), n_.data(), k_.data(), alpha_.data(), a, CUDA_R_16BF,
      lda_.data(), b, CUDA_R_16BF, ldb_.data(), beta_.data(), c, CUDA_R_16BF, ldc_.data(), groups, size_.data(),
      CUBLAS_COMPUTE_32F);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) {
    std::cerr << "[kiln] cuBLAS's grouped GEMM is not supported here (" << cublasGetStatusString(st)
              << "): the experts' linears run one GEMM per expert\n";
    grouped_unsupported_ = true;
    per_expert(D, X, W, off, E, K, N, w_nk);
    return;
  }
  KILN_CUBLAS_CHECK(st);
}

void GroupedGemm::weight_grad(float* dW, const bf16* A, const bf16* B, const std::int32_t* off, int E, int P, int Q,
                              bool overwrite) {
  const std::int64_t per = static_cast<std::int64_t>(P) * Q;
  for (int e = 0; e < E; ++e) {
    const int rows = off[e + 1] - off[e];
    float* dWe = dW + e * per;
    if (rows == 0) {
      if (overwrite) KILN_CUDA_CHECK(cudaMemsetAsync(dWe, 0, static_cast<std::size_t>(per) * sizeof(float), stream_));
      continue;
    }
    lt_gemm({.ta = CUBLAS_OP_N,
             .tb = CUBLAS_OP_T,
             .m = Q,
             .n = P,
             .k = rows,
             .a = B + static_cast<std::int64_t>(off[e]) * Q,
             .lda = Q,
             .b = A + static_cast<std::int64_t>(off[e]) * P,
             .ldb = P,
             .c = dWe,
             .ldc = Q,
             .c_f32 = true,
             .beta = overwrite ? 0.0f : 1.0f});
  }
}

}  // namespace kiln::cuda
