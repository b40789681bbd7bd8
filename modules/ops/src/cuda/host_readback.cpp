#include "host_readback.hpp"

#include <cstring>

#include "kiln/core/error.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {

HostReadback::~HostReadback() {
  if (done_) cudaEventDestroy(done_);
}

void HostReadback::copy(const void* src, std::size_t bytes, cudaStream_t s) {
  if (!done_) KILN_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  // Every copy is read (waited for) before the next is enqueued: the old buffer is free.
  if (pinned_.bytes() < bytes) pinned_ = Buffer::pinned(bytes);
  bytes_ = bytes;
  KILN_CUDA_CHECK(cudaMemcpyAsync(pinned_.data(), src, bytes, cudaMemcpyDeviceToHost, s));
  KILN_CUDA_CHECK(cudaEventRecord(done_, s));
}

void HostReadback::read(void* dst) {
  KILN_CHECK(done_, "HostReadback::read before a copy");
  KILN_CUDA_CHECK(cudaEventSynchronize(done_));
  std::memcpy(dst, pinned_.data(), bytes_);
}

}  // namespace kiln::cuda
