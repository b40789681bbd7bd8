#pragma once
// The two FP8 formats and the scalar formulas both the CPU emulation and the CUDA kernels use, so
// that they agree bit for bit:
//  - E4M3 ("fn": no infinities, S.1111.111 is NaN, max 448) and E5M2 (IEEE-like, max 57344).
//  - encode(): round to nearest even with saturation to the largest finite value, NaN -> 0x7F.
//    This is what the hardware's `cvt.rn.satfinite.{e4m3,e5m2}x2.f32` (and so
//    __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)) returns; the CUDA kernels use that instruction
//    and the GPU tests compare it against this function over every bf16 bit pattern.
//  - compute_scale(): the scale that maps an amax to fp8_max / 2^margin, keeping the previous scale
//    when the amax is zero or not finite.
#include <cstdint>

#include "kiln/tensor/bf16.hpp"
#include "kiln/tensor/dtype.hpp"
#include "kiln/tensor/hd.hpp"

namespace kiln::fp8 {

enum class Format : std::uint8_t { e4m3, e5m2 };

constexpr DType dtype_of(Format f) { return f == Format::e4m3 ? DType::e4m3 : DType::e5m2; }
constexpr const char* name_of(Format f) { return f == Format::e4m3 ? "e4m3" : "e5m2"; }

KILN_HD float max_value(Format f) { return f == Format::e4m3 ? 448.0f : 57344.0f; }

namespace detail {
KILN_HD int mantissa_bits(Format f) { return f == Format::e4m3 ? 3 : 2; }
KILN_HD int exponent_bias(Format f) { return f == Format::e4m3 ? 7 : 15; }
KILN_HD std::uint32_t max_code(Format f) { return f == Format::e4m3 ? 0x7eu : 0x7bu; }

// v / 2^s rounded to nearest, ties to even; 1 <= s <= 31.
KILN_HD std::uint32_t shift_rne(std::uint32_t v, int s) {
  const std::uint32_t q = v >> s;
  const std::uint32_t rest = v & ((1u << s) - 1u);
  const std::uint32_t half = 1u << (s - 1);
  return q + ((rest > half || (rest == half && (q & 1u))) ? 1u : 0u);
}

// 2^e as a float for -126 <= e <= 127, exactly.
KILN_HD float pow2(int e) { return bits_float(static_cast<std::uint32_t>(127 + e) << 23); }

KILN_HD bool finite(float x) { return (float_bits(x) & 0x7f800000u) != 0x7f800000u; }
}  // namespace detail

// float -> FP8 bits: round to nearest even, saturating (|x| > max -> +-max, infinities included);
// NaN -> 0x7F whatever its sign; the sign of zero is kept.
KILN_HD std::uint8_t encode(float x, Format f) {
  const std::uint32_t u = float_bits(x);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;
  const std::uint32_t sign = (u >> 24) & 0x80u;
  const int M = detail::mantissa_bits(f);
  const int bias = detail::exponent_bias(f);
  const int emin = 1 - bias;                 // exponent of the smallest normal
  const int e = static_cast<int>(a >> 23) - 127;  // f32 zeros and subnormals give -127
  std::uint32_t code;
  if (e >= emin) {
    if (e > bias + 1) return static_cast<std::uint8_t>(sign | detail::max_code(f));  // far above the range
    // The FP8 exponent field above the f32 mantissa; one rounding shift carries into the exponent.
    const std::uint32_t v = (static_cast<std::uint32_t>(e + bias) << 23) | (a & 0x7fffffu);
    code = detail::shift_rne(v, 23 - M);
  } else if ((a >> 23) == 0) {
    code = 0;  // f32 zero or subnormal: far below half the smallest FP8 subnormal
  } else {
    // Subnormal FP8: the code is the value in units of 2^(emin - M), rounded.
    const std::uint32_t sig = (a & 0x7fffffu) | 0x800000u;  // value = sig * 2^(e - 23)
    const int s = 23 + emin - M - e;
    code = s >= 32 ? 0u : detail::shift_rne(sig, s);
  }
  if (code > detail::max_code(f)) code = detail::max_code(f);
  return static_cast<std::uint8_t>(sign | code);
}

// FP8 bits -> float (exact).
KILN_HD float decode(std::uint8_t c, Format f) {
  const std::uint32_t sign = static_cast<std::uint32_t>(c & 0x80u) << 24;
  const std::uint32_t m7 = c & 0x7fu;
  const int M = detail::mantissa_bits(f);
  const int bias = detail::exponent_bias(f);
  const std::uint32_t E = m7 >> M, m = m7 & ((1u << M) - 1u);
  if (f == Format::e4m3 && m7 == 0x7fu) return bits_float(0x7fc00000u);
  if (f == Format::e5m2 && E == 31u) return bits_float(m == 0 ? (sign | 0x7f800000u) : 0x7fc00000u);
  if (E == 0) {
    const float v = static_cast<float>(m) * detail::pow2(1 - bias - M);
    return sign ? -v : v;
  }
  return bits_float(sign | ((E - static_cast<std::uint32_t>(bias) + 127u) << 23) | (m << (23 - M)));
}

// Quantisation of one value: encode(x * scale) with a correctly rounded f32 product.
KILN_HD std::uint8_t quantize(float x, float scale, Format f) {
#if defined(__CUDA_ARCH__)
  return encode(__fmul_rn(x, scale), f);
#else
  return encode(x * scale, f);
#endif
}

// |x| as bits: for non-negative floats the bit order is the numeric order and NaN sorts above
// infinity, so max over these bits is a NaN-propagating, order-independent amax.
KILN_HD std::uint32_t abs_bits(float x) { return float_bits(x) & 0x7fffffffu; }
KILN_HD float amax_max(float a, float b) { return float_bits(a) >= float_bits(b) ? a : b; }  // a, b >= 0 or NaN

// The scale for a tensor whose absolute maximum is `amax`: fp8_max / amax / 2^margin. A zero or
// non-finite amax (or a non-finite or zero result) keeps `previous`.
KILN_HD float compute_scale(float fp8_max, float amax, int margin, float previous) {
  if (!(amax > 0.0f) || !detail::finite(amax)) return previous;
#if defined(__CUDA_ARCH__)
  const float s = __fmul_rn(__fdiv_rn(fp8_max, amax), detail::pow2(-margin));
#else
  const float s = (fp8_max / amax) * detail::pow2(-margin);
#endif
  if (!(s > 0.0f) || !detail::finite(s)) return previous;
  return s;
}

KILN_HD float reciprocal(float s) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(s);
#else
  return 1.0f / s;
#endif
}

}  // namespace kiln::fp8
