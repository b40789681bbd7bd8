#include "kiln/tensor/buffer.hpp"

#include <cstdlib>
#include <new>

#ifdef KILN_WITH_CUDA
#include "kiln/tensor/cuda_check.hpp"
#endif

namespace kiln {

Buffer::Buffer(Device device, std::size_t bytes) : bytes_(bytes), device_(device) {
  if (bytes == 0) return;
  if (device == Device::cpu) {
    std::size_t rounded = (bytes + 63) / 64 * 64;
    data_ = std::aligned_alloc(64, rounded);
    if (!data_) KILN_THROW("out of host memory allocating ", bytes, " bytes");
  } else {
#ifdef KILN_WITH_CUDA
    cudaError_t e = cudaMalloc(&data_, bytes);
    if (e != cudaSuccess) {
      std::size_t free_b = 0, total_b = 0;
      cudaGetLastError();
      cudaMemGetInfo(&free_b, &total_b);
      KILN_THROW("out of GPU memory allocating ", bytes / (1 << 20), " MiB (", free_b / (1 << 20), " MiB free of ",
                 total_b / (1 << 20), "): ", cudaGetErrorString(e));
    }
#else
    KILN_THROW("this kiln was built without CUDA; cannot allocate device memory");
#endif
  }
}

Buffer Buffer::pinned(std::size_t bytes) {
#ifdef KILN_WITH_CUDA
  Buffer b;
  if (bytes == 0) return b;
  cudaError_t e = cudaHostAlloc(&b.data_, bytes, cudaHostAllocDefault);
  if (e != cudaSuccess) {
    cudaGetLastError();
    KILN_THROW("cannot allocate ", bytes / (1 << 20), " MiB of pinned host memory: ", cudaGetErrorString(e));
  }
  b.bytes_ = bytes;
  b.pinned_ = true;
  return b;
#else
  return Buffer(Device::cpu, bytes);
#endif
}

void Buffer::release() noexcept {
  if (!data_) return;
  if (pinned_) {
#ifdef KILN_WITH_CUDA
    cudaFreeHost(data_);
#endif
  } else if (device_ == Device::cpu) {
    std::free(data_);
  } else {
#ifdef KILN_WITH_CUDA
    cudaFree(data_);
#endif
  }
  data_ = nullptr;
  bytes_ = 0;
  pinned_ = false;
}

TensorView Buffer::view(DType dtype, Shape shape) const { return view(dtype, shape, 0); }

TensorView Buffer::view(DType dtype, Shape shape, std::size_t byte_offset) const {
  std::size_t need = byte_offset + static_cast<std::size_t>(shape.numel()) * size_of(dtype);
  KILN_CHECK(need <= bytes_, "view of ", need, " bytes exceeds a buffer of ", bytes_);
  return TensorView(static_cast<char*>(data_) + byte_offset, shape, dtype, device_);
}

}  // namespace kiln
