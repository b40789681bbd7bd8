#pragma once
// bfloat16 conversions shared by host and device code. Round-to-nearest-even like the CUDA
// intrinsic __float2bfloat16_rn; NaN stays NaN (quiet). The CPU backend uses these to emulate the
// rounding the CUDA backend does when it stores bf16.
#include <cstdint>
#include <cstring>

#include "kiln/tensor/hd.hpp"

namespace kiln {

KILN_HD std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

KILN_HD float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

KILN_HD std::uint16_t float_to_bf16_bits(float f) {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

KILN_HD float bf16_bits_to_float(std::uint16_t b) { return bits_float(static_cast<std::uint32_t>(b) << 16); }

KILN_HD float round_bf16(float f) { return bf16_bits_to_float(float_to_bf16_bits(f)); }

// A host-side bf16 value (storage only; arithmetic goes through float).
struct bf16 {
  std::uint16_t bits = 0;
  bf16() = default;
  KILN_HD explicit bf16(float f) : bits(float_to_bf16_bits(f)) {}
  KILN_HD explicit operator float() const { return bf16_bits_to_float(bits); }
};

}  // namespace kiln
