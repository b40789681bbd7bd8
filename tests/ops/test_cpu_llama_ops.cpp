// Llama's ops on the CPU reference backend: RMSNorm, rotary embeddings, SwiGLU and grouped-query
// attention, each backward against central finite differences of its forward (the loss is
// L = sum(out * w) with fixed random weights w), and the forwards against direct formulas.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "kiln/ops/backend.hpp"
#include "kiln/ops/formulas.hpp"
#include "grad_check.hpp"
#include "op_harness.hpp"

using namespace kiln;
using namespace kiln::test;

namespace {

// Each backward checked at 60 elements spread over its input.
constexpr Diff kLlamaDiff{.samples = 60};

}  // namespace

TEST_CASE("rmsnorm: rows of unit root mean square times the weight, backward matches finite differences") {
  auto b = cpu();
  const int N = 7, C = 13;
  auto x = random_values(N * C, 50, 2.0f, 0.3f), w = random_values(C, 51, 0.5f, 1.0f), lw = random_values(N * C, 52);
  std::vector<float> out(N * C), rstd(N);
  auto forward = [&] {
    b->rmsnorm_forward({view(out, {N, C}), view(rstd, {N}), view(x, {N, C}), view(w, {C}), 1e-5f});
    return dot(out, lw);
  };
  forward();
  for (int n = 0; n < N; ++n) {
    double ss = 0;
    for (int c = 0; c < C; ++c) ss += double(out[n * C + c] / w[c]) * (out[n * C + c] / w[c]);
    CHECK(std::sqrt(ss / C) == doctest::Approx(1.0).epsilon(1e-4));
  }
  auto start = random_values(N * C, 53);  // dx accumulates onto this
  std::vector<float> dx = start, dw = random_values(C, 54), dw0 = dw;
  b->rmsnorm_backward({view(dx, {N, C}), view(dw, {C}), view(lw, {N, C}), view(x, {N, C}), view(w, {C}),
                       view(rstd, {N})});
  for (int i = 0; i < N * C; ++i) dx[i] -= start[i];
  for (int c = 0; c < C; ++c) dw[c] -= dw0[c];
  check_gradient("rmsnorm dx", x, dx, forward, kLlamaDiff);
  check_gradient("rmsnorm dw", w, dw, forward, kLlamaDiff);
}

TEST_CASE("rope rotates each query and key pair by its position's angle, the inverse undoes it") {
  auto b = cpu();
  const int B = 2, T = 5, heads = 5, rotated = 3, D = 6;
  const float theta = 500000.0f;
  const auto x0 = random_values(B * T * heads * D, 60);
  auto x = x0;
  b->rope({view(x, {B, T, heads, D}), rotated, theta, 3});
  for (int bb = 0; bb < B; ++bb)
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < D / 2; ++i) {
          const std::size_t at = ((bb * T + t) * heads + h) * D;
          const double angle = (3 + t) * std::pow(double(theta), -2.0 * i / D);
          const double a = x0[at + i], c = x0[at + i + D / 2];
          const double want0 = h < rotated ? a * std::cos(angle) - c * std::sin(angle) : a;
          const double want1 = h < rotated ? c * std::cos(angle) + a * std::sin(angle) : c;
          CHECK(x[at + i] == doctest::Approx(want0).epsilon(1e-4));
          CHECK(x[at + i + D / 2] == doctest::Approx(want1).epsilon(1e-4));
        }
  b->rope({view(x, {B, T, heads, D}), rotated, theta, 3, true});
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(x[i] == doctest::Approx(x0[i]).epsilon(1e-5));
}

// Llama 3.1's frequency scaling, written as Meta's reference (apply_scaling in llama/model.py) in
// double: the low frequencies divided by the factor, the high kept, a smooth blend between.
double llama3_inv_freq(int i, int D, double theta, double factor, double low, double high, double original) {
  const double freq = std::pow(theta, -2.0 * i / D);
  const double wavelen = 2 * M_PI / freq;
  if (wavelen < original / high) return freq;
  if (wavelen > original / low) return freq / factor;
  const double smooth = (original / wavelen - low) / (high - low);
  return (1 - smooth) * freq / factor + smooth * freq;
}

