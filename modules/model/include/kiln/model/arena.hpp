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
  // Instead of allocate(): `copies` copies of every view, the slots pointing into copy 0 until
  // select() points them elsewhere (the slots must stay valid as long as the arena).
  void allocate_copies(ops::Backend& backend, int copies) {
    stride_ = align_up(bytes_);
    copies_ = copies;
    buffer_ = backend.alloc(stride_ * static_cast<std::size_t>(copies));
    select(0);
  }
  void select(int copy) {
    for (auto& r : requests_) *r.slot = buffer_.view(r.dtype, r.shape, static_cast<std::size_t>(copy) * stride_ + r.offset);
  }
  int copies() const { return copies_; }
  // Instead of allocate(): the views in memory someone else owns (bytes() of it from `base`, which
  // is kAlign-aligned and outlives the views).
  void place(void* base, Device device) {
    for (auto& r : requests_) *r.slot = TensorView(static_cast<char*>(base) + r.offset, r.shape, r.dtype, device);
    requests_.clear();
  }
  // Bytes of one copy.
  std::size_t bytes() const { return bytes_; }
  // After allocate(): the whole allocation, as one u8 tensor (what one transfer moves).
  TensorView all() const { return buffer_.view(DType::u8, {static_cast<std::int64_t>(bytes_)}, 0); }

 private:
  struct Request {
    TensorView* slot;
    DType dtype;
    Shape shape;
    std::size_t offset;
  };
  std::vector<Request> requests_;
  std::size_t bytes_ = 0, stride_ = 0;
  int copies_ = 1;
  Buffer buffer_;
};

}  // namespace kiln::model
