// Owning memory: host allocations, views at byte offsets, moves.
#include <doctest/doctest.h>

#include <cstdint>
#include <utility>

#include "kiln/core/error.hpp"
#include "kiln/tensor/buffer.hpp"
#include "kiln_test.hpp"

using namespace kiln;

namespace {
std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
}  // namespace

TEST_CASE("a host buffer is 64-byte aligned and holds the bytes asked for") {
  for (std::size_t bytes : {1, 63, 64, 65, 1000, 4096 + 3}) {
    Buffer b(Device::cpu, bytes);
    REQUIRE(b);
    CHECK(b.bytes() == bytes);
    CHECK(b.device() == Device::cpu);
    CHECK(address(b.data()) % 64 == 0);
    auto* p = static_cast<unsigned char*>(b.data());
    p[0] = 1;
    p[bytes - 1] = 2;  // the whole range is writable
    CHECK(p[bytes - 1] == 2);
  }
}

TEST_CASE("a buffer of zero bytes holds no memory") {
  Buffer b(Device::cpu, 0);
  CHECK_FALSE(b);
  CHECK(b.data() == nullptr);
  CHECK(b.bytes() == 0);
  Buffer d;
  CHECK_FALSE(d);
}

TEST_CASE("views of a buffer start at their byte offset and cannot reach past its end") {
  Buffer b(Device::cpu, 256);
  TensorView whole = b.view(DType::f32, {64});
  CHECK(whole.data == b.data());
  CHECK(whole.device == Device::cpu);
  TensorView at = b.view(DType::bf16, {4, 8}, 100);
  CHECK(at.data == static_cast<char*>(b.data()) + 100);
  CHECK(at.shape == Shape{4, 8});
  CHECK(at.dtype == DType::bf16);
  CHECK(at.contiguous());
  CHECK_NOTHROW(b.view(DType::f32, {16}, 192));
  CHECK_THROWS_WITH_AS(b.view(DType::f32, {16}, 196), doctest::Contains("view of 260 bytes exceeds a buffer of 256"),
                       Error);
  CHECK_THROWS_AS(b.view(DType::f32, {65}), Error);
}

TEST_CASE("moving a buffer hands over its memory and leaves the source empty") {
  Buffer a(Device::cpu, 128);
  void* p = a.data();
  Buffer b(std::move(a));
  CHECK(b.data() == p);
  CHECK(b.bytes() == 128);
  CHECK_FALSE(a);  // the moved-from state is specified
  CHECK(a.bytes() == 0);

  Buffer c(Device::cpu, 32);
  c = std::move(b);
  CHECK(c.data() == p);
  CHECK(c.bytes() == 128);
  CHECK_FALSE(b);
}

TEST_CASE("a device buffer in a build without CUDA is an error") {
#ifdef KILN_WITH_CUDA
  KILN_SKIP_TEST("this build has CUDA");
#else
  CHECK_THROWS_WITH_AS(Buffer(Device::cuda, 16), doctest::Contains("built without CUDA"), Error);
#endif
}
