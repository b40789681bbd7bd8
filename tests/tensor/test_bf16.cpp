// bfloat16 conversions: round to nearest with ties to even, NaN kept quiet, infinities, the
// boundaries of the bf16 range, subnormals and signed zeros.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <ios>
#include <limits>
#include <random>

#include "kiln/tensor/bf16.hpp"

using namespace kiln;

namespace {

// The nearest bf16 of a finite float, from first principles: of the two bf16 values around it
// (its upper half, and the next one away from zero), the closer; on a tie the even one. Past the
// largest bf16 the next value is infinity, which counts as 2^128 (the next power in the sequence).
std::uint16_t reference_bf16(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t lo = u & 0xffff0000u;
  const std::uint32_t hi = lo + 0x10000u;
  auto magnitude = [](std::uint32_t bits) {
    if ((bits & 0x7fffffffu) == 0x7f800000u) return std::ldexp(1.0, 128);
    return std::fabs(static_cast<double>(bits_float(bits)));
  };
  const double x = std::fabs(static_cast<double>(f));
  const double below = x - magnitude(lo), above = magnitude(hi) - x;
  if (below < above) return static_cast<std::uint16_t>(lo >> 16);
  if (above < below) return static_cast<std::uint16_t>(hi >> 16);
  return static_cast<std::uint16_t>(((lo >> 16) & 1u) ? hi >> 16 : lo >> 16);
}

bool is_nan_bits(std::uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

}  // namespace

TEST_CASE("values bf16 can hold convert exactly both ways") {
  for (float f : {0.0f, 1.0f, -2.0f, 0.5f, 1.5f, 3.0f, -0.375f, 65536.0f, 1.0f / 1024.0f}) {
    CHECK(round_bf16(f) == f);
    CHECK(static_cast<float>(bf16(f)) == f);
  }
  CHECK(bf16(1.0f).bits == 0x3f80);
  CHECK(bf16(-2.0f).bits == 0xc000);
  CHECK(bf16(1.5f).bits == 0x3fc0);
  CHECK(bf16_bits_to_float(0x4049) == 3.140625f);
}

TEST_CASE("a float halfway between two bf16 values rounds to the even one") {
  // Around 1: bf16 steps are 2^-7, so 1 + 2^-8 is halfway between 1 (even) and 1 + 2^-7 (odd).
  CHECK(round_bf16(1.0f + 0x1p-8f) == 1.0f);
  CHECK(round_bf16(1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);  // between 1 + 2^-7 (odd) and 1 + 2^-6 (even)
  CHECK(round_bf16(-(1.0f + 0x1p-8f)) == -1.0f);
  // Just off the tie, the nearer neighbour wins whichever is even.
  CHECK(round_bf16(std::nextafter(1.0f + 0x1p-8f, 2.0f)) == 1.0f + 0x1p-7f);
  CHECK(round_bf16(std::nextafter(1.0f + 3 * 0x1p-8f, 0.0f)) == 1.0f + 0x1p-7f);
  CHECK(float_to_bf16_bits(bits_float(0x3f808000u)) == 0x3f80);
  CHECK(float_to_bf16_bits(bits_float(0x3f818000u)) == 0x3f82);
  CHECK(float_to_bf16_bits(bits_float(0x3f807fffu)) == 0x3f80);
  CHECK(float_to_bf16_bits(bits_float(0x3f808001u)) == 0x3f81);
}

TEST_CASE("random floats round to the nearest bf16, ties to even") {
  std::mt19937 gen(20240917);
  std::uniform_int_distribution<std::uint32_t> any;
  int checked = 0;
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t u = any(gen);
    switch (i % 4) {  // a quarter each: any bits, exact ties, one below and one above a tie
      case 1: u = (u & 0xffff0000u) | 0x8000u; break;
      case 2: u = (u & 0xffff0000u) | 0x7fffu; break;
      case 3: u = (u & 0xffff0000u) | 0x8001u; break;
      default: break;
    }
    if ((u & 0x7f800000u) == 0x7f800000u) continue;  // NaN and infinities have cases of their own
    const float f = bits_float(u);
    const std::uint16_t got = float_to_bf16_bits(f), want = reference_bf16(f);
    if (got != want) {
      INFO("float bits 0x" << std::hex << u << ": got 0x" << got << ", want 0x" << want);
      CHECK(got == want);
      break;
    }
    ++checked;
  }
  CHECK(checked > 140000);
}

TEST_CASE("NaN converts to a quiet NaN of the same sign, never to infinity") {
  // A signalling NaN whose payload sits only in the low 16 bits would truncate to infinity.
  for (std::uint32_t u : {0x7fc00000u, 0x7f800001u, 0x7f80ffffu, 0x7fbfffffu, 0xff800001u, 0xffc12345u}) {
    const std::uint16_t b = float_to_bf16_bits(bits_float(u));
    INFO("float bits 0x" << std::hex << u << " -> 0x" << b);
    CHECK(is_nan_bits(static_cast<std::uint32_t>(b) << 16));
    CHECK((b & 0x40u) != 0);  // quiet
    CHECK((b & 0x8000u) == ((u >> 16) & 0x8000u));
    CHECK(std::isnan(round_bf16(bits_float(u))));
  }
}

TEST_CASE("infinities stay infinite and the largest floats round to infinity only past the bf16 boundary") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(float_to_bf16_bits(inf) == 0x7f80);
  CHECK(float_to_bf16_bits(-inf) == 0xff80);
  // The largest bf16 is 0x7f7f (3.3895314e38); halfway to the next power, 0x7f7f8000, is a tie
  // whose even neighbour is infinity.
  CHECK(float_to_bf16_bits(bits_float(0x7f7f0000u)) == 0x7f7f);
  CHECK(float_to_bf16_bits(bits_float(0x7f7f7fffu)) == 0x7f7f);
  CHECK(float_to_bf16_bits(bits_float(0x7f7f8000u)) == 0x7f80);
  CHECK(round_bf16(std::numeric_limits<float>::max()) == inf);
  CHECK(round_bf16(-std::numeric_limits<float>::max()) == -inf);
  CHECK(round_bf16(bits_float(0x7f7f7fffu)) == bits_float(0x7f7f0000u));
}

TEST_CASE("signed zeros, subnormals and the smallest normals round like any other value") {
  CHECK(float_to_bf16_bits(0.0f) == 0x0000);
  CHECK(float_to_bf16_bits(-0.0f) == 0x8000);
  CHECK(float_to_bf16_bits(bits_float(0x00000001u)) == 0x0000);  // the smallest float subnormal
  CHECK(float_to_bf16_bits(bits_float(0x00008000u)) == 0x0000);  // a tie: 0 is even
  CHECK(float_to_bf16_bits(bits_float(0x00018000u)) == 0x0002);  // a tie: 0x0001 is odd
  CHECK(float_to_bf16_bits(bits_float(0x00010000u)) == 0x0001);  // the smallest bf16 subnormal
  CHECK(float_to_bf16_bits(bits_float(0x807fffffu)) == 0x8080);  // the largest subnormal rounds up to -FLT_MIN
  CHECK(round_bf16(std::numeric_limits<float>::min()) == std::numeric_limits<float>::min());
}
