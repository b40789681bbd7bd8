#pragma once
// What kiln's cuBLASLt GEMM runners (bf16 in ops, FP8 in fp8) share: the epilogue mapping and small
// RAII pieces.
#include <cublasLt.h>

#include "kiln/ops/epilogue.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {

// cuBLASLt's epilogue for an ops::Epilogue; `with_bias`: a GELU epilogue also adds the bias.
inline cublasLtEpilogue_t lt_epilogue(ops::Epilogue e, bool with_bias) {
  switch (e) {
    case ops::Epilogue::none: return CUBLASLT_EPILOGUE_DEFAULT;
    case ops::Epilogue::bias: return CUBLASLT_EPILOGUE_BIAS;
    case ops::Epilogue::gelu: return with_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    case ops::Epilogue::dgelu: return CUBLASLT_EPILOGUE_DGELU;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}
// Whether the epilogue writes or reads the aux matrix (the GELU's pre-activation).
constexpr bool uses_aux(ops::Epilogue e) { return e == ops::Epilogue::gelu || e == ops::Epilogue::dgelu; }

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
