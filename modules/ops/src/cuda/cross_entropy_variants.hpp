#pragma once
// Internal: the cross-entropy kernel variants, selectable for benchmarking (bench/bench_kernels.cpp).
// 0 automatic, 1 row cached in registers, 2 streaming (512 threads), 3 row in shared memory (512),
// 4 element by element, 5 streaming (256 threads), 6 row in shared memory (256).
#include "kiln/ops/cuda/launchers.hpp"

namespace kiln::cuda {
void cross_entropy_variant(int variant, float* losses, bf16* logits, const std::int32_t* targets, int N, int V,
                           int vocab_real, float dloss, cudaStream_t s);
}
