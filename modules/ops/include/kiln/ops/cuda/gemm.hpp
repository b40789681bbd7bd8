#pragma once
// bf16 GEMMs through cuBLASLt, row-major in kiln's terms. Plans (layouts, epilogue, heuristic
// algorithm) are cached per shape. Deterministic: the algorithm for a shape never changes (with
// autotune, within a process).
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "kiln/ops/cuda/launchers.hpp"
#include "kiln/ops/epilogue.hpp"

namespace kiln::cuda {

// D[M, N] (row-major) = alpha * op(A) @ op(B) + beta * D, where op transposes when the flag is set:
//   A is [M, K] (or [K, M] if trans_a), B is [K, N] (or [N, K] if trans_b), all row-major.
// D is bf16 or f32 (d_f32); with accumulate, beta = 1 (D += ...). Epilogues (ops::Epilogue, on a
// bf16 D that is written): bias [N] and aux [M, N] bf16; gelu without a bias is cuBLASLt's GELU_AUX.
struct GemmDesc {
  int M = 0, N = 0, K = 0;
  bool trans_a = false, trans_b = false;
  const bf16* A = nullptr;
  const bf16* B = nullptr;
  void* D = nullptr;
  bool d_f32 = false;
  bool accumulate = false;
  // A gradient held in bf16: split-K partial sums in f32 only (keep_partials_in_f32).
  bool f32_partials = false;
  ops::Epilogue epilogue = ops::Epilogue::none;
  const bf16* bias = nullptr;
  bf16* aux = nullptr;
  float alpha = 1.0f;
  int sm_count = 0;  // > 0: cuBLASLt's CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET (leaves the other SMs free)
};

class GemmRunner {
 public:
  // Out of line (gemm.cpp), where Plan is complete: a constructor may destroy plans_ on unwinding.
  GemmRunner(cublasLtHandle_t handle, void* workspace, std::size_t workspace_bytes);
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;
  void run(const GemmDesc& g, cudaStream_t stream);
  // Autotune: at a shape's first use, time up to 8 of the heuristic's algorithms on scratch output
  // and keep the fastest of those whose result equals the heuristic's first's byte for byte (off:
  // the heuristic's first). So the choice may differ between processes, the bits never do: a tuned
  // run is bitwise the untuned one, reproducible and resumable. With `any_order` the fastest of all
  // (faster; the bits then depend on the choice, which may differ between processes).
  void set_autotune(bool on, bool any_order = false) {
    autotune_ = on;
    any_order_ = any_order;
  }

 private:
  struct Plan;
  using Key = std::tuple<int, int, int, bool, bool, bool, bool, int>;
  Plan& plan(const GemmDesc& g, cudaStream_t stream);
  // Times the candidates of plan p for g on scratch output; returns the fastest's index.
  int fastest(Plan& p, const GemmDesc& g, const cublasLtMatmulHeuristicResult_t* results, int n, cudaStream_t stream);
  bool autotune_ = false;
  bool any_order_ = false;
  cublasLtHandle_t handle_;
  void* workspace_;
  std::size_t workspace_bytes_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace kiln::cuda
