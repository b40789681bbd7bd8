// The FP8 encode/decode emulation: known values, round-to-nearest-even ties, saturation, NaN and
// infinities, subnormals, and an independent brute-force reference (the nearest of all 256 codes).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kiln/fp8/format.hpp"

using namespace kiln;
using fp8::Format;

namespace {

std::uint8_t e4(float x) { return fp8::encode(x, Format::e4m3); }
std::uint8_t e5(float x) { return fp8::encode(x, Format::e5m2); }

// Independent reference: the finite code nearest to x (ties to the code with an even mantissa, i.e.
// an even code), saturating to the largest finite value; NaN -> 0x7F.
std::uint8_t reference_encode(float x, Format f) {
  if (std::isnan(x)) return 0x7f;
  const bool neg = std::signbit(x);
  const double a = std::fabs(static_cast<double>(x));
  const double maxv = fp8::max_value(f);
  std::uint8_t best = 0;
  double best_d = INFINITY;
  if (a >= maxv) {
    best = f == Format::e4m3 ? 0x7e : 0x7b;
  } else {
    for (int c = 0; c < 128; ++c) {
      const float v = fp8::decode(static_cast<std::uint8_t>(c), f);
      if (!std::isfinite(v)) continue;
      const double d = std::fabs(static_cast<double>(v) - a);
      if (d < best_d || (d == best_d && (c & 1) == 0)) {
        best_d = d;
        best = static_cast<std::uint8_t>(c);
      }
    }
  }
  return static_cast<std::uint8_t>(best | (neg ? 0x80 : 0));
}

}  // namespace

TEST_CASE("E4M3 known values") {
  CHECK(e4(0.0f) == 0x00);
  CHECK(e4(-0.0f) == 0x80);
  CHECK(e4(1.0f) == 0x38);
  CHECK(e4(-1.0f) == 0xb8);
  CHECK(e4(1.125f) == 0x39);
  CHECK(e4(2.0f) == 0x40);
  CHECK(e4(0.5f) == 0x30);
  CHECK(e4(448.0f) == 0x7e);
  CHECK(e4(-448.0f) == 0xfe);
  CHECK(e4(416.0f) == 0x7d);
  CHECK(e4(std::ldexp(1.0f, -6)) == 0x08);  // smallest normal
  CHECK(e4(std::ldexp(1.0f, -9)) == 0x01);  // smallest subnormal
  CHECK(e4(std::ldexp(7.0f, -9)) == 0x07);  // largest subnormal
  CHECK(e4(std::ldexp(3.0f, -9)) == 0x03);
  CHECK(fp8::decode(0x7e, Format::e4m3) == 448.0f);
  CHECK(fp8::decode(0x01, Format::e4m3) == std::ldexp(1.0f, -9));
  CHECK(fp8::decode(0x38, Format::e4m3) == 1.0f);
  CHECK(fp8::decode(0xb9, Format::e4m3) == -1.125f);
  CHECK(std::isnan(fp8::decode(0x7f, Format::e4m3)));
  CHECK(std::isnan(fp8::decode(0xff, Format::e4m3)));
  CHECK(std::signbit(fp8::decode(0x80, Format::e4m3)));
}

TEST_CASE("E5M2 known values") {
  CHECK(e5(0.0f) == 0x00);
  CHECK(e5(-0.0f) == 0x80);
  CHECK(e5(1.0f) == 0x3c);
  CHECK(e5(1.25f) == 0x3d);
  CHECK(e5(-2.0f) == 0xc0);
  CHECK(e5(57344.0f) == 0x7b);
  CHECK(e5(49152.0f) == 0x7a);
  CHECK(e5(std::ldexp(1.0f, -14)) == 0x04);  // smallest normal
  CHECK(e5(std::ldexp(1.0f, -16)) == 0x01);  // smallest subnormal
  CHECK(e5(std::ldexp(3.0f, -16)) == 0x03);
  CHECK(fp8::decode(0x7b, Format::e5m2) == 57344.0f);
  CHECK(fp8::decode(0x7c, Format::e5m2) == INFINITY);
  CHECK(fp8::decode(0xfc, Format::e5m2) == -INFINITY);
  CHECK(std::isnan(fp8::decode(0x7d, Format::e5m2)));
  CHECK(std::isnan(fp8::decode(0xff, Format::e5m2)));
  CHECK(fp8::decode(0x01, Format::e5m2) == std::ldexp(1.0f, -16));
}

TEST_CASE("round to nearest even at ties, normal and subnormal") {
  // E4M3 around 1: spacing 1/8.
  CHECK(e4(1.0625f) == 0x38);  // halfway 1 .. 1.125: even (1.0)
  CHECK(e4(1.1875f) == 0x3a);  // halfway 1.125 .. 1.25: even (1.25)
  CHECK(e4(std::nextafter(1.0625f, 2.0f)) == 0x39);
  CHECK(e4(std::nextafter(1.0625f, 0.0f)) == 0x38);
  CHECK(e4(-1.0625f) == 0xb8);
  // A carry into the exponent: halfway 1.875 .. 2 rounds to 2.
  CHECK(e4(1.9375f) == 0x40);
  // Subnormals: units of 2^-9.
  CHECK(e4(std::ldexp(0.5f, -9)) == 0x00);  // halfway 0 .. 1 unit: even (0)
  CHECK(e4(std::ldexp(1.5f, -9)) == 0x02);
  CHECK(e4(std::ldexp(2.5f, -9)) == 0x02);
  CHECK(e4(std::ldexp(7.5f, -9)) == 0x08);  // rounds up into the smallest normal
  CHECK(e4(std::nextafter(std::ldexp(0.5f, -9), 1.0f)) == 0x01);
  CHECK(e4(-std::ldexp(0.5f, -9)) == 0x80);  // the sign of a flushed value stays
  // E5M2 around 1: spacing 1/4.
  CHECK(e5(1.125f) == 0x3c);
  CHECK(e5(1.375f) == 0x3e);
  CHECK(e5(std::ldexp(0.5f, -16)) == 0x00);
  CHECK(e5(std::ldexp(1.5f, -16)) == 0x02);
  CHECK(e5(std::ldexp(3.5f, -16)) == 0x04);
}

