// The mixture-of-experts ops on the CPU reference backend: the router's choices and gates on hand-made
// rows, its load-balancing loss and z-loss against their formulas, the grouping with and without a
// capacity, and every backward against central finite differences of its forward (L = sum(out * w)
// with fixed random weights w; the router's loss adds its two losses).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "kiln/ops/backend.hpp"
#include "kiln/ops/formulas.hpp"
#include "grad_check.hpp"
#include "op_harness.hpp"

using namespace kiln;
using namespace kiln::test;

namespace {

// Each backward checked at every element of its input, with steps of 1e-3.
constexpr Diff kMoeDiff{.samples = 0, .h = 1e-3f};

// Router logits whose experts are far apart (0.5 between neighbours, in a random order per row), so
// that no finite-difference step changes a token's choice.
std::vector<float> spread_logits(int N, int E, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<float> l(static_cast<std::size_t>(N * E));
  for (int t = 0; t < N; ++t) {
    std::vector<int> order(static_cast<std::size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), gen);
    for (int e = 0; e < E; ++e) l[t * E + e] = 0.5f * static_cast<float>(order[e]) - 1.0f;
  }
  return l;
}

}  // namespace

TEST_CASE("moe_route takes each token's k best experts, best first, ties to the lower expert, with their gates") {
  auto b = cpu();
  const int N = 2, E = 4, k = 2;
  std::vector<float> logits = {0.0f, 2.0f, 1.0f, 2.0f,   // a tie between experts 1 and 3
                               -1.0f, 0.5f, 3.0f, 0.0f};
  std::vector<float> scores(N * E), lse(N), gates(N * k);
  std::vector<std::int32_t> experts(N * k);
  auto route = [&](ops::MoeScore score, bool normalize, std::vector<float>* bias) {
    ops::MoeRoute a{view(scores, {N, E}), view(lse, {N}), iview(experts, {N, k}), view(gates, {N, k}),
                    view(logits, {N, E})};
    if (bias) a.bias = view(*bias, {E});
    a.score = score;
    a.normalize = normalize;
    a.seq_len = 1;
    b->moe_route(a);
  };
  route(ops::MoeScore::softmax, true, nullptr);
  CHECK(experts == std::vector<std::int32_t>{1, 3, 2, 1});
  for (int t = 0; t < N; ++t) {
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += std::exp(double(logits[t * E + e]));
    CHECK(lse[t] == doctest::Approx(std::log(sum)).epsilon(1e-6));
    CHECK(gates[t * k] + gates[t * k + 1] == doctest::Approx(1.0).epsilon(1e-6));
  }
  CHECK(gates[0] == doctest::Approx(0.5));  // equal scores
  route(ops::MoeScore::softmax, false, nullptr);
  CHECK(gates[2] == doctest::Approx(std::exp(3.0 - lse[1])).epsilon(1e-6));
  // Sigmoid scores: the bias steers the choice (expert 0 of row 0 now wins), the gates stay the scores'.
  std::vector<float> bias = {5.0f, 0.0f, 0.0f, 0.0f};
  route(ops::MoeScore::sigmoid, false, &bias);
  CHECK(experts[0] == 0);
  CHECK(gates[0] == doctest::Approx(0.5).epsilon(1e-6));  // sigmoid(0)
  CHECK(gates[1] == doctest::Approx(1.0 / (1.0 + std::exp(-2.0))).epsilon(1e-6));
}