TEST_CASE("rope with llama3 scaling rotates by Meta's scaled frequencies, in all three bands") {
  auto b = cpu();
  const int B = 1, T = 300, heads = 2, rotated = 2, D = 16;
  const float theta = 10000.0f;
  // Wavelengths 2 pi 10000^(2i/16): 6.3, 19.9, 62.8, 199, ... against the bands' limits 64 / 4 = 16
  // (kept below) and 64 / 1 = 64 (divided above): pairs 0 kept, 1 and 2 blended, 3-7 divided.
  const ops::RopeScaling s{8.0f, 1.0f, 4.0f, 64.0f};
  for (int i = 0; i < D / 2; ++i) {
    CAPTURE(i);
    CHECK(ops::rope_inv_freq(i, D, theta, s) ==
          doctest::Approx(llama3_inv_freq(i, D, theta, 8, 1, 4, 64)).epsilon(1e-6));
  }
  CHECK(ops::rope_inv_freq(0, D, theta, s) == ops::rope_inv_freq(0, D, theta));
  CHECK(ops::rope_inv_freq(5, D, theta, s) == ops::rope_inv_freq(5, D, theta) / 8.0f);
  const auto x0 = random_values(B * T * heads * D, 61);
  auto x = x0;
  b->rope({view(x, {B, T, heads, D}), rotated, theta, 0, false, s});
  for (int t = 0; t < T; t += 37)
    for (int i = 0; i < D / 2; ++i) {
      const std::size_t at = (t * heads + 1) * D;
      const double angle = t * llama3_inv_freq(i, D, theta, 8, 1, 4, 64);
      const double a = x0[at + i], c = x0[at + i + D / 2];
      CHECK(x[at + i] == doctest::Approx(a * std::cos(angle) - c * std::sin(angle)).epsilon(1e-4));
      CHECK(x[at + i + D / 2] == doctest::Approx(c * std::cos(angle) + a * std::sin(angle)).epsilon(1e-4));
    }
  b->rope({view(x, {B, T, heads, D}), rotated, theta, 0, true, s});
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(x[i] == doctest::Approx(x0[i]).epsilon(1e-4));
  CHECK_THROWS_WITH(b->rope({view(x, {B, T, heads, D}), rotated, theta, 0, false, {0.5f, 1.0f, 4.0f, 64.0f}}),
                    doctest::Contains("factor >= 1"));
}

TEST_CASE("rope backward (the inverse rotation of the gradient) matches finite differences") {
  auto b = cpu();
  const int B = 2, T = 4, heads = 3, rotated = 2, D = 8;
  auto x = random_values(B * T * heads * D, 61), lw = random_values(x.size(), 62);
  auto forward = [&] {
    std::vector<float> y = x;
    b->rope({view(y, {B, T, heads, D}), rotated, 10000.0f, 1});
    return dot(y, lw);
  };
  std::vector<float> dx = lw;
  b->rope({view(dx, {B, T, heads, D}), rotated, 10000.0f, 1, true});
  check_gradient("rope dx", x, dx, forward, kLlamaDiff);
}

TEST_CASE("swiglu is silu(gate) * up, backward matches finite differences") {
  auto b = cpu();
  const int N = 6, F = 11;
  auto x = random_values(N * 2 * F, 70, 2.0f), lw = random_values(N * F, 71);
  std::vector<float> out(N * F);
  auto forward = [&] {
    b->swiglu_forward({view(out, {N, F}), view(x, {N, 2 * F})});
    return dot(out, lw);
  };
  forward();
  for (int n = 0; n < N; ++n)
    for (int f = 0; f < F; ++f) {
      const double g = x[n * 2 * F + f], u = x[n * 2 * F + F + f];
      CHECK(out[n * F + f] == doctest::Approx(g / (1 + std::exp(-g)) * u).epsilon(1e-5));
    }
  std::vector<float> dx(x.size());
  b->swiglu_backward({view(dx, {N, 2 * F}), view(lw, {N, F}), view(x, {N, 2 * F})});
  check_gradient("swiglu dx", x, dx, forward, kLlamaDiff);
}

