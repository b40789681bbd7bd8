#pragma once
// Small RAII pieces shared by kiln's cuBLASLt GEMM runners (bf16 in ops, FP8 in fp8).
#include <cublasLt.h>

#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {

template <class T>
void set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& value) {
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
}

struct LtPreference {
  cublasLtMatmulPreference_t p = nullptr;
  LtPreference() { KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&p)); }
  ~LtPreference() { cublasLtMatmulPreferenceDestroy(p); }
  LtPreference(const LtPreference&) = delete;
  LtPreference& operator=(const LtPreference&) = delete;
  template <class T>
  void set(cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
    KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, attr, &value, sizeof(value)));
  }
};

// A matmul descriptor, its three layouts (cuBLASLt's A, B and C = D) and the chosen algorithm.
struct LtMatmulPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool fused = true;  // false: cuBLASLt cannot fuse the epilogue; a plain GEMM and a kernel instead

  LtMatmulPlan() = default;
  LtMatmulPlan(const LtMatmulPlan&) = delete;
  LtMatmulPlan& operator=(const LtMatmulPlan&) = delete;
  ~LtMatmulPlan() { release(); }
  void release() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
    op = nullptr;
    a = b = d = nullptr;
  }
};

}  // namespace kiln::cuda
