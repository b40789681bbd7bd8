// Elementwise epilogues for FP8 GEMMs whose bias/GELU/dGELU cuBLASLt cannot fuse: the GEMM writes
// bf16, this kernel finishes it in place. The formulas are ops::gelu / ops::gelu_grad, as on CPU.
#include <algorithm>
#include <cstdint>

#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::fp8::cuda {

namespace {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float apply(ops::Epilogue epilogue, float d, float aux, float bias) {
  switch (epilogue) {
    case ops::Epilogue::bias: return d + bias;
    case ops::Epilogue::gelu: return ops::gelu(aux);
    default: return d * ops::gelu_grad(aux);  // dgelu
  }
}

// Elementwise, one element a thread per pass of the grid (any shape).
__global__ void epilogue_kernel(bf16* __restrict__ d, const bf16* __restrict__ aux, const bf16* __restrict__ bias,
                                long long M, long long N, ops::Epilogue epilogue) {
  const long long total = M * N;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const float b = epilogue == ops::Epilogue::bias ? __bfloat162float(bias[i % N]) : 0.0f;
    const float a = epilogue == ops::Epilogue::bias ? 0.0f : __bfloat162float(aux[i]);
    d[i] = __float2bfloat16_rn(apply(epilogue, __bfloat162float(d[i]), a, b));
  }
}

// Eight elements a thread with 16-byte accesses (N a multiple of 8, 16-byte aligned pointers, fewer
// than 2^31 elements): the same values as epilogue_kernel's.
__global__ void epilogue_kernel_x8(bf16* __restrict__ d, const bf16* __restrict__ aux, const bf16* __restrict__ bias,
                                   unsigned N, unsigned vectors, ops::Epilogue epilogue) {
  for (unsigned v = blockIdx.x * blockDim.x + threadIdx.x; v < vectors; v += gridDim.x * blockDim.x) {
    const unsigned i = 8 * v;
    uint4 dv = epilogue == ops::Epilogue::gelu ? uint4{} : reinterpret_cast<const uint4*>(d)[v];
    uint4 av = epilogue == ops::Epilogue::bias ? uint4{} : reinterpret_cast<const uint4*>(aux)[v];
    uint4 bv = epilogue == ops::Epilogue::bias ? *reinterpret_cast<const uint4*>(bias + i % N) : uint4{};
    bf16* dp = reinterpret_cast<bf16*>(&dv);
    const bf16* ap = reinterpret_cast<const bf16*>(&av);
    const bf16* bp = reinterpret_cast<const bf16*>(&bv);
#pragma unroll
    for (int k = 0; k < 8; ++k)
      dp[k] = __float2bfloat16_rn(
          apply(epilogue, __bfloat162float(dp[k]), __bfloat162float(ap[k]), __bfloat162float(bp[k])));
    reinterpret_cast<uint4*>(d)[v] = dv;
  }
}

}  // namespace

void gemm_epilogue(bf16* d, const bf16* aux, const bf16* bias, std::int64_t M, std::int64_t N, ops::Epilogue epilogue,
                   cudaStream_t s) {
  KILN_CHECK(epilogue != ops::Epilogue::none, "gemm_epilogue: no epilogue to apply");
  const long long total = M * N;
  if (total <= 0) return;
  constexpr int kThreads = 256;
  auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  if (N % 8 == 0 && total < (1ll << 31) && aligned(d) && aligned(aux) && aligned(bias)) {
    const auto vectors = static_cast<unsigned>(total / 8);
    const auto grid = static_cast<unsigned>(std::min<long long>((vectors + kThreads - 1) / kThreads, 16384));
    epilogue_kernel_x8<<<grid, kThreads, 0, s>>>(d, aux, bias, static_cast<unsigned>(N), vectors, epilogue);
  } else {
    const auto grid = static_cast<unsigned>(std::min<long long>((total + kThreads - 1) / kThreads, 16384));
    epilogue_kernel<<<grid, kThreads, 0, s>>>(d, aux, bias, M, N, epilogue);
  }
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::fp8::cuda