TEST_CASE("moe_route's load-balancing loss and z-loss equal their formulas on a hand-made batch") {
  auto b = cpu();
  const int N = 4, E = 3, k = 1, T = 2;  // two sequences of two tokens
  std::vector<float> logits = {1.0f, 0.0f, 0.0f, 0.0f, 2.0f, 0.0f, 0.0f, 0.0f, 1.0f, 3.0f, 0.0f, 0.0f};
  std::vector<float> scores(N * E), lse(N), gates(N * k), terms(2);
  std::vector<std::int32_t> experts(N * k);
  ops::MoeRoute a{view(scores, {N, E}), view(lse, {N}), iview(experts, {N, k}), view(gates, {N, k}),
                  view(logits, {N, E}), {}, view(terms, {2})};
  a.seq_len = T;
  a.aux_coeff = 0.1f;
  a.z_coeff = 0.01f;
  b->moe_route(a);
  CHECK(experts == std::vector<std::int32_t>{0, 1, 2, 0});
  // aux = coeff E sum_s sum_e f[s, e] P[s, e], f the share of the sequence's choices, P its mean score.
  double aux = 0, z = 0;
  for (int s = 0; s < 2; ++s)
    for (int e = 0; e < E; ++e) {
      double f = 0, P = 0;
      for (int t = s * T; t < (s + 1) * T; ++t) {
        f += experts[t] == e ? 1.0 / T : 0.0;
        P += std::exp(double(logits[t * E + e]) - lse[t]) / T;
      }
      aux += f * P;
    }
  for (int t = 0; t < N; ++t) z += double(lse[t]) * lse[t];
  CHECK(terms[0] == doctest::Approx(0.1 * E * aux).epsilon(1e-5));
  CHECK(terms[1] == doctest::Approx(0.01 * z).epsilon(1e-5));
}

TEST_CASE("moe_route_backward matches finite differences: gates, load balancing and z-loss, both scorings") {
  auto b = cpu();
  const int N = 6, E = 5, k = 2, T = 3;
  for (auto score : {ops::MoeScore::softmax, ops::MoeScore::sigmoid})
    for (bool normalize : {true, false}) {
      INFO("sigmoid " << (score == ops::MoeScore::sigmoid) << ", normalize " << normalize);
      auto logits = spread_logits(N, E, 7);
      const auto wg = random_values(N * k, 8);
      std::vector<float> scores(N * E), lse(N), gates(N * k), terms(2);
      std::vector<std::int32_t> experts(N * k);
      auto forward = [&] {
        ops::MoeRoute a{view(scores, {N, E}), view(lse, {N}), iview(experts, {N, k}), view(gates, {N, k}),
                        view(logits, {N, E}), {}, view(terms, {2})};
        a.score = score;
        a.normalize = normalize;
        a.seq_len = T;
        a.aux_coeff = 0.3f;
        a.z_coeff = 0.05f;
        b->moe_route(a);
        return dot(gates, wg) + terms[0] + terms[1];
      };
      forward();
      const auto chosen = experts;
      std::vector<float> dgates = wg, dlogits(N * E);
      ops::MoeRouteBackward g{view(dlogits, {N, E}), view(dgates, {N, k}), view(scores, {N, E}), view(lse, {N}),
                              iview(experts, {N, k}), view(logits, {N, E})};
      g.score = score;
      g.normalize = normalize;
      g.seq_len = T;
      g.aux_coeff = 0.3f;
      g.z_coeff = 0.05f;
      b->moe_route_backward(g);
      check_gradient("moe_route dlogits", logits, dlogits, forward, kMoeDiff);
      forward();
      CHECK(experts == chosen);  // no step moved a choice
    }
}

