#pragma once
// Random operands for kiln's benchmarks: random data draws more power than constant data, so the
// clocks a benchmark runs at are nearer training's.
#include <cstdint>
#include <cstring>
#include <vector>

#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::bench {

// bf16 values uniform in [-1, 1) (a fixed LCG: the same data every run) over the whole device buffer.
inline void fill_random_bf16(Buffer& b) {
  std::vector<std::uint16_t> h(b.bytes() / 2);
  std::uint32_t x = 12345;
  for (auto& v : h) {
    x = x * 1664525u + 1013904223u;
    const float f = static_cast<float>(x >> 8) / 16777216.0f * 2.0f - 1.0f;
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<std::uint16_t>(bits >> 16);
  }
  KILN_CUDA_CHECK(cudaMemcpy(b.data(), h.data(), b.bytes(), cudaMemcpyHostToDevice));
}

}  // namespace kiln::bench
