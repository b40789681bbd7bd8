#pragma once
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) and the
// draws kiln builds on it. Shared by host and device code, bit-identical on both: every float
// operation below is correctly rounded IEEE (explicit fma, no contraction, IEEE division/sqrt).
//
// A state is two integers: key = seed, counter = offset. Element n of a draw from state
// (seed, offset) comes from the Philox block at counter offset + n/4, word n%4; a draw of N
// elements advances the offset by ceil(N/4). Because an element depends only on (state, n), a
// tensor split across ranks draws, shard by shard, exactly what the whole tensor would draw.
#include <cstdint>

#include "kiln/tensor/bf16.hpp"
#include "kiln/tensor/hd.hpp"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace kiln::rng {

struct Philox4 {
  std::uint32_t v[4];
};

KILN_HD void mulhilo32(std::uint32_t a, std::uint32_t b, std::uint32_t& hi, std::uint32_t& lo) {
  std::uint64_t p = static_cast<std::uint64_t>(a) * b;
  hi = static_cast<std::uint32_t>(p >> 32);
  lo = static_cast<std::uint32_t>(p);
}

KILN_HD Philox4 philox4x32_10(Philox4 ctr, std::uint32_t k0, std::uint32_t k1) {
  constexpr std::uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    std::uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(M0, ctr.v[0], hi0, lo0);
    mulhilo32(M1, ctr.v[2], hi1, lo1);
    ctr = Philox4{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += W0;
    k1 += W1;
  }
  return ctr;
}

// The 4 words of block `block` of the stream keyed by `seed`.
KILN_HD Philox4 philox_block(std::uint64_t seed, std::uint64_t block) {
  Philox4 ctr{{static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32), 0u, 0u}};
  return philox4x32_10(ctr, static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
}

KILN_HD std::uint64_t blocks_for(std::uint64_t n) { return (n + 3) / 4; }

// Word n of the draw starting at `offset`.
KILN_HD std::uint32_t philox_u32(std::uint64_t seed, std::uint64_t offset, std::uint64_t n) {
  return philox_block(seed, offset + n / 4).v[n % 4];
}

// Uniform in [0, 1) with 24 random bits (exact in float).
KILN_HD float u32_to_uniform(std::uint32_t x) { return static_cast<float>(x >> 8) * (1.0f / 16777216.0f); }
// Uniform in (0, 1], safe for log().
KILN_HD float u32_to_uniform_pos(std::uint32_t x) { return static_cast<float>((x >> 8) + 1) * (1.0f / 16777216.0f); }

// Dropout keeps an element when its 24-bit uniform is >= p; the threshold is computed once.
KILN_HD std::uint32_t dropout_threshold(float p) {
  float t = p * 16777216.0f;
  return t >= 16777216.0f ? 16777216u : static_cast<std::uint32_t>(t + 0.5f);
}
KILN_HD bool dropout_keep(std::uint32_t x, std::uint32_t threshold) { return (x >> 8) >= threshold; }

// ---- correctly rounded building blocks (never contracted into FMAs behind our back) ----
KILN_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KILN_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KILN_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
KILN_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
KILN_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// Natural log for x in (0, 1]: x = m * 2^e with m in [sqrt(1/2), sqrt(2)), log m by the atanh
// series in s = (m - 1) / (m + 1), |s| < 0.172 (error below 1e-9 before rounding).
KILN_HD float portable_log(float x) {
  std::uint32_t u = float_bits(x);
  int e = static_cast<int>((u >> 23) & 0xff) - 127;
  float m = bits_float((u & 0x007fffffu) | 0x3f800000u);  // [1, 2)
  if (m > 1.41421356f) {
    m = mul_rn(m, 0.5f);
    e += 1;
  }
  float s = div_rn(add_rn(m, -1.0f), add_rn(m, 1.0f));
  float s2 = mul_rn(s, s);
  float p = fma_rn(s2, 1.0f / 9.0f, 1.0f / 7.0f);
  p = fma_rn(p, s2, 1.0f / 5.0f);
  p = fma_rn(p, s2, 1.0f / 3.0f);
  p = fma_rn(p, s2, 1.0f);
  float log_m = mul_rn(mul_rn(2.0f, s), p);
  return fma_rn(static_cast<float>(e), 0.69314718056f, log_m);
}

// sin and cos of 2*pi*u for u in [0, 1): quadrant reduction, then Taylor polynomials on [0, pi/2).
KILN_HD void portable_sincos_2pi(float u, float& s, float& c) {
  float t = mul_rn(u, 4.0f);  // exact
  int q = static_cast<int>(t);
  float r = add_rn(t, -static_cast<float>(q));  // exact, [0, 1)
  float x = mul_rn(r, 1.57079632679f);
  float x2 = mul_rn(x, x);
  float ps = fma_rn(x2, -1.0f / 39916800.0f, 1.0f / 362880.0f);
  ps = fma_rn(ps, x2, -1.0f / 5040.0f);
  ps = fma_rn(ps, x2, 1.0f / 120.0f);
  ps = fma_rn(ps, x2, -1.0f / 6.0f);
  ps = fma_rn(ps, x2, 1.0f);
  float sx = mul_rn(ps, x);
  float pc = fma_rn(x2, 1.0f / 479001600.0f, -1.0f / 3628800.0f);
  pc = fma_rn(pc, x2, 1.0f / 40320.0f);
  pc = fma_rn(pc, x2, -1.0f / 720.0f);
  pc = fma_rn(pc, x2, 1.0f / 24.0f);
  pc = fma_rn(pc, x2, -0.5f);
  float cx = fma_rn(pc, x2, 1.0f);
  switch (q & 3) {
    case 0: s = sx; c = cx; break;
    case 1: s = cx; c = -sx; break;
    case 2: s = -sx; c = -cx; break;
    default: s = -cx; c = sx; break;
  }
}

// Standard normal element n of the draw at `offset` (Box-Muller on words 2k, 2k+1 of a block).
KILN_HD float philox_normal(std::uint64_t seed, std::uint64_t offset, std::uint64_t n) {
  Philox4 b = philox_block(seed, offset + n / 4);
  unsigned lane = static_cast<unsigned>(n % 4);
  unsigned pair = lane / 2;
  float u1 = u32_to_uniform_pos(b.v[2 * pair]);
  float u2 = u32_to_uniform(b.v[2 * pair + 1]);
  float radius = sqrt_rn(mul_rn(-2.0f, portable_log(u1)));
  float s, c;
  portable_sincos_2pi(u2, s, c);
  return mul_rn(radius, (lane & 1) ? s : c);
}

KILN_HD float philox_uniform(std::uint64_t seed, std::uint64_t offset, std::uint64_t n) {
  return u32_to_uniform(philox_u32(seed, offset, n));
}

// What a kernel needs to draw: the stream and where this draw starts. In graph-safe mode the
// offset is read from device memory (offset_ptr) so a replayed CUDA graph draws fresh numbers.
struct PhiloxArgs {
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  const std::uint64_t* offset_ptr = nullptr;
  KILN_HD std::uint64_t start() const { return offset_ptr ? *offset_ptr + offset : offset; }
};

}  // namespace kiln::rng