TEST_CASE("moe_permute groups the choices by expert in choice order, a capacity per sequence drops the latest") {
  auto b = cpu();
  const int N = 6, k = 2, E = 3, C = 2;
  std::vector<std::int32_t> experts = {0, 1, 1, 2, 0, 1, 1, 0, 2, 1, 0, 2};
  std::vector<float> x(N * C);
  for (int i = 0; i < N * C; ++i) x[i] = static_cast<float>(i);
  std::vector<std::int32_t> offsets(E + 1), row_of(N * k), source(N * k);
  std::vector<float> out(N * k * C, -7.0f);
  std::vector<std::int32_t> host(E + 1, -1);  // offsets_host
  auto permute = [&](int seq_len, std::int64_t capacity, std::int64_t token_offset) {
    b->moe_permute({.offsets = iview(offsets, {E + 1}),
                    .row_of = iview(row_of, {N, k}),
                    .source = iview(source, {N * k}),
                    .out = view(out, {N * k, C}),
                    .x = view(x, {N, C}),
                    .experts = iview(experts, {N, k}),
                    .n_experts = E,
                    .seq_len = seq_len,
                    .capacity = capacity,
                    .token_offset = token_offset,
                    .offsets_host = host.data()});
  };
  permute(6, 0, 0);
  CHECK(offsets == std::vector<std::int32_t>{0, 4, 9, 12});
  CHECK(host == offsets);
  // Each row's id: token x E + expert (choices 0, 4, 7, 10 are tokens 0, 2, 3, 5 of expert 0; ...).
  CHECK(source == std::vector<std::int32_t>{0, 6, 9, 15, 1, 4, 7, 10, 13, 5, 14, 17});
  CHECK(row_of == std::vector<std::int32_t>{0, 4, 5, 9, 1, 6, 7, 2, 10, 8, 3, 11});
  for (int r = 0; r < N * k; ++r)
    for (int c = 0; c < C; ++c) CHECK(out[r * C + c] == x[source[r] / E * C + c]);
  // Two sequences of three tokens, each expert taking two of each sequence's choices; the ids count
  // tokens from token_offset (the micro-batch's place in the global batch), the rows still from x.
  permute(3, 2, 100);
  // Sequence 0's choices 0..5: experts 0 1 1 2 0 1 -> expert 1's third (choice 5) dropped.
  // Sequence 1's choices 6..11: experts 1 0 2 1 0 2 -> all kept (two each).
  CHECK(offsets == std::vector<std::int32_t>{0, 4, 8, 11});
  CHECK(row_of == std::vector<std::int32_t>{0, 4, 5, 8, 1, -1, 6, 2, 9, 7, 3, 10});
  // Rows: expert 0 takes choices 0, 4, 7, 10 (tokens 0, 2, 3, 5), expert 1 choices 1, 2, 6, 9
  // (tokens 0, 1, 3, 4), expert 2 choices 3, 8, 11 (tokens 1, 4, 5).
  CHECK(source == std::vector<std::int32_t>{300, 306, 309, 315, 301, 304, 310, 313, 305, 314, 317, -1});
  for (int c = 0; c < C; ++c) CHECK(out[11 * C + c] == 0.0f);
  for (int r = 0; r < 11; ++r) CHECK(out[r * C] == x[(source[r] / E - 100) * C]);
  // The backward sums each token's rows: dx[t] = sum_j dout[row_of[t, j]].
  auto dout = random_values(N * k * C, 3);
  std::vector<float> dx(N * C);
  b->moe_permute_backward({view(dx, {N, C}), view(dout, {N * k, C}), iview(row_of, {N, k})});
  for (int t = 0; t < N; ++t)
    for (int c = 0; c < C; ++c) {
      float want = 0;
      for (int j = 0; j < k; ++j)
        if (row_of[t * k + j] >= 0) want += dout[row_of[t * k + j] * C + c];
      CHECK(dx[t * C + c] == doctest::Approx(want));
    }
}

TEST_CASE("moe_combine weights each token's rows by its gates, its backward matches finite differences") {
  auto b = cpu();
  const int N = 5, k = 2, E = 3, C = 4;
  std::vector<std::int32_t> experts = {0, 1, 1, 2, 0, 1, 1, 0, 2, 1}, offsets(E + 1), row_of(N * k), source(N * k);
  b->moe_permute({.offsets = iview(offsets, {E + 1}),
                  .row_of = iview(row_of, {N, k}),
                  .source = iview(source, {N * k}),
                  .experts = iview(experts, {N, k}),
                  .n_experts = E,
                  .seq_len = N,
                  .capacity = 2});  // with dropped choices
  auto y = random_values(N * k * C, 11), gates = random_values(N * k, 12, 0.5f, 0.5f), w = random_values(N * C, 13);
  std::vector<float> out(N * C);
  auto forward = [&] {
    b->moe_combine({view(out, {N, C}), view(y, {N * k, C}), view(gates, {N, k}), iview(row_of, {N, k})});
    return dot(out, w);
  };
  forward();
  std::vector<float> dy(N * k * C), dgates(N * k);
  b->moe_combine_backward({view(dy, {N * k, C}), view(dgates, {N, k}), view(w, {N, C}), view(y, {N * k, C}),
                           view(gates, {N, k}), iview(row_of, {N, k})});
  check_gradient("moe_combine dy", y, dy, forward, kMoeDiff);
  check_gradient("moe_combine dgates", gates, dgates, forward, kMoeDiff);
}

