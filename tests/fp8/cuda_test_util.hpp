#pragma once
// Device copies of host data and back, for the FP8 suites' CUDA cases.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::test {

template <class T>
Buffer to_device(const std::vector<T>& h) {
  Buffer b(Device::cuda, std::max<std::size_t>(h.size() * sizeof(T), 256));
  KILN_CUDA_CHECK(cudaMemcpy(b.data(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}
// n values from device memory, after every queued kernel has finished.
template <class T>
std::vector<T> to_host(const void* d, std::size_t n) {
  std::vector<T> h(n);
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  KILN_CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}
// Whether two device buffers hold the same bytes: codes, or scales and values compared bit for bit.
inline bool same_device_bytes(const void* a, const void* b, std::size_t bytes) {
  return to_host<std::uint8_t>(a, bytes) == to_host<std::uint8_t>(b, bytes);
}

}  // namespace kiln::test