TEST_CASE("grouped-query attention equals multi-head attention on keys and values repeated per group") {
  auto b = cpu();
  const int B = 2, T = 7, H = 6, D = 4;
  for (int K : {1, 2, 3, 6}) {
    INFO("kv_heads = " << K);
    const int g = H / K;
    auto qkv = random_values(B * T * (H + 2 * K) * D, 80 + K);
    // The same attention as multi-head: [B, T, 3, H, D] with key/value head h / g copied to head h.
    std::vector<float> mha(B * T * 3 * H * D);
    for (int p = 0; p < B * T; ++p)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          const float* row = qkv.data() + p * (H + 2 * K) * D;
          mha[(p * 3 + 0) * H * D + h * D + d] = row[h * D + d];
          mha[(p * 3 + 1) * H * D + h * D + d] = row[(H + h / g) * D + d];
          mha[(p * 3 + 2) * H * D + h * D + d] = row[(H + K + h / g) * D + d];
        }
    std::vector<float> out(B * T * H * D), lse(B * H * T), out_mha(out.size()), lse_mha(lse.size());
    const rng::PhiloxArgs r{99, 3, nullptr};
    ops::AttentionForward a{view(out, {B, T, H, D}), view(lse, {B, H, T}), view(qkv, {B, T, H + 2 * K, D}), 0.5f,
                            0.2f, r};
    a.kv_heads = K;
    b->attention_forward(a);
    b->attention_forward({view(out_mha, {B, T, H, D}), view(lse_mha, {B, H, T}), view(mha, {B, T, 3, H, D}), 0.5f,
                          0.2f, r});
    CHECK(out == out_mha);
    CHECK(lse == lse_mha);
    // The backward: dq per head, dk and dv summed over each group's heads.
    auto dout = random_values(out.size(), 90 + K);
    std::vector<float> dqkv(qkv.size()), dmha(mha.size());
    ops::AttentionBackward g_args{view(dqkv, {B, T, H + 2 * K, D}), view(dout, {B, T, H, D}), view(out, {B, T, H, D}),
                                  view(lse, {B, H, T}), view(qkv, {B, T, H + 2 * K, D}), 0.5f, 0.2f, r};
    g_args.kv_heads = K;
    b->attention_backward(g_args);
    b->attention_backward({view(dmha, {B, T, 3, H, D}), view(dout, {B, T, H, D}), view(out_mha, {B, T, H, D}),
                           view(lse_mha, {B, H, T}), view(mha, {B, T, 3, H, D}), 0.5f, 0.2f, r});
    double worst = 0;
    for (int p = 0; p < B * T; ++p)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          const float* row = dqkv.data() + p * (H + 2 * K) * D;
          worst = std::max(worst, double(std::fabs(row[h * D + d] - dmha[(p * 3 + 0) * H * D + h * D + d])));
        }
    for (int p = 0; p < B * T; ++p)
      for (int kv = 0; kv < K; ++kv)
        for (int d = 0; d < D; ++d) {
          double sk = 0, sv = 0;
          for (int j = 0; j < g; ++j) {
            sk += dmha[(p * 3 + 1) * H * D + (kv * g + j) * D + d];
            sv += dmha[(p * 3 + 2) * H * D + (kv * g + j) * D + d];
          }
          const float* row = dqkv.data() + p * (H + 2 * K) * D;
          worst = std::max({worst, std::fabs(row[(H + kv) * D + d] - sk), std::fabs(row[(H + K + kv) * D + d] - sv)});
        }
    CHECK(worst < 1e-5);
  }
}

namespace {

// Grouped-query attention of qkv [B, T, H + 2K, D] (with packed documents' starts, when given):
// L = sum(out * lw) and its backward, checked against finite differences; returns the backward's
// arguments for further calls.
ops::AttentionBackward check_gqa_gradient(ops::Backend& b, std::vector<float>& qkv, std::vector<float>& lw,
                                          std::vector<float>& out, std::vector<float>& lse, std::vector<float>& dqkv,
                                          int B, int T, int H, int K, int D, const TensorView& doc_start,
                                          const char* what) {
  auto forward = [&] {
    ops::AttentionForward a{view(out, {B, T, H, D}), view(lse, {B, H, T}), view(qkv, {B, T, H + 2 * K, D}), 0.5f};
    a.kv_heads = K;
    a.doc_start = doc_start;
    b.attention_forward(a);
    return dot(out, lw);
  };
  forward();
  ops::AttentionBackward a{view(dqkv, {B, T, H + 2 * K, D}), view(lw, {B, T, H, D}), view(out, {B, T, H, D}),
                           view(lse, {B, H, T}), view(qkv, {B, T, H + 2 * K, D}), 0.5f};
  a.kv_heads = K;
  a.doc_start = doc_start;
  b.attention_backward(a);
  check_gradient(what, qkv, dqkv, forward, {.samples = 100});
  return a;
}

}  // namespace