TEST_CASE("grouped linears: each expert's rows through its own weight, backward matches finite differences") {
  auto b = cpu();
  const int E = 3, R = 9, IC = 5, OC = 4;
  std::vector<std::int32_t> offsets = {0, 2, 2, 7};  // an empty expert, and two unused rows at the end
  for (bool in_out : {false, true}) {
    INFO("weights stored " << (in_out ? "[in, out]" : "[out, in]"));
    const Shape wshape = in_out ? Shape{E, IC, OC} : Shape{E, OC, IC};
    auto w_at = [&](int e, int o, int i) { return in_out ? (e * IC + i) * OC + o : (e * OC + o) * IC + i; };
    auto x = random_values(R * IC, 21), wt = random_values(E * OC * IC, 22, 0.5f), lw = random_values(R * OC, 23);
    auto pre = random_values(R * IC, 24);
    std::vector<float> out(R * OC, 3.0f);
    auto forward = [&] {
      b->grouped_linear_forward({view(out, {R, OC}), view(x, {R, IC}), view(wt, wshape), offsets.data(), in_out});
      double s = 0;
      for (int r = 0; r < offsets[E]; ++r)
        for (int o = 0; o < OC; ++o) s += double(out[r * OC + o]) * lw[r * OC + o];
      return s;
    };
    forward();
    for (int e = 0; e < E; ++e)
      for (int r = offsets[e]; r < offsets[e + 1]; ++r)
        for (int o = 0; o < OC; ++o) {
          double want = 0;
          for (int i = 0; i < IC; ++i) want += double(x[r * IC + i]) * wt[w_at(e, o, i)];
          CHECK(out[r * OC + o] == doctest::Approx(want).epsilon(1e-5));
        }
    CHECK(out[(R - 1) * OC] == 3.0f);  // rows past the experts' are left alone
    std::vector<float> dx(R * IC, 9.0f), dw = random_values(E * OC * IC, 25), dw0 = dw;
    auto dout = lw;
    for (int r = offsets[E]; r < R; ++r)
      for (int o = 0; o < OC; ++o) dout[r * OC + o] = 100.0f;  // ignored
    b->grouped_linear_backward({.dx = view(dx, {R, IC}),
                                .dweight = view(dw, wshape),
                                .dout = view(dout, {R, OC}),
                                .x = view(x, {R, IC}),
                                .weight = view(wt, wshape),
                                .offsets_host = offsets.data(),
                                .weight_in_out = in_out});
    for (std::size_t i = 0; i < dw.size(); ++i) dw[i] -= dw0[i];  // accumulated
    CHECK(dx[(R - 1) * IC] == 0.0f);
    check_gradient("grouped dx", x, dx, forward, {.samples = 0, .h = 1e-2f});
    check_gradient("grouped dweight", wt, dw, forward, {.samples = 0, .h = 1e-2f});
    // With the GELU epilogue (x was gelu(pre)) and written weight gradients; the empty expert's zero.
    std::vector<float> dx2(R * IC), dw2(E * OC * IC, 5.0f);
    b->grouped_linear_backward({.dx = view(dx2, {R, IC}),
                                .dweight = view(dw2, wshape),
                                .dout = view(dout, {R, OC}),
                                .x = view(x, {R, IC}),
                                .weight = view(wt, wshape),
                                .dx_gelu_pre = view(pre, {R, IC}),
                                .offsets_host = offsets.data(),
                                .weight_in_out = in_out,
                                .dweight_overwrite = true});
    for (int r = 0; r < offsets[E]; ++r)
      for (int i = 0; i < IC; ++i)
        CHECK(dx2[r * IC + i] == doctest::Approx(dx[r * IC + i] * ops::gelu_grad(pre[r * IC + i])).epsilon(1e-5));
    for (std::size_t i = 0; i < dw.size(); ++i) CHECK(dw2[i] == doctest::Approx(dw[i]).epsilon(1e-5));
    for (int o = 0; o < OC; ++o)
      for (int i = 0; i < IC; ++i) CHECK(dw2[w_at(1, o, i)] == 0.0f);
  }
}

