// The device pointer arrays of a grouped GEMM (cuBLAS reads them on the device), written by a tiny
// kernel from a table passed by value: no host staging buffer, no wait for an earlier upload.
#include "common.cuh"
#include "kiln/ops/cuda/moe.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;

// The table is a large kernel parameter (about 8 KiB; CUDA 12.1+ takes up to 32 KiB on sm_70+).
__global__ __launch_bounds__(kThreads) void pointers_kernel(const void** a, const void** b, void** c,
                                                            const __grid_constant__ GroupedPointerTable t) {
  for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < t.groups; g += gridDim.x * blockDim.x) {
    a[g] = t.a0 + static_cast<std::int64_t>(t.expert[g]) * t.a_stride;
    b[g] = t.b0 + static_cast<std::int64_t>(t.row0[g]) * t.b_stride;
    c[g] = t.c0 + static_cast<std::int64_t>(t.row0[g]) * t.c_stride;
  }
}

}  // namespace

void grouped_gemm_pointers(const void** a, const void** b, void** c, const GroupedPointerTable& table,
                           cudaStream_t s) {
  KILN_CHECK(table.groups >= 0 && table.groups <= kGroupedMaxGroups, "grouped_gemm_pointers: ", table.groups,
             " groups, at most ", kGroupedMaxGroups);
  if (table.groups == 0) return;
  pointers_kernel<<<static_cast<unsigned>(ceil_div(table.groups, kThreads)), kThreads, 0, s>>>(a, b, c, table);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda
