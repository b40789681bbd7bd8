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

#include "kiln/ops/moe.hpp"

#include <iostream>

#include "kiln/tensor/alignment.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {

GroupedGemm::GroupedGemm(cudaStream_t stream, cublasLtHandle_t lt, void* workspace, std::size_t workspace_bytes,
                         bool grouped_call, bool tune)
    : stream_(stream),
      lt_(lt),
      lanes_(stream, workspace, workspace_bytes),
      grouped_unsupported_(!grouped_call),
      tune_(tune) {
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

int GroupedGemm::busy(const std::int32_t* off, int E) {
  int n = 0;
  for (int e = 0; e < E; ++e) n += off[e + 1] > off[e] ? 1 : 0;
  return n;
}

void GroupedGemm::lt_gemm(const LtCall& c, int lane) {
  const auto key = std::make_tuple(static_cast<int>(c.ta), static_cast<int>(c.tb), c.c_f32);
  auto it = lt_ops_.find(key);
  if (it == lt_ops_.end()) {
    cublasLtMatmulDesc_t op = nullptr;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &c.ta, sizeof(c.ta));
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &c.tb, sizeof(c.tb));
    it = lt_ops_.emplace(key, op).first;
  }
  // The layouts of a shape; the rounded shapes' with the exact call's leading dimensions where they
  // are fixed, tight ones where they follow the rounded dimension.
  struct Layouts {
    LtLayout a, b, c;
  };
  auto layouts = [&](int m, int n, int k, int lda, int ldb, int ldc) {
    return Layouts{LtLayout(CUDA_R_16BF, c.ta == CUBLAS_OP_N ? m : k, c.ta == CUBLAS_OP_N ? k : m, lda),
                   LtLayout(CUDA_R_16BF, c.tb == CUBLAS_OP_N ? k : n, c.tb == CUBLAS_OP_N ? n : k, ldb),
                   LtLayout(c.c_f32 ? CUDA_R_32F : CUDA_R_16BF, m, n, ldc)};
  };
  const Layouts exact = layouts(c.m, c.n, c.k, c.lda, c.ldb, c.ldc);
  auto rounded = [&](int m, int n, int k) {
    return layouts(m, n, k, c.ta == CUBLAS_OP_N ? m : k, c.tb == CUBLAS_OP_N ? k : n, m);
  };
  const std::int64_t kind = (static_cast<std::int64_t>(c.ta) << 8) | (static_cast<std::int64_t>(c.tb) << 4) |
                            (c.c_f32 ? 2 : 0) | (c.beta != 0 ? 1 : 0);
  const char* why = "";
  LtRaggedAlgos::Tuner tuner;
  if (tune_ && c.beta == 0)
    tuner = [&](std::span<const cublasLtMatmulAlgo_t> algos) {
      const std::size_t d_bytes = static_cast<std::size_t>(c.ldc) * static_cast<std::size_t>(c.n) * (c.c_f32 ? 4 : 2);
      return lt_fastest_same_bits({lt_, it->second, c.a, c.b, exact.a.l, exact.b.l, exact.c.l, d_bytes,
                                   lanes_.workspace(lane), lanes_.workspace_bytes(), lanes_.stream(lane)},
                                  algos);
    };
  const cublasLtMatmulAlgo_t* algo =
      lt_algos_.find(lt_, it->second, kind, c.m, c.n, c.k, c.c_f32 ? LtRagged::k : LtRagged::n, rounded, exact,
                     lanes_.workspace_bytes(), &why, tuner);
  KILN_CHECK(algo, "cuBLASLt has no algorithm for an expert GEMM [", c.m, ", ", c.n, ", ", c.k, "] (", why, ")");
  const float alpha = 1.0f;
  KILN_CUBLAS_CHECK(cublasLtMatmul(lt_, it->second, &alpha, c.a, exact.a.l, c.b, exact.b.l, &c.beta, c.c, exact.c.l,
                                   c.c, exact.c.l, algo, lanes_.workspace(lane), lanes_.workspace_bytes(),
                                   lanes_.stream(lane)));
}

bool GroupedGemm::one_call(const bf16* D, const bf16* X, const bf16* W, int E, int K, int N) const {
  return !grouped_unsupported_ && E <= kGroupedMaxGroups && K % 8 == 0 && N % 8 == 0 && aligned16(D) &&
         aligned16(X) && aligned16(W);
}

void GroupedGemm::per_expert(bf16* D, const bf16* X, const bf16* W, const std::int32_t* off, int G, int K, int N,
                             bool w_nk, const std::int32_t* expert_of) {
  const int lanes = LtLanes::lanes_for(busy(off, G));
  lanes_.fork(lanes);
  for (int g = 0, lane = 0; g < G; ++g) {
    const int rows = off[g + 1] - off[g];
    if (rows == 0) continue;
    lt_gemm({.ta = w_nk ? CUBLAS_OP_T : CUBLAS_OP_N,
             .tb = CUBLAS_OP_N,
             .m = N,
             .n = rows,
             .k = K,
             .a = W + static_cast<std::int64_t>(ops::group_expert(expert_of, g)) * N * K,
             .lda = w_nk ? K : N,
             .b = X + static_cast<std::int64_t>(off[g]) * K,
             .ldb = K,
             .c = D + static_cast<std::int64_t>(off[g]) * N,
             .ldc = N},
            lane);
    lane = (lane + 1) % lanes;
  }
  lanes_.join(lanes);
}

void GroupedGemm::rows_times_weight(bf16* D, const bf16* X, const bf16* W, const std::int32_t* off, int E, int K,
                                    int N, bool w_nk, const std::int32_t* expert_of) {
  if (!one_call(D, X, W, E, K, N)) {
    per_expert(D, X, W, off, E, K, N, w_nk, expert_of);
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
    table_.expert[groups] = ops::group_expert(expert_of, e);
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
    per_expert(D, X, W, off, E, K, N, w_nk, expert_of);
    return;
  }
  KILN_CUBLAS_CHECK(st);
}

void GroupedGemm::weight_grad(float* dW, const bf16* A, const bf16* B, const std::int32_t* off, int G, int E, int P,
                              int Q, bool overwrite, const std::int32_t* expert_of) {
  const std::int64_t per = static_cast<std::int64_t>(P) * Q;
  if (overwrite)  // on the backend's stream, before the fork
    for (const int e : ops::experts_without_rows(off, G, expert_of, E))
      KILN_CUDA_CHECK(cudaMemsetAsync(dW + e * per, 0, static_cast<std::size_t>(per) * sizeof(float), stream_));
  const std::vector<std::vector<int>> passes = ops::weight_grad_passes(off, G, expert_of);
  for (std::size_t pass = 0; pass < passes.size(); ++pass) {
    const int lanes = LtLanes::lanes_for(static_cast<int>(passes[pass].size()));
    lanes_.fork(lanes);
    int lane = 0;
    for (const int g : passes[pass]) {
      float* dWe = dW + ops::group_expert(expert_of, g) * per;
      lt_gemm({.ta = CUBLAS_OP_N,
               .tb = CUBLAS_OP_T,
               .m = Q,
               .n = P,
               .k = off[g + 1] - off[g],
               .a = B + static_cast<std::int64_t>(off[g]) * Q,
               .lda = Q,
               .b = A + static_cast<std::int64_t>(off[g]) * P,
               .ldb = P,
               .c = dWe,
               .ldc = Q,
               .c_f32 = true,
               .beta = overwrite && pass == 0 ? 0.0f : 1.0f},
              lane);
      lane = (lane + 1) % lanes;
    }
    lanes_.join(lanes);
  }
}

}  // namespace kiln::cuda
