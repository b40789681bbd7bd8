#pragma once
// A small device-to-host copy that the host waits for alone: the copy goes to pinned memory and an
// event follows it, so work queued after it (on the same stream) keeps running while the host reads.
#include <cuda_runtime_api.h>

#include <cstddef>

#include "kiln/tensor/buffer.hpp"

namespace kiln::cuda {

class HostReadback {
 public:
  HostReadback() = default;
  HostReadback(const HostReadback&) = delete;
  HostReadback& operator=(const HostReadback&) = delete;
  ~HostReadback();

  // Enqueues the copy of `bytes` from device memory `src` on `s`, then the event.
  void copy(const void* src, std::size_t bytes, cudaStream_t s);
  // Waits for the last copy alone and writes its bytes to `dst`.
  void read(void* dst);

 private:
  Buffer pinned_;
  std::size_t bytes_ = 0;
  cudaEvent_t done_ = nullptr;
};

}  // namespace kiln::cuda
