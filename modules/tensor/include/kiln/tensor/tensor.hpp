#pragma once
// A tensor is a non-owning view {ptr, shape, strides, dtype, device}; Buffers own memory.
// Views are cheap values: slicing a flat parameter buffer, a shard or an activation gives a view.
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "kiln/core/error.hpp"
#include "kiln/tensor/dtype.hpp"

namespace kiln {

inline constexpr int kMaxDims = 5;

struct Shape {
  std::array<std::int64_t, kMaxDims> dims{};
  int ndim = 0;

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> d) {
    KILN_CHECK(d.size() <= kMaxDims, "at most ", kMaxDims, " dimensions");
    for (auto v : d) dims[ndim++] = v;
  }
  std::int64_t operator[](int i) const { return dims[i < 0 ? ndim + i : i]; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= dims[i];
    return n;
  }
  bool operator==(const Shape& o) const {
    if (ndim != o.ndim) return false;
    for (int i = 0; i < ndim; ++i)
      if (dims[i] != o.dims[i]) return false;
    return true;
  }
  std::string str() const;
};

struct TensorView {
  void* data = nullptr;
  Shape shape;
  std::array<std::int64_t, kMaxDims> strides{};  // in elements
  DType dtype = DType::f32;
  Device device = Device::cpu;

  TensorView() = default;
  // A contiguous (row-major) view.
  TensorView(void* ptr, Shape s, DType t, Device d) : data(ptr), shape(s), dtype(t), device(d) {
    std::int64_t st = 1;
    for (int i = shape.ndim - 1; i >= 0; --i) {
      strides[i] = st;
      st *= shape.dims[i];
    }
  }

  std::int64_t numel() const { return shape.numel(); }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * size_of(dtype); }
  int ndim() const { return shape.ndim; }
  std::int64_t size(int i) const { return shape[i]; }
  bool empty() const { return data == nullptr; }
  bool contiguous() const;
  explicit operator bool() const { return data != nullptr; }

  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
  // Same memory, new contiguous shape with the same element count.
  TensorView reshape(Shape s) const;
  // Elements [begin, begin + count) of a contiguous tensor, as a flat 1-D view.
  TensorView flat_slice(std::int64_t begin, std::int64_t count) const;
  // Rows [begin, begin + count) along dimension 0 of a contiguous tensor.
  TensorView rows(std::int64_t begin, std::int64_t count) const;
  std::string str() const;  // "bf16[16,1024,768]@cuda"
};

// Throws a kiln::Error naming `what` unless the view has this dtype, shape and is contiguous.
void expect_tensor(const TensorView& t, DType dtype, const Shape& shape, const char* what);

}  // namespace kiln
