// Llama's ops on the CUDA backend against the CPU reference (bf16 rounding emulated), on random
// data at awkward sizes, every output poisoned first: RMSNorm, rotary embeddings, SwiGLU, and
// grouped-query attention through kiln's kernels and through cuDNN (forward, backward, decode).
// Tolerances (relative L2): bf16 outputs 1e-2; f32 statistics 1e-5; f32 gradients 1e-3.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "kiln/ops/backend.hpp"
#include "op_harness.hpp"

using namespace kiln;
using namespace kiln::test;

TEST_CASE("cuda rmsnorm forward and backward match the CPU") {
  auto p = backend_pair();
  KILN_REQUIRE_GPU(p);
  const int N = 333;
  for (int C : {72, 75, 2048}) {
    INFO("C = " << C);
    auto x = act(p, {N, C}, 131, 2.0f, 0.5f);
    auto w = act(p, {C}, 132, 0.3f, 1.0f);
    auto out = poisoned(p, Kind::act, {N, C});
    auto rstd = poisoned(p, Kind::f32, {N});
    on_both(p, [&](const Side& s) { s.b().rmsnorm_forward({s(out), s(rstd), s(x), s(w), 1e-5f}); });
    KILN_CHECK_CLOSE(out, 1e-2);
    KILN_CHECK_CLOSE(rstd, 1e-5);
    rstd.set(rstd.cpu_values());  // the backward from the same statistics on both sides
    auto dout = act(p, {N, C}, 134);
    auto dx = act(p, {N, C}, 135);  // non-zero start: dx is accumulated
    auto dw = f32(p, {C}, 136);
    on_both(p, [&](const Side& s) { s.b().rmsnorm_backward({s(dx), s(dw), s(dout), s(x), s(w), s(rstd)}); });
    KILN_CHECK_CLOSE(dx, 1e-2);
    KILN_CHECK_CLOSE(dw, 1e-3);
  }
}

TEST_CASE("cuda rope matches the CPU, forward and inverse, at long positions") {
  auto p = backend_pair();
  KILN_REQUIRE_GPU(p);
  const int B = 3, T = 37, heads = 15;
  // Rotated heads: fewer than one thread's group of 8, and two groups, the second partial.
  for (int rotated : {5, 13})
  for (int D : {8, 64, 128}) {
    INFO("D = " << D << " rotated = " << rotated);
    auto x = act(p, {B, T, heads, D}, 140 + D + rotated);
    for (bool inverse : {false, true}) {
      on_both(p, [&](const Side& s) { s.b().rope({s(x), rotated, 500000.0f, 4000, inverse}); });
      KILN_CHECK_CLOSE(x, 1e-2);
      x.set(x.cpu_values());  // the next pass starts from the same values on both
    }
  }
}

TEST_CASE("cuda rope with llama3 scaling matches the CPU") {
  auto p = backend_pair();
  KILN_REQUIRE_GPU(p);
  const int B = 2, T = 301, heads = 12;
  const ops::RopeScaling s{32.0f, 1.0f, 4.0f, 8192.0f};  // Llama 3.2's
  for (int D : {6, 64}) {
    INFO("D = " << D);
    auto x = act(p, {B, T, heads, D}, 170 + D);
    for (bool inverse : {false, true}) {
      on_both(p, [&](const Side& side) { side.b().rope({side(x), 10, 500000.0f, 7000, inverse, s}); });
      KILN_CHECK_CLOSE(x, 1e-2);
      x.set(x.cpu_values());
    }
  }
}

TEST_CASE("cuda swiglu forward and backward match the CPU") {
  auto p = backend_pair();
  KILN_REQUIRE_GPU(p);
  const int N = 129;
  for (int F : {88, 1001}) {
    INFO("F = " << F);
    auto x = act(p, {N, 2 * F}, 150 + F, 3.0f);
    auto out = poisoned(p, Kind::act, {N, F});
    on_both(p, [&](const Side& s) { s.b().swiglu_forward({s(out), s(x)}); });
    KILN_CHECK_CLOSE(out, 1e-2);
    auto dout = act(p, {N, F}, 151 + F);
    auto dx = poisoned(p, Kind::act, {N, 2 * F});
    on_both(p, [&](const Side& s) { s.b().swiglu_backward({s(dx), s(dout), s(x)}); });
    KILN_CHECK_CLOSE(dx, 1e-2);
  }
}

