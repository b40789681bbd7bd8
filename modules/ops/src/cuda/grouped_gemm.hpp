#pragma once
// The experts' linears through cuBLAS (row-major in kiln's terms, as GemmRunner):
//   - per expert (the default): one cuBLASLt matmul per expert that has rows, its algorithm the
//     heuristic's for the expert's row count rounded up to a multiple of 128 (cached per rounded
//     shape; checked against the exact shape with cublasLtMatmulAlgoCheck, which falls back to the
//     exact shape's heuristic): the rows change every step, and a heuristic per call costs the host
//     ~100 us (with cublasGemmEx, measured: the forward after the grouping's synchronisation waited on
//     it) (kiln::cuda::LtRaggedAlgos). The experts' matmuls are spread over the streams of an LtLanes
//     (the backend's and three more, each with its own cuBLASLt workspace) so that one expert's last
//     partial wave of tiles may overlap the next one's; each writes its own rows or weight gradient
//     with the same algorithm wherever it runs: deterministic. Measured at moe-1b's shapes on an
//     H200: ~700 TFLOP/s;
//   - grouped (`grouped_call`): the data GEMMs as ONE cublasGemmGroupedBatchedEx call over the experts
//     that have rows, one group of one problem each (its own m, n, k), bf16 A/B/C with f32 compute; its
//     A/B/C pointer arrays live on the device, written by grouped_gemm_pointers (kiln/ops/cuda/moe.hpp);
//     the other arrays are host arrays, reused from call to call. ~310 TFLOP/s there;
//   - weight gradients (f32 out): per expert either way (cuBLAS's grouped GEMM takes bf16 A/B only
//     with a bf16 C).
// The grouped call's handle runs on the backend's stream with the backend's cuBLASLt workspace (the
// two never run at once: one stream), f32 reductions only (no reduced-precision split-K).
// Deterministic: a shape always runs the same kernels (cuBLAS's reproducibility on one stream).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include "kiln/ops/cuda/cublaslt.hpp"
#include "kiln/ops/cuda/lanes.hpp"
#include "kiln/ops/cuda/moe.hpp"
#include "kiln/tensor/buffer.hpp"

namespace kiln::cuda {

class GroupedGemm {
 public:
  // `grouped_call`: the data GEMMs as one grouped call where it can (else one GEMM per expert). `lt`:
  // the backend's cuBLASLt handle (its workspace is `workspace`). `tune`: each GEMM's algorithm per
  // bucket of rows the fastest of the candidates with the heuristic's first's bits (not for
  // accumulating weight gradients).
  GroupedGemm(cudaStream_t stream, cublasLtHandle_t lt, void* workspace, std::size_t workspace_bytes,
              bool grouped_call, bool tune = false);
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;

  // For each row group g with rows [off[g], off[g + 1]) and its expert e = expert_of[g] (null: g):
  //   D[rows] = X[rows] @ W_e^T (w_nk: W is [E, N, K]), or X[rows] @ W_e (W is [E, K, N]);
  // X [R, K], D [R, N], row-major bf16. Rows from off[G] on are not touched.
  void rows_times_weight(bf16* D, const bf16* X, const bf16* W, const std::int32_t* off, int G, int K, int N,
                         bool w_nk, const std::int32_t* expert_of = nullptr);
  // Whether rows_times_weight with these arguments runs as one grouped call: every matrix 16-byte
  // aligned (K, N multiples of 8, 16-byte aligned bases; the grouped call cannot see its device
  // pointers' alignment), at most kGroupedMaxGroups experts. Otherwise one cuBLASLt matmul per expert.
  bool one_call(const bf16* D, const bf16* X, const bf16* W, int E, int K, int N) const;
  // For each expert e of E: dW_e [P, Q] (row-major f32) = (overwrite) or += A[rows]^T @ B[rows] over
  // the rows of its groups (G groups, expert_of as above), A [R, P], B [R, Q] bf16; an expert's groups
  // in passes (ops::weight_grad_passes). Experts without rows: dW_e written zero with overwrite, else
  // untouched.
  void weight_grad(float* dW, const bf16* A, const bf16* B, const std::int32_t* off, int G, int E, int P, int Q,
                   bool overwrite, const std::int32_t* expert_of = nullptr);

 private:
  void per_expert(bf16* D, const bf16* X, const bf16* W, const std::int32_t* off, int G, int K, int N, bool w_nk,
                  const std::int32_t* expert_of);
  // The experts of `off` that have rows.
  static int busy(const std::int32_t* off, int E);
  // One column-major cuBLASLt matmul C[m, n] = op(A) op(B) (+ beta C): bf16 A and B, C bf16 or f32.
  struct LtCall {
    cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
    int m = 0, n = 0, k = 0;
    const void* a = nullptr;
    int lda = 0;
    const void* b = nullptr;
    int ldb = 0;
    void* c = nullptr;
    int ldc = 0;
    bool c_f32 = false;
    float beta = 0;
  };
  void lt_gemm(const LtCall& c, int lane);

  cudaStream_t stream_;
  cublasLtHandle_t lt_;
  LtLanes lanes_;  // lane 0: the backend's stream and cuBLASLt workspace
  cublasHandle_t handle_ = nullptr;
  // cuBLASLt: a matmul descriptor per (op A, op B, C f32), algorithms per rounded shape.
  std::map<std::tuple<int, int, bool>, cublasLtMatmulDesc_t> lt_ops_;
  LtRaggedAlgos lt_algos_;
  bool grouped_unsupported_ = false;  // not asked for, or it answered NOT_SUPPORTED once: per expert from then on
  bool tune_ = false;
  Buffer pointers_;                   // 3 kGroupedMaxGroups device pointers: A, B, C arrays
  GroupedPointerTable table_{};
  // The grouped call's host arrays, one entry per group.
  std::vector<cublasOperation_t> transa_, transb_;
  std::vector<int> m_, n_, k_, lda_, ldb_, ldc_, size_;
  std::vector<float> alpha_, beta_;
};

}  // namespace kiln::cuda
