#pragma once
// The experts' linears through cuBLAS (row-major in kiln's terms, as GemmRunner):
//   - data GEMMs (bf16 out): ONE cublasGemmGroupedBatchedEx call over the experts that have rows,
//     one group of one problem each (its own m, n, k), bf16 A/B/C with f32 compute; its A/B/C
//     pointer arrays live on the device, written by grouped_gemm_pointers (kiln/ops/cuda/moe.hpp);
//     the other arrays are host arrays, reused from call to call;
//   - weight gradients (f32 out): cuBLAS's grouped GEMM takes bf16 A/B only with a bf16 C, so one
//     cublasGemmEx per expert with rows (bf16 A/B, f32 C, f32 compute, beta 0 or 1). cublasGemmEx
//     rather than kiln's cuBLASLt GemmRunner: the experts' row counts change every step, and the
//     runner caches a plan per shape.
// The handle runs on the backend's stream with the backend's cuBLASLt workspace (the two never run
// at once: one stream), f32 reductions only (no reduced-precision split-K). Deterministic: a shape
// always runs the same kernels (cuBLAS's reproducibility on one stream).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "kiln/ops/cuda/moe.hpp"
#include "kiln/tensor/buffer.hpp"

namespace kiln::cuda {

class GroupedGemm {
 public:
  GroupedGemm(cudaStream_t stream, void* workspace, std::size_t workspace_bytes);
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;

  // For each expert e with rows [off[e], off[e + 1]):
  //   D[rows] = X[rows] @ W_e^T (w_nk: W is [E, N, K]), or X[rows] @ W_e (W is [E, K, N]);
  // X [R, K], D [R, N], row-major bf16. Rows from off[E] on are not touched.
  void rows_times_weight(bf16* D, const bf16* X, const bf16* W, const std::int32_t* off, int E, int K, int N,
                         bool w_nk);
  // Whether rows_times_weight with these arguments runs as one grouped call: every matrix 16-byte
  // aligned (K, N multiples of 8, 16-byte aligned bases; the grouped call cannot see its device
  // pointers' alignment), at most kGroupedMaxGroups experts. Otherwise one cublasGemmEx per expert.
  bool one_call(const bf16* D, const bf16* X, const bf16* W, int E, int K, int N) const;
  // For each expert e: dW_e [P, Q] (row-major f32) = (overwrite) or += A[rows]^T @ B[rows], A [R, P],
  // B [R, Q] bf16. Experts without rows: dW_e written zero with overwrite, else untouched.
  void weight_grad(float* dW, const bf16* A, const bf16* B, const std::int32_t* off, int E, int P, int Q,
                   bool overwrite);

 private:
  void per_expert(bf16* D, const bf16* X, const bf16* W, const std::int32_t* off, int E, int K, int N, bool w_nk);

  cudaStream_t stream_;
  cublasHandle_t handle_ = nullptr;
  bool grouped_unsupported_ = false;  // the grouped call answered NOT_SUPPORTED once: per expert from then on
  Buffer pointers_;                   // 3 kGroupedMaxGroups device pointers: A, B, C arrays
  GroupedPointerTable table_{};
  // The grouped call's host arrays, one entry per group.
  std::vector<cublasOperation_t> transa_, transb_;
  std::vector<int> m_, n_, k_, lda_, ldb_, ldc_, size_;
  std::vector<float> alpha_, beta_;
};

}  // namespace kiln::cuda
