// CPU attention_decode (one query over a KV cache) against the causal attention_forward, and its
// argument checks.
#include <doctest/doctest.h>

#include <vector>

#include "kiln/ops/backend.hpp"
#include "host_view.hpp"
#include "op_harness.hpp"

using namespace kiln;
using kiln::test::random_values;
using kiln::test::view;

TEST_CASE("attention_decode at length t equals row t-1 of the causal attention_forward") {
  auto b = ops::make_cpu_backend();
  const int B = 2, T = 37, H = 3, D = 20;
  const float scale = 0.3f;
  auto qkv = random_values(static_cast<std::size_t>(B) * T * 3 * H * D, 5, 1.5f);
  std::vector<float> out(B * T * H * D), lse(B * H * T);
  b->attention_forward({view(out, {B, T, H, D}), view(lse, {B, H, T}), view(qkv, {B, T, 3, H, D}), scale});
  for (int t : {1, 2, 17, 32, T}) {
    std::vector<float> dec(B * H * D, 1234.5f);
    b->attention_decode({view(dec, {B, H, D}), view(qkv, {B, T, 3, H, D}), t, scale});
    for (int s = 0; s < B; ++s)
      for (int i = 0; i < H * D; ++i) {
        INFO("length " << t << " sequence " << s << " element " << i);
        CHECK(dec[s * H * D + i] == doctest::Approx(out[(s * T + t - 1) * H * D + i]).epsilon(1e-6));
      }
  }
}

TEST_CASE("attention_decode with bf16 rounding stores bf16 values") {
  auto b = ops::make_cpu_backend({.round_bf16 = true});
  const int T = 9, H = 2, D = 8;
  auto qkv = random_values(static_cast<std::size_t>(T) * 3 * H * D, 6);
  std::vector<float> dec(H * D);
  b->attention_decode({view(dec, {1, H, D}), view(qkv, {1, T, 3, H, D}), 5, 0.5f});
  for (float v : dec) CHECK(v == round_bf16(v));
}

TEST_CASE("attention_decode rejects a length outside the cache and a mismatched output") {
  auto b = ops::make_cpu_backend();
  const int T = 4, H = 2, D = 8;
  std::vector<float> qkv(T * 3 * H * D, 0.5f), dec(H * D), wrong(H * (D + 1));
  CHECK_THROWS_WITH_AS(b->attention_decode({view(dec, {1, H, D}), view(qkv, {1, T, 3, H, D}), 0, 1.0f}),
                       doctest::Contains("attention_decode: length = 0 must be in [1, Tmax = 4]"), Error);
  CHECK_THROWS_WITH_AS(b->attention_decode({view(dec, {1, H, D}), view(qkv, {1, T, 3, H, D}), 5, 1.0f}),
                       doctest::Contains("length = 5"), Error);
  CHECK_THROWS_WITH_AS(b->attention_decode({view(wrong, {1, H, D + 1}), view(qkv, {1, T, 3, H, D}), 2, 1.0f}),
                       doctest::Contains("attention_decode out"), Error);
}
