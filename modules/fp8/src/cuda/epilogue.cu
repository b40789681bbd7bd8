// Elementwise epilogues for FP8 GEMMs whose bias/GELU/dGELU cuBLASLt cannot fuse: the GEMM writes
// bf16, this kernel finishes it in place. The formulas are ops::gelu / ops::gelu_grad, as on CPU.
#include <algorithm>

#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::fp8::cuda {

namespace {

using bf16 = __nv_bfloat16;

__global__ void epilogue_kernel(bf16* __restrict__ d, const bf16* __restrict__ aux, const bf16* __restrict__ bias,
                                long long M, long long N, ops::Epilogue epilogue) {
  const long long total = M * N;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    float v;
    switch (epilogue) {
      case ops::Epilogue::bias: v = __bfloat162float(d[i]) + __bfloat162float(bias[i % N]); break;
      case ops::Epilogue::gelu: v = ops::gelu(__bfloat162float(aux[i])); break;
      default: v = __bfloat162float(d[i]) * ops::gelu_grad(__bfloat162float(aux[i])); break;  // dgelu
    }
    d[i] = __float2bfloat16_rn(v);
  }
}

}  // namespace

void gemm_epilogue(bf16* d, const bf16* aux, const bf16* bias, std::int64_t M, std::int64_t N, ops::Epilogue epilogue,
                   cudaStream_t s) {
  KILN_CHECK(epilogue != ops::Epilogue::none, "gemm_epilogue: no epilogue to apply");
  const long long total = M * N;
  if (total <= 0) return;
  constexpr int kThreads = 256;
  const auto grid = static_cast<unsigned>(std::min<long long>((total + kThreads - 1) / kThreads, 16384));
  epilogue_kernel<<<grid, kThreads, 0, s>>>(d, aux, bias, M, N, epilogue);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::fp8::cuda
