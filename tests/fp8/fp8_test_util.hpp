#pragma once
// Helpers shared by the FP8 suites: random data, bitwise comparisons and the reference products of
// dequantised values that the FP8 GEMMs are checked against.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kiln/fp8/format.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln_test.hpp"

namespace kiln::test {

// Amax histories: mostly positive values over a wide range, with zeros, infinities and NaNs mixed in.
inline std::vector<float> random_amaxes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> e(-30.0f, 30.0f);
  std::vector<float> v(n);
  for (auto& x : v) {
    const auto r = gen() % 100;
    x = r < 8 ? 0.0f : r == 8 ? INFINITY : r == 9 ? NAN : std::exp2(e(gen));
  }
  return v;
}

inline std::vector<float> normal_values(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = scale * d(gen);
  return v;
}

// What the FP8 pipeline sees of x: encode(x * scale) decoded and multiplied by 1/scale.
inline std::vector<float> fake_quantize(const std::vector<float>& x, float scale, fp8::Format f) {
  std::vector<float> out(x.size());
  const float inv = 1.0f / scale;
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = fp8::decode(fp8::quantize(x[i], scale, f), f) * inv;
  return out;
}

inline float max_abs(const std::vector<float>& x) {
  float m = 0;
  for (float v : x) m = std::max(m, std::fabs(v));
  return m;
}

// d[M, N] = a[M, K] @ b[N, K]^T in double.
inline std::vector<float> matmul_nt(const std::vector<float>& a, const std::vector<float>& b, int M, int N, int K) {
  std::vector<float> d(static_cast<std::size_t>(M) * N);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double acc = 0;
      for (int k = 0; k < K; ++k) acc += double(a[static_cast<std::size_t>(m) * K + k]) * b[static_cast<std::size_t>(n) * K + k];
      d[static_cast<std::size_t>(m) * N + n] = static_cast<float>(acc);
    }
  return d;
}

inline std::vector<float> transpose(const std::vector<float>& a, int rows, int cols) {
  std::vector<float> t(a.size());
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) t[static_cast<std::size_t>(c) * rows + r] = a[static_cast<std::size_t>(r) * cols + c];
  return t;
}

}  // namespace kiln::test
