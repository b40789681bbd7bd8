#pragma once
// Carves many tensors out of one allocation: request views first, then allocate once.
#include <vector>

#include "kiln/ops/backend.hpp"

namespace kiln::model {

class Arena {
 public:
  static constexpr std::size_t kAlign = 256;  // every view's offset is a multiple of it
  static std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

  // Registers a tensor; `slot` receives its view when allocate() runs (slot must stay valid).
  void request(TensorView* slot, DType dtype, Shape shape) {
    bytes_ = align_up(bytes_);
    requests_.push_back({slot, dtype, shape, bytes_});
    bytes_ += static_cast<std::size_t>(shape.numel()) * size_of(dtype);
  }
  void allocate(ops::Backend& backend) {
    buffer_ = backend.alloc(bytes_);
    for (auto& r : requests_) *r.slot = buffer_.view(r.dtype, r.shape, r.offset);
    requests_.clear();
  }
  // Instead of allocate(): the views in memory someone else owns (bytes() of it from `base`, which
  // is kAlign-aligned and outlives the views).
  void place(void* base, Device device) {
    for (auto& r : requests_) *r.slot = TensorView(static_cast<char*>(base) + r.offset, r.shape, r.dtype, device);
    requests_.clear();
  }
  std::size_t bytes() const { return bytes_; }

 private:
  struct Request {
    TensorView* slot;
    DType dtype;
    Shape shape;
    std::size_t offset;
  };
  std::vector<Request> requests_;
  std::size_t bytes_ = 0;
  Buffer buffer_;
};

}  // namespace kiln::model
