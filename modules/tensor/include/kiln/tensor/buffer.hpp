#pragma once
// Owning device or host memory (RAII, move-only). Host memory is 64-byte aligned, device memory
// comes from cudaMalloc, pinned host memory (Buffer::pinned) from cudaHostAlloc. Views into a
// buffer never outlive it.
#include <cstddef>
#include <cstdint>
#include <utility>

#include "kiln/tensor/tensor.hpp"

namespace kiln {

class Buffer {
 public:
  Buffer() = default;
  Buffer(Device device, std::size_t bytes);
  // Page-locked host memory (Device::cpu) that the GPU copies to and from at full speed and
  // asynchronously; plain host memory in a build without CUDA.
  static Buffer pinned(std::size_t bytes);
  Buffer(Buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        bytes_(std::exchange(o.bytes_, 0)),
        device_(o.device_),
        pinned_(std::exchange(o.pinned_, false)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      device_ = o.device_;
      pinned_ = std::exchange(o.pinned_, false);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { release(); }

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  bool is_pinned() const { return pinned_; }
  explicit operator bool() const { return data_ != nullptr; }
  // A contiguous view of the first shape.numel() elements.
  TensorView view(DType dtype, Shape shape) const;
  TensorView view(DType dtype, Shape shape, std::size_t byte_offset) const;

 private:
  void release() noexcept;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  Device device_ = Device::cpu;
  bool pinned_ = false;
};

}  // namespace kiln