TEST_CASE("grouped linears over row groups that share experts equal the same rows grouped by expert, bit for bit") {
  // Expert parallelism's received rows: by source rank, then expert (groups q E + e through expert
  // e). The same rows laid out expert by expert (each expert's from rank 0, then rank 1) give the same
  // outputs, data gradients and weight gradients bit for bit; expert 3 has no rows at all.
  auto b = cpu();
  const int E = 4, IC = 5, OC = 6, G = 8;
  const std::vector<std::int32_t> counts = {2, 0, 3, 0, 1, 2, 0, 0};  // [source][expert]
  std::vector<std::int32_t> goff(G + 1, 0), expert_of(G), eoff(E + 1, 0);
  for (int g = 0; g < G; ++g) goff[g + 1] = goff[g] + counts[g], expert_of[g] = g % E;
  const int R = goff[G] + 1;  // one row left alone
  // Row r of the grouped layout sits at row at[r] of the expert layout.
  std::vector<int> at(static_cast<std::size_t>(R), R - 1);
  for (int e = 0, next = 0; e < E; ++e) {
    eoff[e] = next;
    for (int q = 0; q < 2; ++q)
      for (int r = goff[q * E + e]; r < goff[q * E + e + 1]; ++r) at[r] = next++;
    eoff[e + 1] = next;
  }
  auto regroup = [&](const std::vector<float>& v, int cols) {
    std::vector<float> out(v.size());
    for (int r = 0; r < R; ++r) std::copy_n(v.begin() + r * cols, cols, out.begin() + at[r] * cols);
    return out;
  };
  for (bool in_out : {false, true}) {
    CAPTURE(in_out);
    const Shape wshape = in_out ? Shape{E, IC, OC} : Shape{E, OC, IC};
    auto x = random_values(R * IC, 31), w = random_values(E * OC * IC, 32, 0.5f), dout = random_values(R * OC, 33);
    auto xe = regroup(x, IC), doute = regroup(dout, OC);
    std::vector<float> out(R * OC, 3.0f), oute(R * OC, 3.0f);
    b->grouped_linear_forward({view(out, {R, OC}), view(x, {R, IC}), view(w, wshape), goff.data(), in_out, G,
                               expert_of.data()});
    b->grouped_linear_forward({view(oute, {R, OC}), view(xe, {R, IC}), view(w, wshape), eoff.data(), in_out});
    CHECK(same_bits(regroup(out, OC), oute));
    for (bool overwrite : {false, true}) {
      CAPTURE(overwrite);
      std::vector<float> dx(R * IC, 9.0f), dxe(R * IC, 9.0f), dw = random_values(E * OC * IC, 34), dwe = dw;
      b->grouped_linear_backward({.dx = view(dx, {R, IC}),
                                  .dweight = view(dw, wshape),
                                  .dout = view(dout, {R, OC}),
                                  .x = view(x, {R, IC}),
                                  .weight = view(w, wshape),
                                  .offsets_host = goff.data(),
                                  .weight_in_out = in_out,
                                  .dweight_overwrite = overwrite,
                                  .groups = G,
                                  .expert_of = expert_of.data()});
      b->grouped_linear_backward({.dx = view(dxe, {R, IC}),
                                  .dweight = view(dwe, wshape),
                                  .dout = view(doute, {R, OC}),
                                  .x = view(xe, {R, IC}),
                                  .weight = view(w, wshape),
                                  .offsets_host = eoff.data(),
                                  .weight_in_out = in_out,
                                  .dweight_overwrite = overwrite});
      CHECK(same_bits(regroup(dx, IC), dxe));
      CHECK(same_bits(dw, dwe));
    }
  }
}