TEST_CASE("saturation to the largest finite value, infinities included") {
  for (float v : {449.0f, 464.0f, 465.0f, 480.0f, 1e6f, 3e38f, INFINITY}) {
    INFO(v);
    CHECK(e4(v) == 0x7e);
    CHECK(e4(-v) == 0xfe);
  }
  for (float v : {57345.0f, 59392.0f, 61440.0f, 1e9f, INFINITY}) {
    INFO(v);
    CHECK(e5(v) == 0x7b);
    CHECK(e5(-v) == 0xfb);
  }
}

TEST_CASE("NaN encodes to 0x7F in both formats, whatever its sign or payload") {
  const float nans[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::signaling_NaN(), bits_float(0x7f800001u), bits_float(0xffc12345u)};
  for (float n : nans) {
    CHECK(e4(n) == 0x7f);
    CHECK(e5(n) == 0x7f);
  }
}

TEST_CASE("f32 subnormals and tiny values flush to signed zero") {
  for (float v : {std::numeric_limits<float>::denorm_min(), 1e-39f, 1e-30f, std::ldexp(1.0f, -20)}) {
    CHECK(e4(v) == 0x00);
    CHECK(e4(-v) == 0x80);
  }
  CHECK(e5(std::ldexp(1.0f, -20)) == 0x00);
  CHECK(e5(-1e-39f) == 0x80);
}

TEST_CASE("every finite code decodes and re-encodes to itself") {
  for (Format f : {Format::e4m3, Format::e5m2})
    for (int c = 0; c < 256; ++c) {
      const float v = fp8::decode(static_cast<std::uint8_t>(c), f);
      if (!std::isfinite(v)) continue;
      INFO(fp8::name_of(f) << " code " << c);
      CHECK(fp8::encode(v, f) == c);
    }
}

TEST_CASE("encode matches a brute-force nearest-code search on random floats, midpoints and boundaries") {
  std::mt19937_64 gen(12345);
  std::vector<float> xs;
  for (int i = 0; i < 200000; ++i) {
    // Random bit patterns concentrated on the exponent range that matters (2^-20 .. 2^18).
    const std::uint32_t exp = 107 + static_cast<std::uint32_t>(gen() % 38);
    xs.push_back(bits_float((static_cast<std::uint32_t>(gen() & 1) << 31) | (exp << 23) |
                            static_cast<std::uint32_t>(gen() & 0x7fffff)));
  }
  for (Format f : {Format::e4m3, Format::e5m2})
    for (int c = 0; c < 127; ++c) {  // midpoints between neighbouring codes and their neighbours
      const float a = fp8::decode(static_cast<std::uint8_t>(c), f), b = fp8::decode(static_cast<std::uint8_t>(c + 1), f);
      if (!std::isfinite(a) || !std::isfinite(b)) continue;
      const float mid = static_cast<float>((static_cast<double>(a) + b) / 2);
      for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY), a, b}) {
        xs.push_back(v);
        xs.push_back(-v);
      }
    }
  int bad = 0;
  for (Format f : {Format::e4m3, Format::e5m2})
    for (float x : xs)
      if (fp8::encode(x, f) != reference_encode(x, f) && ++bad <= 5)
        FAIL_CHECK(fp8::name_of(f) << " x=" << x << " encode " << int(fp8::encode(x, f)) << " reference "
                                   << int(reference_encode(x, f)));
  CHECK(bad == 0);
}

TEST_CASE("quantize multiplies by the scale with one f32 rounding before encoding") {
  CHECK(fp8::quantize(100.0f, 4.0f, Format::e4m3) == fp8::encode(400.0f, Format::e4m3));
  CHECK(fp8::quantize(1.0f, 1e6f, Format::e4m3) == 0x7e);
  CHECK(fp8::quantize(-3.0f, 0.5f, Format::e5m2) == fp8::encode(-1.5f, Format::e5m2));
}

TEST_CASE("compute_scale: fp8_max / amax / 2^margin, a zero or non-finite amax keeps the previous scale") {
  CHECK(fp8::compute_scale(448.0f, 2.0f, 0, 1.0f) == 224.0f);
  CHECK(fp8::compute_scale(448.0f, 2.0f, 1, 1.0f) == 112.0f);
  CHECK(fp8::compute_scale(57344.0f, 0.001f, 3, 1.0f) == (57344.0f / 0.001f) / 8.0f);
  CHECK(fp8::compute_scale(448.0f, 0.0f, 0, 7.0f) == 7.0f);
  CHECK(fp8::compute_scale(448.0f, INFINITY, 0, 7.0f) == 7.0f);
  CHECK(fp8::compute_scale(448.0f, NAN, 0, 7.0f) == 7.0f);
  CHECK(fp8::compute_scale(448.0f, 1e-44f, 0, 7.0f) == 7.0f);  // the scale would overflow
  CHECK(fp8::amax_max(1.0f, 2.0f) == 2.0f);
  CHECK(std::isnan(fp8::amax_max(NAN, 2.0f)));
  CHECK(std::isnan(fp8::amax_max(2.0f, NAN)));
}
