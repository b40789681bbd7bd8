#include <doctest/doctest.h>

#include <set>

#include "kiln/rng/philox.hpp"

using namespace kiln::rng;

// Known-answer vectors of Philox4x32-10 from Random123's kat_vectors.
TEST_CASE("philox4x32-10 matches the published known-answer vectors") {
  auto check = [](Philox4 ctr, std::uint32_t k0, std::uint32_t k1, Philox4 expect) {
    Philox4 got = philox4x32_10(ctr, k0, k1);
    for (int i = 0; i < 4; ++i) CHECK(got.v[i] == expect.v[i]);
  };
  check({{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}});
  check({{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}}, 0xffffffff, 0xffffffff,
        {{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}});
  check({{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}}, 0xa4093822, 0x299f31d0,
        {{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}});
}

TEST_CASE("a draw's element n depends only on the state and n") {
  // Element n of a draw at offset o equals element n - 4k of a draw at offset o + k.
  for (std::uint64_t n = 8; n < 40; ++n) CHECK(philox_u32(7, 100, n) == philox_u32(7, 102, n - 8));
  CHECK(philox_u32(7, 100, 0) != philox_u32(8, 100, 0));
  CHECK(blocks_for(0) == 0);
  CHECK(blocks_for(1) == 1);
  CHECK(blocks_for(8) == 2);
  CHECK(blocks_for(9) == 3);
}

TEST_CASE("uniforms are in range and dropout keeps about 1 - p") {
  int kept = 0;
  const int n = 100000;
  const auto thr = dropout_threshold(0.1f);
  for (int i = 0; i < n; ++i) {
    float u = philox_uniform(3, 0, i);
    CHECK((u >= 0.0f && u < 1.0f));
    kept += dropout_keep(philox_u32(3, 0, i), thr);
  }
  CHECK(kept / double(n) == doctest::Approx(0.9).epsilon(0.01));
  CHECK(dropout_threshold(0.0f) == 0u);
  CHECK(dropout_keep(0u, dropout_threshold(0.0f)));
}

TEST_CASE("portable log and sincos are accurate") {
  for (float x : {1e-7f, 0.001f, 0.3f, 0.5f, 0.7071f, 0.99f, 1.0f}) CHECK(portable_log(x) == doctest::Approx(std::log(x)).epsilon(1e-6));
  for (float u : {0.0f, 0.1f, 0.25f, 0.3f, 0.5f, 0.77f, 0.999f}) {
    float s, c;
    portable_sincos_2pi(u, s, c);
    CHECK(s == doctest::Approx(std::sin(2 * M_PI * u)).epsilon(1e-5).scale(1));
    CHECK(c == doctest::Approx(std::cos(2 * M_PI * u)).epsilon(1e-5).scale(1));
  }
}

TEST_CASE("normal draws have zero mean and unit variance") {
  double m = 0, s = 0;
  const int n = 400000;
  for (int i = 0; i < n; ++i) {
    double z = philox_normal(11, 0, i);
    m += z;
    s += z * z;
  }
  m /= n;
  CHECK(std::fabs(m) < 0.005);
  CHECK(std::sqrt(s / n - m * m) == doctest::Approx(1.0).epsilon(0.005));
}