TEST_CASE("weight_grad_passes: each expert's groups with rows in successive passes, in group order, and the experts without rows") {
  const std::vector<std::int32_t> off = {0, 2, 2, 5, 6, 6, 9};  // groups 1 and 4 empty
  const std::vector<std::int32_t> expert_of = {0, 1, 2, 0, 1, 2};
  const auto passes = ops::weight_grad_passes(off.data(), 6, expert_of.data());
  REQUIRE(passes.size() == 2);
  CHECK(passes[0] == std::vector<int>{0, 2});
  CHECK(passes[1] == std::vector<int>{3, 5});
  CHECK(ops::weight_grad_passes(off.data(), 6, nullptr) == std::vector<std::vector<int>>{{0, 2, 3, 5}});
  // Expert 1's groups (1 and 4) are empty; a fourth expert has no group at all.
  CHECK(ops::experts_without_rows(off.data(), 6, expert_of.data(), 4) == std::vector<int>{1, 3});
}

TEST_CASE("moe_dropout keeps each element by its choice's global id, the same wherever the row sits") {
  auto b = cpu();
  const int R = 6, F = 8, cols = 24, col0 = 8;
  const rng::PhiloxArgs r{123, 7};
  auto x = random_values(R * F, 31);
  std::vector<std::int32_t> ids = {5, 17, 2, 40, 3, 9};
  auto y = x;
  b->moe_dropout({.x = view(y, {R, F}), .ids = iview(ids, {R}), .rows = 5, .p = 0.3f, .rng = r, .col_offset = col0,
                  .cols_total = cols});
  const std::uint32_t threshold = rng::dropout_threshold(0.3f);
  int dropped = 0;
  for (int row = 0; row < 5; ++row)
    for (int c = 0; c < F; ++c) {
      const auto n = static_cast<std::uint64_t>(ids[row]) * cols + col0 + c;
      const bool keep = rng::dropout_keep(rng::philox_u32(r.seed, r.start(), n), threshold);
      dropped += keep ? 0 : 1;
      CHECK(y[row * F + c] == (keep ? x[row * F + c] * (1.0f / (1.0f - 0.3f)) : 0.0f));
    }
  for (int c = 0; c < F; ++c) CHECK(y[5 * F + c] == x[5 * F + c]);  // past `rows`: untouched
  CHECK(dropped > 0);
  // The same rows in another order draw the same masks.
  std::vector<std::int32_t> ids2 = {3, 5, 17, 2, 40};
  std::vector<float> x2 = {};
  for (int row : {4, 0, 1, 2, 3})
    for (int c = 0; c < F; ++c) x2.push_back(x[row * F + c]);
  b->moe_dropout({.x = view(x2, {5, F}), .ids = iview(ids2, {5}), .rows = 5, .p = 0.3f, .rng = r, .col_offset = col0,
                  .cols_total = cols});
  for (int c = 0; c < F; ++c) CHECK(x2[c] == y[4 * F + c]);
  for (int c = 0; c < F; ++c) CHECK(x2[F + c] == y[c]);
}

TEST_CASE("gelu_backward is dout * gelu'(x), elementwise") {
  auto b = cpu();
  auto x = random_values(37, 41, 2.0f), dout = random_values(37, 42);
  std::vector<float> dx(37);
  b->gelu_backward({view(dx, {37}), view(dout, {37}), view(x, {37})});
  for (int i = 0; i < 37; ++i) CHECK(dx[i] == dout[i] * ops::gelu_grad(x[i]));
}
