#include "kiln/tensor/tensor.hpp"

namespace kiln {

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? "," : "") + std::to_string(dims[i]);
  return s + "]";
}

bool TensorView::contiguous() const {
  std::int64_t st = 1;
  for (int i = shape.ndim - 1; i >= 0; --i) {
    if (shape.dims[i] != 1 && strides[i] != st) return false;
    st *= shape.dims[i];
  }
  return true;
}

TensorView TensorView::reshape(Shape s) const {
  KILN_CHECK(contiguous(), "reshape of a non-contiguous tensor ", str());
  KILN_CHECK(s.numel() == numel(), "reshape ", str(), " to ", s.str(), " changes the element count");
  return TensorView(data, s, dtype, device);
}

TensorView TensorView::flat_slice(std::int64_t begin, std::int64_t count) const {
  KILN_CHECK(contiguous(), "slice of a non-contiguous tensor ", str());
  KILN_CHECK(begin >= 0 && count >= 0 && begin + count <= numel(), "slice [", begin, ", ", begin + count,
             ") out of range for ", str());
  auto* p = static_cast<char*>(data) + static_cast<std::size_t>(begin) * size_of(dtype);
  return TensorView(p, Shape{count}, dtype, device);
}

TensorView TensorView::rows(std::int64_t begin, std::int64_t count) const {
  KILN_CHECK(contiguous() && ndim() >= 1, "rows of a non-contiguous tensor ", str());
  KILN_CHECK(begin >= 0 && count >= 0 && begin + count <= shape[0], "rows [", begin, ", ", begin + count,
             ") out of range for ", str());
  Shape s = shape;
  s.dims[0] = count;
  auto row = numel() / (shape[0] ? shape[0] : 1);
  auto* p = static_cast<char*>(data) + static_cast<std::size_t>(begin * row) * size_of(dtype);
  return TensorView(p, s, dtype, device);
}

std::string TensorView::str() const { return cat(name_of(dtype), shape.str(), "@", name_of(device)); }

void expect_tensor(const TensorView& t, DType dtype, const Shape& shape, const char* what) {
  if (!t.data) KILN_THROW(what, ": missing tensor (expected ", name_of(dtype), shape.str(), ")");
  if (t.dtype != dtype || !(t.shape == shape) || !t.contiguous())
    KILN_THROW(what, ": expected a contiguous ", name_of(dtype), shape.str(), ", got ", t.str());
}

}  // namespace kiln