TEST_CASE("grouped-query attention backward matches finite differences") {
  auto b = cpu();
  const int B = 2, T = 5, H = 4, K = 2, D = 4;
  auto qkv = random_values(B * T * (H + 2 * K) * D, 95), lw = random_values(B * T * H * D, 96);
  std::vector<float> out(B * T * H * D), lse(B * H * T), dqkv(qkv.size());
  check_gqa_gradient(*b, qkv, lw, out, lse, dqkv, B, T, H, K, D, {}, "gqa dqkv");
}

TEST_CASE("grouped-query decode is row length - 1 of the grouped forward") {
  auto b = cpu();
  const int B = 2, Tmax = 9, H = 4, K = 1, D = 8, length = 6;
  auto qkv = random_values(B * Tmax * (H + 2 * K) * D, 97);
  std::vector<float> dec(B * H * D);
  ops::AttentionDecode a{view(dec, {B, H, D}), view(qkv, {B, Tmax, H + 2 * K, D}), length, 0.35f};
  a.kv_heads = K;
  b->attention_decode(a);
  std::vector<float> prefix(B * length * (H + 2 * K) * D);
  for (int bb = 0; bb < B; ++bb)
    std::copy_n(qkv.begin() + bb * Tmax * (H + 2 * K) * D, length * (H + 2 * K) * D,
                prefix.begin() + bb * length * (H + 2 * K) * D);
  std::vector<float> out(B * length * H * D), lse(B * H * length);
  ops::AttentionForward f{view(out, {B, length, H, D}), view(lse, {B, H, length}),
                          view(prefix, {B, length, H + 2 * K, D}), 0.35f};
  f.kv_heads = K;
  b->attention_forward(f);
  for (int bb = 0; bb < B; ++bb)
    for (int i = 0; i < H * D; ++i)
      CHECK(dec[bb * H * D + i] == doctest::Approx(out[(bb * length + length - 1) * H * D + i]).epsilon(1e-5));
}

TEST_CASE("llama ops reject shapes that do not fit, naming the argument") {
  auto b = cpu();
  std::vector<float> x(2 * 3 * 2 * 5), y(20), z(36);
  CHECK_THROWS_WITH(b->rope({view(x, {2, 3, 2, 5}), 2, 10000.0f}), doctest::Contains("D = 5 must be even"));
  CHECK_THROWS_WITH(b->swiglu_forward({view(y, {4, 5}), view(z, {4, 9})}), doctest::Contains("swiglu_forward"));
  std::vector<float> qkv(1 * 2 * 8 * 4), out(1 * 2 * 5 * 4), lse(1 * 5 * 2);
  ops::AttentionForward a{view(out, {1, 2, 5, 4}), view(lse, {1, 5, 2}), view(qkv, {1, 2, 8, 4}), 0.5f};
  a.kv_heads = 2;  // 2 does not divide 5 query heads
  CHECK_THROWS_WITH(b->attention_forward(a), doctest::Contains("must divide the 5 query heads"));
}

namespace {

// Rows [first, first + n) of each position's qkv row block of sequence b, as a sequence of its own.
std::vector<float> rows_of(const std::vector<float>& x, int b, int T, int row, int first, int n) {
  const auto begin = x.begin() + (static_cast<std::ptrdiff_t>(b) * T + first) * row;
  return std::vector<float>(begin, begin + static_cast<std::ptrdiff_t>(n) * row);
}

}  // namespace

