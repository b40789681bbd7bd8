#pragma once
// Byte counts rounded up for carving aligned operands out of one scratch area.
#include <cstddef>

namespace kiln::fp8 {

constexpr std::size_t round256(std::size_t n) { return (n + 255) / 256 * 256; }

}  // namespace kiln::fp8