namespace {

struct AttentionCase {
  int B, T, H, K, D;
  float dropout;
};

// Grouped-query attention on `p`'s GPU backend against the CPU: forward, backward and (without
// dropout) decode.
void check_grouped_attention(BackendPair& p, const AttentionCase& c) {
  INFO("B=" << c.B << " T=" << c.T << " H=" << c.H << " K=" << c.K << " D=" << c.D << " p=" << c.dropout);
  const int W = c.H + 2 * c.K;
  auto qkv = act(p, {c.B, c.T, W, c.D}, 160 + c.T, 1.5f);
  auto out = poisoned(p, Kind::act, {c.B, c.T, c.H, c.D});
  auto lse = poisoned(p, Kind::f32, {c.B, c.H, c.T});
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  const rng::PhiloxArgs r{0x5eed, 3, nullptr};
  on_both(p, [&](const Side& s) {
    ops::AttentionForward a{s(out), s(lse), s(qkv), scale, c.dropout, r};
    a.kv_heads = c.K;
    s.b().attention_forward(a);
  });
  KILN_CHECK_CLOSE(out, 1e-2);
  KILN_CHECK_CLOSE(lse, 1e-4);
  out.set(out.cpu_values());
  lse.set(lse.cpu_values());
  auto dout = act(p, {c.B, c.T, c.H, c.D}, 170 + c.T);
  auto dqkv = poisoned(p, Kind::act, {c.B, c.T, W, c.D});
  on_both(p, [&](const Side& s) {
    ops::AttentionBackward a{s(dqkv), s(dout), s(out), s(lse), s(qkv), scale, c.dropout, r};
    a.kv_heads = c.K;
    s.b().attention_backward(a);
  });
  KILN_CHECK_CLOSE(dqkv, 1e-2);
  if (c.dropout > 0) return;
  const int length = c.T - 3;
  auto dec = poisoned(p, Kind::act, {c.B, c.H, c.D});
  on_both(p, [&](const Side& s) {
    ops::AttentionDecode a{s(dec), s(qkv), length, scale};
    a.kv_heads = c.K;
    s.b().attention_decode(a);
  });
  KILN_CHECK_CLOSE(dec, 1e-2);
}

}  // namespace

TEST_CASE("cuda grouped-query attention (kiln's kernels) matches the CPU: forward, backward, decode") {
  auto p = backend_pair({.attention = ops::AttentionImpl::kiln});
  KILN_REQUIRE_GPU(p);
  // Groups of 4, multi-query (K = 1), K = H through the grouped layout; awkward T; dropout too.
  for (const AttentionCase c : {AttentionCase{2, 77, 8, 2, 64, 0.0f}, AttentionCase{1, 130, 4, 1, 128, 0.0f},
                                AttentionCase{2, 45, 6, 6, 32, 0.0f}, AttentionCase{2, 64, 8, 2, 64, 0.1f}})
    check_grouped_attention(p, c);
}

TEST_CASE("cuda grouped-query attention (cuDNN, deterministic and atomic dQ) matches the CPU") {
  for (bool deterministic : {true, false}) {
    INFO("deterministic " << deterministic);
    auto p = cudnn_pair(deterministic);
    KILN_REQUIRE_GPU(p);
    // Groups of 4 and 3, multi-query, Llama 3.2 1B's heads (32 / 8 of 64).
    for (const AttentionCase c : {AttentionCase{2, 77, 8, 2, 64, 0.0f}, AttentionCase{1, 130, 4, 1, 128, 0.0f},
                                  AttentionCase{3, 33, 6, 2, 32, 0.0f}, AttentionCase{1, 300, 32, 8, 64, 0.0f}})
      check_grouped_attention(p, c);
  }
}
