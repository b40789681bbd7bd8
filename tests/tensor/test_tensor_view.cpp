// Shapes and non-owning views: strides, contiguity, reshapes and slices, printing, and the checks
// ops run on their arguments.
#include <doctest/doctest.h>

#include <vector>

#include "kiln/core/error.hpp"
#include "kiln/tensor/dtype.hpp"
#include "kiln/tensor/tensor.hpp"

using namespace kiln;

TEST_CASE("a new view is contiguous with row-major strides") {
  std::vector<float> mem(2 * 3 * 4);
  TensorView t(mem.data(), {2, 3, 4}, DType::f32, Device::cpu);
  CHECK(t.ndim() == 3);
  CHECK(t.numel() == 24);
  CHECK(t.bytes() == 96);
  CHECK(t.strides[0] == 12);
  CHECK(t.strides[1] == 4);
  CHECK(t.strides[2] == 1);
  CHECK(t.size(-1) == 4);
  CHECK(t.size(0) == 2);
  CHECK(t.contiguous());
  CHECK(static_cast<bool>(t));
  CHECK_FALSE(TensorView().operator bool());
  CHECK(TensorView().empty());
}

TEST_CASE("a view with exchanged strides is not contiguous, but a dimension of size 1 may have any stride") {
  std::vector<float> mem(12);
  TensorView t(mem.data(), {3, 4}, DType::f32, Device::cpu);
  TensorView transposed = t;
  transposed.shape = Shape{4, 3};
  transposed.strides[0] = 1;
  transposed.strides[1] = 4;
  CHECK_FALSE(transposed.contiguous());

  TensorView unit(mem.data(), {3, 1, 4}, DType::f32, Device::cpu);
  unit.strides[1] = 999;  // never stepped over
  CHECK(unit.contiguous());
}

TEST_CASE("reshape keeps the memory and refuses another element count or a non-contiguous view") {
  std::vector<float> mem(24);
  TensorView t(mem.data(), {2, 3, 4}, DType::bf16, Device::cpu);
  TensorView r = t.reshape({6, 4});
  CHECK(r.data == t.data);
  CHECK(r.shape == Shape{6, 4});
  CHECK(r.strides[0] == 4);
  CHECK(r.dtype == DType::bf16);
  CHECK_THROWS_WITH_AS(t.reshape({5, 5}), doctest::Contains("changes the element count"), Error);
  TensorView strided = t;
  strided.strides[2] = 2;
  CHECK_THROWS_WITH_AS(strided.reshape({24}), doctest::Contains("non-contiguous"), Error);
}

TEST_CASE("flat_slice gives a 1-D view at an element offset and checks its range") {
  std::vector<std::uint16_t> mem(20);
  TensorView t(mem.data(), {4, 5}, DType::bf16, Device::cpu);
  TensorView s = t.flat_slice(7, 9);
  CHECK(s.data == mem.data() + 7);
  CHECK(s.shape == Shape{9});
  CHECK(s.dtype == DType::bf16);
  CHECK(t.flat_slice(20, 0).numel() == 0);
  CHECK_THROWS_WITH_AS(t.flat_slice(15, 6), doctest::Contains("out of range"), Error);
  CHECK_THROWS_AS(t.flat_slice(-1, 2), Error);
}

TEST_CASE("rows gives consecutive rows along dimension 0 and checks their range") {
  std::vector<std::int32_t> mem(5 * 2 * 3);
  TensorView t(mem.data(), {5, 2, 3}, DType::i32, Device::cpu);
  TensorView r = t.rows(2, 3);
  CHECK(r.data == mem.data() + 2 * 6);
  CHECK(r.shape == Shape{3, 2, 3});
  CHECK(r.contiguous());
  CHECK(t.rows(5, 0).numel() == 0);
  CHECK_THROWS_WITH_AS(t.rows(4, 2), doctest::Contains("rows [4, 6) out of range for i32[5,2,3]@cpu"), Error);
}

TEST_CASE("shapes compare by rank and dimensions and index from the end with negative indices") {
  CHECK(Shape{2, 3} == Shape{2, 3});
  CHECK_FALSE(Shape{2, 3} == Shape{3, 2});
  CHECK_FALSE(Shape{6} == Shape{6, 1});
  CHECK(Shape{} == Shape{});
  CHECK(Shape{}.numel() == 1);
  CHECK(Shape{4, 0, 2}.numel() == 0);
  Shape s{7, 8, 9};
  CHECK(s[-1] == 9);
  CHECK(s[-3] == 7);
  CHECK_THROWS_WITH_AS((Shape{1, 2, 3, 4, 5, 6}), doctest::Contains("at most 5 dimensions"), Error);
}

TEST_CASE("shapes and views print as dtype[dims]@device") {
  CHECK(Shape{}.str() == "[]");
  CHECK(Shape{16, 1024, 768}.str() == "[16,1024,768]");
  int dummy = 0;
  CHECK(TensorView(&dummy, {16, 1024, 768}, DType::bf16, Device::cuda).str() == "bf16[16,1024,768]@cuda");
  CHECK(TensorView(&dummy, {3}, DType::e4m3, Device::cpu).str() == "e4m3[3]@cpu");
}

TEST_CASE("expect_tensor names the tensor and what it expected") {
  std::vector<float> mem(6);
  TensorView t(mem.data(), {2, 3}, DType::f32, Device::cpu);
  CHECK_NOTHROW(expect_tensor(t, DType::f32, {2, 3}, "x"));
  CHECK_THROWS_WITH_AS(expect_tensor(TensorView(), DType::f32, {2, 3}, "bias"),
                       doctest::Contains("bias: missing tensor (expected f32[2,3])"), Error);
  CHECK_THROWS_WITH_AS(expect_tensor(t, DType::bf16, {2, 3}, "weight"),
                       doctest::Contains("weight: expected a contiguous bf16[2,3], got f32[2,3]@cpu"), Error);
  CHECK_THROWS_WITH_AS(expect_tensor(t, DType::f32, {3, 2}, "weight"),
                       doctest::Contains("expected a contiguous f32[3,2], got f32[2,3]@cpu"), Error);
  TensorView strided = t;
  strided.strides[0] = 4;
  CHECK_THROWS_WITH_AS(expect_tensor(strided, DType::f32, {2, 3}, "grad"), doctest::Contains("grad: expected a contiguous"),
                       Error);
}

TEST_CASE("every dtype has its size in bytes and its name") {
  CHECK(size_of(DType::f32) == 4);
  CHECK(size_of(DType::bf16) == 2);
  CHECK(size_of(DType::e4m3) == 1);
  CHECK(size_of(DType::e5m2) == 1);
  CHECK(size_of(DType::i32) == 4);
  CHECK(size_of(DType::u16) == 2);
  CHECK(name_of(DType::f32) == "f32");
  CHECK(name_of(DType::bf16) == "bf16");
  CHECK(name_of(DType::e4m3) == "e4m3");
  CHECK(name_of(DType::e5m2) == "e5m2");
  CHECK(name_of(DType::i32) == "i32");
  CHECK(name_of(DType::u16) == "u16");
  CHECK(name_of(Device::cpu) == "cpu");
  CHECK(name_of(Device::cuda) == "cuda");
  static_assert(size_of(DType::bf16) == 2, "size_of is usable at compile time");
}
