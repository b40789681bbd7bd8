#pragma once
// KILN_HD marks functions that compile for both host and device (nvcc) and plain host (g++).
#if defined(__CUDACC__)
#define KILN_HD __host__ __device__ __forceinline__
#else
#define KILN_HD inline
#endif
