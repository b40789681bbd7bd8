#pragma once
// Error checks for CUDA runtime and cuBLAS(Lt) calls: they throw kiln::Error with the file:line of
// the call and the library's own error text. Host-only (include from .cpp and .cu host code).
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "kiln/core/error.hpp"

namespace kiln::detail {
[[noreturn]] void throw_cuda(cudaError_t e, const char* expr, const char* file, int line);
[[noreturn]] void throw_cublas(cublasStatus_t s, const char* expr, const char* file, int line);
}  // namespace kiln::detail

#define KILN_CUDA_CHECK(expr)                                                                        \
  do {                                                                                               \
    cudaError_t kiln_err_ = (expr);                                                                  \
    if (kiln_err_ != cudaSuccess) ::kiln::detail::throw_cuda(kiln_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define KILN_CUBLAS_CHECK(expr)                                                                              \
  do {                                                                                                       \
    cublasStatus_t kiln_st_ = (expr);                                                                        \
    if (kiln_st_ != CUBLAS_STATUS_SUCCESS) ::kiln::detail::throw_cublas(kiln_st_, #expr, __FILE__, __LINE__); \
  } while (0)

// After every kernel launch: launch-configuration errors always; with KILN_DEBUG_SYNC defined, also
// a device synchronisation so that faults surface at the kernel that caused them.
#ifdef KILN_DEBUG_SYNC
#define KILN_CUDA_LAUNCH_CHECK()                     \
  do {                                               \
    KILN_CUDA_CHECK(cudaGetLastError());             \
    KILN_CUDA_CHECK(cudaDeviceSynchronize());        \
  } while (0)
#else
#define KILN_CUDA_LAUNCH_CHECK() KILN_CUDA_CHECK(cudaGetLastError())
#endif