TEST_CASE("attention within packed documents equals each document attended on its own, forward and backward") {
  auto b = cpu();
  const int B = 2, T = 11, H = 4, K = 2, D = 4, row = (H + 2 * K) * D;
  // Sequence 0 holds three documents, [0, 4), [4, 9), [9, 11); sequence 1 begins inside one, [0, 6),
  // then [6, 11).
  const std::vector<std::vector<int>> docs = {{0, 4, 9, 11}, {0, 6, 11}};
  std::vector<std::int32_t> starts(B * T);
  for (int s = 0; s < B; ++s)
    for (std::size_t d = 0; d + 1 < docs[s].size(); ++d)
      for (int t = docs[s][d]; t < docs[s][d + 1]; ++t) starts[s * T + t] = docs[s][d];
  const TensorView doc_start(starts.data(), {B, T}, DType::i32, Device::cpu);
  auto qkv = random_values(B * T * row, 301), dout = random_values(B * T * H * D, 302);
  std::vector<float> out(B * T * H * D), lse(B * H * T), dqkv(qkv.size());
  ops::AttentionForward f{view(out, {B, T, H, D}), view(lse, {B, H, T}), view(qkv, {B, T, H + 2 * K, D}), 0.5f};
  f.kv_heads = K;
  f.doc_start = doc_start;
  b->attention_forward(f);
  ops::AttentionBackward g{view(dqkv, {B, T, H + 2 * K, D}), view(dout, {B, T, H, D}), view(out, {B, T, H, D}),
                           view(lse, {B, H, T}), view(qkv, {B, T, H + 2 * K, D}), 0.5f};
  g.kv_heads = K;
  g.doc_start = doc_start;
  b->attention_backward(g);
  for (int s = 0; s < B; ++s)
    for (std::size_t d = 0; d + 1 < docs[s].size(); ++d) {
      const int first = docs[s][d], n = docs[s][d + 1] - first;
      CAPTURE(s);
      CAPTURE(first);
      auto q1 = rows_of(qkv, s, T, row, first, n), go1 = rows_of(dout, s, T, H * D, first, n);
      std::vector<float> o1(n * H * D), l1(H * n), dq1(q1.size());
      ops::AttentionForward f1{view(o1, {1, n, H, D}), view(l1, {1, H, n}), view(q1, {1, n, H + 2 * K, D}), 0.5f};
      f1.kv_heads = K;
      b->attention_forward(f1);
      ops::AttentionBackward g1{view(dq1, {1, n, H + 2 * K, D}), view(go1, {1, n, H, D}), view(o1, {1, n, H, D}),
                                view(l1, {1, H, n}), view(q1, {1, n, H + 2 * K, D}), 0.5f};
      g1.kv_heads = K;
      b->attention_backward(g1);
      // The same operations in the same order: the same bits.
      CHECK(rows_of(out, s, T, H * D, first, n) == o1);
      CHECK(rows_of(dqkv, s, T, row, first, n) == dq1);
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < n; ++t) CHECK(lse[(s * H + h) * T + first + t] == l1[h * n + t]);
    }
}

TEST_CASE("attention within packed documents: the backward matches finite differences, bad starts are refused") {
  auto b = cpu();
  const int B = 1, T = 7, H = 2, K = 1, D = 4;
  std::vector<std::int32_t> starts = {0, 0, 0, 3, 3, 3, 3};
  const TensorView doc_start(starts.data(), {B, T}, DType::i32, Device::cpu);
  auto qkv = random_values(B * T * (H + 2 * K) * D, 303), lw = random_values(B * T * H * D, 304);
  std::vector<float> out(B * T * H * D), lse(B * H * T), dqkv(qkv.size());
  const ops::AttentionBackward a =
      check_gqa_gradient(*b, qkv, lw, out, lse, dqkv, B, T, H, K, D, doc_start, "document attention dqkv");
  // The first document's rows get no gradient from the second's outputs: its keys and values are
  // never read there (the loss weights only the second document's outputs).
  std::vector<float> lw2(lw.size(), 0.0f);
  for (int t = 3; t < T; ++t)
    for (int i = 0; i < H * D; ++i) lw2[t * H * D + i] = lw[t * H * D + i];
  std::vector<float> dq2(qkv.size());
  ops::AttentionBackward a2 = a;
  a2.dqkv = view(dq2, {B, T, H + 2 * K, D});
  a2.dout = view(lw2, {B, T, H, D});
  b->attention_backward(a2);
  for (int t = 0; t < 3; ++t)
    for (int i = 0; i < (H + 2 * K) * D; ++i) CHECK(dq2[t * (H + 2 * K) * D + i] == 0.0f);
  starts[2] = 3;  // after its own position
  ops::AttentionForward bad{view(out, {B, T, H, D}), view(lse, {B, H, T}), view(qkv, {B, T, H + 2 * K, D}), 0.5f};
  bad.kv_heads = K;
  bad.doc_start = doc_start;
  CHECK_THROWS_WITH(b->attention_forward(bad), doctest::Contains("doc_start[0, 2] = 3"));
}
