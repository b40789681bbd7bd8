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

GroupedGemm::GroupedGemm(cudaStream_t stream, void* workspace, std::size_t workspace_bytes) : stream_(stream) {
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
  if (handle_) cublasDestroy(handle_);
}

bool GroupedGemm::one_call(const bf16* D, const bf16* X, const bf16* W, int E, int K, int N) const {
  return !grouped_unsupported_ && E <= kGroupedMaxGroups && K % 8 == 0 && N % 8 == 0 && aligned16(D) &&
         aligned16(X) && aligned16(W);
}

void GroupedGemm::per_expert(bf16* D, const bf16* X, const bf16* W, const std::int32_t* off, int E, int K, int N,
                             bool w_nk) {
  const float alpha = 1.0f, beta = 0.0f;
  for (int e = 0; e < E; ++e) {
    const int rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    KILN_CUBLAS_CHECK(cublasGemmEx(handle_, w_nk ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, N, rows, K, &alpha,
                                   W + static_cast<std::int64_t>(e) * N * K, CUDA_R_16BF, w_nk ? K : N,
                                   X + static_cast<std::int64_t>(off[e]) * K, CUDA_R_16BF, K, &beta,
                                   D + static_cast<std::int64_t>(off[e]) * N, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
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
  const float alpha = 1.0f, beta = overwrite ? 0.0f : 1.0f;
  const std::int64_t per = static_cast<std::int64_t>(P) * Q;
  for (int e = 0; e < E; ++e) {
    const int rows = off[e + 1] - off[e];
    float* dWe = dW + e * per;
    if (rows == 0) {
      if (overwrite) KILN_CUDA_CHECK(cudaMemsetAsync(dWe, 0, static_cast<std::size_t>(per) * sizeof(float), stream_));
      continue;
    }
    KILN_CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_T, Q, P, rows, &alpha,
                                   B + static_cast<std::int64_t>(off[e]) * Q, CUDA_R_16BF, Q,
                                   A + static_cast<std::int64_t>(off[e]) * P, CUDA_R_16BF, P, &beta, dWe, CUDA_R_32F,
                                   Q, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
}

}  // namespace kiln::cuda
