#pragma once
// The cross-entropy kernels production does not run, for bench_kernels to measure against
// kiln::cuda::cross_entropy (the streaming kernel with 256 threads). Each reads rows in 16-byte
// chunks: V % 8 == 0 and 16-byte aligned logits.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kiln/ops/cuda/launchers.hpp"

namespace kiln::cuda {

enum class CrossEntropyVariant {
  row_in_registers,  // the row cached in registers, read from memory once (streaming_512 past 64K logits)
  streaming_512,     // 512 threads; the row read twice (the second time mostly from L2)
  shared_512,        // 512 threads; the row staged in shared memory by cp.async (rows up to 56K logits)
  streaming_256,     // 256 threads: what cross_entropy runs
  shared_256,        // shared_512 with 256 threads
};
void cross_entropy_variant(CrossEntropyVariant variant, float* losses, bf16* logits, const std::int32_t* targets, int N,
                           int V, int vocab_real, float dloss, cudaStream_t s);

}  // namespace kiln::cuda
