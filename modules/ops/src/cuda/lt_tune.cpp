// lt_fastest_same_bits: cuBLASLt's candidate algorithms for one call, timed, among those whose result
// equals the heuristic's first bit for bit (kiln/ops/cuda/cublaslt.hpp).
#include <cstdint>
#include <vector>

#include "kiln/ops/cuda/cublaslt.hpp"
#include "kiln/tensor/buffer.hpp"

namespace kiln::cuda {

int lt_fastest_same_bits(const LtTuneCall& c, std::span<const cublasLtMatmulAlgo_t> algos) {
  if (algos.size() < 2) return 0;
  const Buffer scratch(Device::cuda, c.d_bytes);
  const float alpha = 1.0f, beta = 0.0f;
  auto launch = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(c.handle, c.op, &alpha, c.a, c.la, c.b, c.lb, &beta, scratch.data(), c.lc, scratch.data(),
                          c.lc, &algo, c.workspace, c.workspace_bytes, c.stream) == CUBLAS_STATUS_SUCCESS;
  };
  cudaEvent_t start = nullptr, stop = nullptr;
  KILN_CUDA_CHECK(cudaEventCreate(&start));
  KILN_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<std::uint8_t> first(c.d_bytes), got(c.d_bytes);
  int best = 0;
  float best_ms = 0;
  for (std::size_t i = 0; i < algos.size(); ++i) {
    if (!launch(algos[i])) {  // also the warm-up run, whose result is compared
      if (i == 0) break;        // nothing to compare with: the heuristic's first
      continue;
    }
    KILN_CUDA_CHECK(cudaMemcpyAsync((i == 0 ? first : got).data(), scratch.data(), c.d_bytes, cudaMemcpyDeviceToHost,
                                    c.stream));
    KILN_CUDA_CHECK(cudaStreamSynchronize(c.stream));
    if (i > 0 && got != first) continue;  // another accumulation order: not a candidate
    constexpr int kRuns = 3;
    KILN_CUDA_CHECK(cudaEventRecord(start, c.stream));
    bool ok = true;
    for (int r = 0; r < kRuns && ok; ++r) ok = launch(algos[i]);
    KILN_CUDA_CHECK(cudaEventRecord(stop, c.stream));
    KILN_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (!ok) continue;
    if (i == 0 || ms < best_ms) {
      best = static_cast<int>(i);
      best_ms = ms;
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

}  // namespace kiln::cuda
