#include "kiln/tensor/cuda_check.hpp"

namespace kiln::detail {

void throw_cuda(cudaError_t e, const char* expr, const char* file, int line) {
  throw Error(cat(file, ":", line, ": CUDA error ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ") in ", expr));
}

void throw_cublas(cublasStatus_t s, const char* expr, const char* file, int line) {
  throw Error(cat(file, ":", line, ": cuBLAS error ", cublasLtGetStatusName(s), " (", cublasLtGetStatusString(s),
                  ") in ", expr));
}

}  // namespace kiln::detail
