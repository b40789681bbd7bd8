// The mixture-of-experts ops on the CUDA backend against the CPU reference (bf16 rounding
// emulated), on random data at awkward sizes (37-token sequences, 5 or 7 experts of which some get
// no rows, k = 2 or 3, C = 72 for the 16-byte paths and 130 for the element-wise ones, capacities
// that drop, token_offset > 0). Every output is poisoned first; every op is run twice on the GPU
// and must give the same bits.
//
// Tolerances (relative L2 error, ||gpu - cpu|| / ||cpu||):
//  - integer outputs (experts, offsets, row_of, source), permuted rows, dropout masks: exact;
//  - bf16 outputs the CPU sums in the same order (permute backward, combine, dy, dropout): 1e-3
//    (the kernels round as the CPU does, so these are expected bit for bit);
//  - the router's f32 scores, lse and gates: 1e-5 (expf / logf, warp sums over the experts);
//    its losses 1e-4 each; dgates (f32 dot products, another order): 1e-5;
//  - the router's dlogits (bf16 of f32 values a few ulp apart): 1e-3;
//  - bf16 outputs of GEMMs: 1e-2 (dx with the GELU epilogue is rounded to bf16 before gelu' too);
//    f32 weight gradients: 1e-4.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kiln/ops/backend.hpp"
#include "kiln/tensor/bf16.hpp"
#include "op_harness.hpp"

using namespace kiln;
using test::act;
using test::BackendPair;
using test::Dual;
using test::f32;
using test::Kind;
using test::on_both;
using test::poisoned;
using test::random_values;
using test::same_bits;
using test::Side;

namespace {

std::vector<std::int32_t> cpu_ints(const Dual& d) {
  const auto* q = d.cpu().as<std::int32_t>();
  return std::vector<std::int32_t>(q, q + d.numel());
}
std::vector<std::int32_t> gpu_ints(BackendPair& p, const Dual& d) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(d.numel()));
  p.gpu->copy(TensorView(v.data(), d.gpu().shape, DType::i32, Device::cpu), d.gpu());
  return v;
}
Dual ints(BackendPair& p, Shape s, const std::vector<std::int32_t>& v) {
  Dual d(p, Kind::i32, s);
  d.set_ints(v);
  return d;
}
Dual poisoned_ints(BackendPair& p, Shape s) {
  return ints(p, s, std::vector<std::int32_t>(static_cast<std::size_t>(s.numel()), -777));
}

// Router logits far apart (0.5 between a row's experts, in a random order per row; less with many
// experts, so that sigmoid scores do not saturate), so that the top-k choices cannot depend on the
// last bits of the scores (logits that bf16 rounds to one value tie on both backends alike).
std::vector<float> spread_logits(int N, int E, std::uint64_t seed) {
  const float step = std::min(0.5f, 8.0f / static_cast<float>(E));
  std::mt19937_64 gen(seed);
  std::vector<float> l(static_cast<std::size_t>(N) * E);
  std::vector<int> order(static_cast<std::size_t>(E));
  for (int t = 0; t < N; ++t) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), gen);
    for (int e = 0; e < E; ++e) l[static_cast<std::size_t>(t) * E + e] = step * static_cast<float>(order[e]) - 2.0f;
  }
  return l;
}

// Each token's k distinct experts, drawn from `allowed` (so the others get no rows).
std::vector<std::int32_t> random_choices(int N, int k, const std::vector<int>& allowed, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<std::int32_t> ex;
  std::vector<int> pool = allowed;
  for (int t = 0; t < N; ++t) {
    std::shuffle(pool.begin(), pool.end(), gen);
    for (int j = 0; j < k; ++j) ex.push_back(pool[static_cast<std::size_t>(j)]);
  }
  return ex;
}

std::vector<float> head(const std::vector<float>& v, std::size_t n) {
  return std::vector<float>(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n));
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-30); }

const ops::Backend::OpTime* find_op(const std::vector<ops::Backend::OpTime>& times, const std::string& op) {
  for (const auto& t : times)
    if (t.op == op) return &t;
  return nullptr;
}

}  // namespace

TEST_CASE("cuda moe_route matches the CPU: softmax and sigmoid (with bias), normalize on and off, losses") {
  auto p = test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int T = 37, N = 3 * T;
  struct Case {
    int E, k;
  };
  // Fewer experts than a warp's lanes, and more (several per lane, the taken-mask's higher bits).
  for (const Case c : {Case{5, 2}, Case{7, 3}, Case{200, 8}})
    for (auto score : {ops::MoeScore::softmax, ops::MoeScore::sigmoid})
      for (bool normalize : {true, false}) {
        const bool sigmoid = score == ops::MoeScore::sigmoid;
        INFO("E = " << c.E << " k = " << c.k << " sigmoid " << sigmoid << " normalize " << normalize);
        Dual logits(p, Kind::act, {N, c.E});
        logits.set(spread_logits(N, c.E, 300 + c.E));
        auto bias = f32(p, {c.E}, 301, 0.3f);
        auto scores = poisoned(p, Kind::f32, {N, c.E});
        auto lse = poisoned(p, Kind::f32, {N});
        auto gates = poisoned(p, Kind::f32, {N, c.k});
        auto terms = poisoned(p, Kind::f32, {2});
        auto experts = poisoned_ints(p, {N, c.k});
        auto run = [&](const Side& s) {
          ops::MoeRoute a{s(scores), s(lse), s(experts), s(gates), s(logits)};
          if (sigmoid) a.bias = s(bias);
          a.loss_terms = s(terms);
          a.score = score;
          a.normalize = normalize;
          a.seq_len = T;
          a.aux_coeff = 0.01f;
          a.z_coeff = 0.001f;
          s.b().moe_route(a);
        };
        on_both(p, run);
        CHECK(gpu_ints(p, experts) == cpu_ints(experts));
        KILN_CHECK_CLOSE(scores, 1e-5);
        KILN_CHECK_CLOSE(lse, 1e-5);
        KILN_CHECK_CLOSE(gates, 1e-5);
        const auto tg = terms.gpu_values(), tc = terms.cpu_values();
        INFO("loss terms gpu " << tg[0] << ", " << tg[1] << " cpu " << tc[0] << ", " << tc[1]);
        CHECK(rel(tg[0], tc[0]) < 1e-4);
        CHECK(rel(tg[1], tc[1]) < 1e-4);
        // Run to run: the same bits.
        const auto s1 = scores.gpu_values(), g1 = gates.gpu_values(), l1 = lse.gpu_values();
        const auto e1 = gpu_ints(p, experts);
        run(Side{p, true});
        p.gpu->synchronize();
        CHECK(same_bits(scores.gpu_values(), s1));
        CHECK(same_bits(gates.gpu_values(), g1));
        CHECK(same_bits(lse.gpu_values(), l1));
        CHECK(same_bits(terms.gpu_values(), tg));
        CHECK(gpu_ints(p, experts) == e1);
        // Without loss terms the choices and gates are the same.
        gates.poison();
        p.gpu->moe_route({.scores = scores.gpu(),
                          .lse = lse.gpu(),
                          .experts = experts.gpu(),
                          .gates = gates.gpu(),
                          .logits = logits.gpu(),
                          .bias = sigmoid ? bias.gpu() : TensorView{},
                          .score = score,
                          .normalize = normalize,
                          .seq_len = T});
        p.gpu->synchronize();
        CHECK(same_bits(gates.gpu_values(), g1));
        CHECK(gpu_ints(p, experts) == e1);
      }
}

TEST_CASE("cuda moe_route_backward matches the CPU: both scorings, normalize on and off, both losses") {
  auto p = test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int T = 37, N = 3 * T;
  struct Case {
    int E, k;
  };
  for (const Case c : {Case{5, 2}, Case{7, 3}, Case{256, 8}})
    for (auto score : {ops::MoeScore::softmax, ops::MoeScore::sigmoid})
      for (bool normalize : {true, false}) {
        const bool sigmoid = score == ops::MoeScore::sigmoid;
        INFO("E = " << c.E << " k = " << c.k << " sigmoid " << sigmoid << " normalize " << normalize);
        Dual logits(p, Kind::act, {N, c.E});
        logits.set(spread_logits(N, c.E, 310 + c.E));
        auto scores = poisoned(p, Kind::f32, {N, c.E});
        auto lse = poisoned(p, Kind::f32, {N});
        auto gates = poisoned(p, Kind::f32, {N, c.k});
        auto experts = poisoned_ints(p, {N, c.k});
        // The forward on the CPU; both backwards start from its outputs.
        ops::MoeRoute fwd{scores.cpu(), lse.cpu(), experts.cpu(), gates.cpu(), logits.cpu()};
        fwd.score = score;
        fwd.normalize = normalize;
        fwd.seq_len = T;
        p.cpu->moe_route(fwd);
        scores.set(scores.cpu_values());
        lse.set(lse.cpu_values());
        experts.set_ints(cpu_ints(experts));
        auto dgates = f32(p, {N, c.k}, 311 + c.E);
        auto dlogits = poisoned(p, Kind::act, {N, c.E});
        auto run = [&](const Side& s) {
          s.b().moe_route_backward({.dlogits = s(dlogits),
                                    .dgates = s(dgates),
                                    .scores = s(scores),
                                    .lse = s(lse),
                                    .experts = s(experts),
                                    .logits = s(logits),
                                    .score = score,
                                    .normalize = normalize,
                                    .seq_len = T,
                                    .aux_coeff = 0.05f,
                                    .z_coeff = 0.01f});
        };
        on_both(p, run);
        KILN_CHECK_CLOSE(dlogits, 1e-3);
        const auto d1 = dlogits.gpu_values();
        run(Side{p, true});
        p.gpu->synchronize();
        CHECK(same_bits(dlogits.gpu_values(), d1));
      }
}

TEST_CASE("cuda moe_permute matches the CPU: dropless and with a capacity per sequence, token_offset > 0") {
  auto p = test::backend_pair();
  KILN_REQUIRE_GPU(p);
  struct Case {
    int N, T, k, E;
    std::int64_t capacity;
  };
  // 37-token sequences (111 choices each with k = 3) with a capacity that drops and without one;
  // 1480 tokens of k = 2 (several 1024-choice chunks per sequence, and dropless over all of them).
  for (const Case c : {Case{111, 37, 3, 7, 0}, Case{111, 37, 3, 7, 12}, Case{1480, 740, 2, 5, 0},
                       Case{1480, 740, 2, 5, 230}})
    for (int C : {72, 130}) {
      INFO("N = " << c.N << " T = " << c.T << " k = " << c.k << " E = " << c.E << " capacity " << c.capacity
                  << " C = " << C);
      const int R = c.N * c.k;
      // Expert 3 of 7 (and 6) never chosen; with E = 5, expert 1.
      const std::vector<int> allowed = c.E == 7 ? std::vector<int>{0, 1, 2, 4, 5} : std::vector<int>{0, 2, 3, 4};
      auto experts = ints(p, {c.N, c.k}, random_choices(c.N, c.k, allowed, 320 + c.N));
      auto x = act(p, {c.N, C}, 321 + C);
      auto offsets = poisoned_ints(p, {c.E + 1});
      auto row_of = poisoned_ints(p, {c.N, c.k});
      auto source = poisoned_ints(p, {R});
      auto out = poisoned(p, Kind::act, {R, C});
      auto run = [&](const Side& s, std::int32_t* offsets_host = nullptr) {
        s.b().moe_permute({.offsets = s(offsets),
                           .row_of = s(row_of),
                           .source = s(source),
                           .out = s(out),
                           .x = s(x),
                           .experts = s(experts),
                           .n_experts = c.E,
                           .seq_len = c.T,
                           .capacity = c.capacity,
                           .token_offset = 1000,
                           .offsets_host = offsets_host});
      };
      on_both(p, run);
      const auto off = cpu_ints(offsets);
      CHECK(gpu_ints(p, offsets) == off);
      CHECK(gpu_ints(p, row_of) == cpu_ints(row_of));
      CHECK(gpu_ints(p, source) == cpu_ints(source));
      CHECK(same_bits(out.gpu_values(), out.cpu_values()));
      const int empty = c.E == 7 ? 3 : 1;
      CHECK(off[empty] == off[empty + 1]);  // an expert without rows
      if (c.capacity > 0) CHECK(off[c.E] < R);  // the capacity dropped some
      const auto o1 = out.gpu_values();
      const auto r1 = gpu_ints(p, row_of), s1 = gpu_ints(p, source), f1 = gpu_ints(p, offsets);
      run(Side{p, true});
      p.gpu->synchronize();
      CHECK(same_bits(out.gpu_values(), o1));
      CHECK(gpu_ints(p, row_of) == r1);
      CHECK(gpu_ints(p, source) == s1);
      CHECK(gpu_ints(p, offsets) == f1);
      // Without out: the same grouping.
      row_of.set_ints(std::vector<std::int32_t>(static_cast<std::size_t>(R), -5));
      p.gpu->moe_permute({.offsets = offsets.gpu(),
                          .row_of = row_of.gpu(),
                          .source = source.gpu(),
                          .experts = experts.gpu(),
                          .n_experts = c.E,
                          .seq_len = c.T,
                          .capacity = c.capacity,
                          .token_offset = 1000});
      p.gpu->synchronize();
      CHECK(gpu_ints(p, row_of) == r1);
      CHECK(gpu_ints(p, source) == s1);
      // The offsets for the host, there when the call returns (the gather may still run), twice:
      // the pinned copy is reused.
      for (int again = 0; again < 2; ++again) {
        std::vector<std::int32_t> host(static_cast<std::size_t>(c.E + 1), -7);
        run(Side{p, true}, host.data());
        CHECK(host == f1);
        p.gpu->synchronize();
        CHECK(same_bits(out.gpu_values(), o1));
      }
    }
}

namespace {

// row_of of N tokens' k choices among E experts, capacity `cap` per sequence of T (some dropped),
// computed by the CPU and set on both sides.
Dual dropping_row_of(BackendPair& p, int N, int T, int k, int E, std::int64_t cap, std::uint64_t seed) {
  std::vector<int> allowed(static_cast<std::size_t>(E - 1));
  std::iota(allowed.begin(), allowed.end(), 0);  // the last expert gets nothing
  auto experts = ints(p, {N, k}, random_choices(N, k, allowed, seed));
  auto offsets = poisoned_ints(p, {E + 1});
  auto row_of = poisoned_ints(p, {N, k});
  auto source = poisoned_ints(p, {N * k});
  p.cpu->moe_permute({.offsets = offsets.cpu(),
                      .row_of = row_of.cpu(),
                      .source = source.cpu(),
                      .experts = experts.cpu(),
                      .n_experts = E,
                      .seq_len = T,
                      .capacity = cap});
  const auto r = cpu_ints(row_of);
  REQUIRE(std::count(r.begin(), r.end(), -1) > 0);
  row_of.set_ints(r);
  return row_of;
}

}  // namespace

TEST_CASE("cuda moe_permute_backward sums each token's rows as the CPU, dropped choices adding nothing") {
  auto p = test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int T = 37, N = 3 * T, k = 3, E = 7, R = N * k;
  auto row_of = dropping_row_of(p, N, T, k, E, 12, 330);
  for (int C : {72, 130}) {
    INFO("C = " << C);
    auto dout = act(p, {R, C}, 331 + C);
    auto dx = poisoned(p, Kind::act, {N, C});
    auto run = [&](const Side& s) { s.b().moe_permute_backward({s(dx), s(dout), s(row_of)}); };
    on_both(p, run);
    KILN_CHECK_CLOSE(dx, 1e-3);
    const auto d1 = dx.gpu_values();
    run(Side{p, true});
    p.gpu->synchronize();
    CHECK(same_bits(dx.gpu_values(), d1));
  }
}

TEST_CASE("cuda moe_combine and its backward match the CPU, dropped choices and unmapped rows included") {
  auto p = test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int T = 37, N = 3 * T, k = 3, E = 7, R = N * k;
  auto row_of = dropping_row_of(p, N, T, k, E, 12, 340);
  for (int C : {72, 130}) {
    INFO("C = " << C);
    auto y = act(p, {R, C}, 341 + C);
    auto gates = f32(p, {N, k}, 342, 0.3f, 0.4f);
    auto out = poisoned(p, Kind::act, {N, C});
    auto run = [&](const Side& s) { s.b().moe_combine({s(out), s(y), s(gates), s(row_of)}); };
    on_both(p, run);
    KILN_CHECK_CLOSE(out, 1e-3);
    const auto o1 = out.gpu_values();
    run(Side{p, true});
    p.gpu->synchronize();
    CHECK(same_bits(out.gpu_values(), o1));

    auto dout = act(p, {N, C}, 343 + C);
    auto dy = poisoned(p, Kind::act, {R, C});
    auto dgates = poisoned(p, Kind::f32, {N, k});
    auto back = [&](const Side& s) {
      s.b().moe_combine_backward({s(dy), s(dgates), s(dout), s(y), s(gates), s(row_of)});
    };
    on_both(p, back);
    KILN_CHECK_CLOSE(dy, 1e-3);
    KILN_CHECK_CLOSE(dgates, 1e-5);
    // The rows no choice maps to are zero (the CPU's are; the poison would show).
    const auto dyg = dy.gpu_values();
    const auto dgc = dgates.cpu_values();
    CHECK(std::count(dyg.begin(), dyg.end(), round_bf16(1234.5f)) == 0);
    const auto dg1 = dgates.gpu_values();
    for (std::size_t i = 0; i < dgc.size(); ++i)
      if (dgc[i] == 0.0f) CHECK(dg1[i] == 0.0f);  // dropped choices
    back(Side{p, true});
    p.gpu->synchronize();
    CHECK(same_bits(dy.gpu_values(), dyg));
    CHECK(same_bits(dgates.gpu_values(), dg1));
  }
}

namespace {

struct GroupedCase {
  int IC, OC;
};

// 7 experts over 111 rows: experts 1 and 5 without rows, expert 3 with one, 11 rows past the last.
const std::vector<std::int32_t> kGroupedOffsets = {0, 13, 13, 40, 41, 77, 77, 100};
constexpr int kGroupedE = 7, kGroupedR = 111;

}  // namespace

TEST_CASE("cuda grouped linears match the CPU: both weight layouts, GELU epilogue, overwrite and accumulate") {
  for (const auto impl : {ops::GroupedGemmImpl::grouped, ops::GroupedGemmImpl::per_expert}) {
    CAPTURE(impl == ops::GroupedGemmImpl::grouped);
    auto p = test::backend_pair({.grouped_gemm = impl});
    KILN_REQUIRE_GPU(p);
    const int E = kGroupedE, R = kGroupedR;
    const std::int32_t* off = kGroupedOffsets.data();
    // (72, 136): every matrix 16-byte aligned, the data GEMMs as one grouped call; 130: one GEMM per
    // expert (rows of 130 bf16 are not 16-byte multiples).
    for (const GroupedCase c : {GroupedCase{72, 136}, GroupedCase{72, 130}, GroupedCase{130, 72}})
      for (bool in_out : {false, true}) {
        INFO("IC = " << c.IC << " OC = " << c.OC << " weight " << (in_out ? "[E, IC, OC]" : "[E, OC, IC]"));
        const Shape wshape = in_out ? Shape{E, c.IC, c.OC} : Shape{E, c.OC, c.IC};
        auto x = act(p, {R, c.IC}, 350 + c.IC);
        auto w = act(p, wshape, 351 + c.OC, 0.2f);
        auto out = poisoned(p, Kind::act, {R, c.OC});
        auto fwd = [&](const Side& s) { s.b().grouped_linear_forward({s(out), s(x), s(w), off, in_out}); };
        on_both(p, fwd);
        const auto o1 = out.gpu_values(), oc = out.cpu_values();
        const auto used = static_cast<std::size_t>(off[E]) * c.OC;
        const double err = test::rel_error(head(o1, used), head(oc, used));
        INFO("out rows of the experts: relative error " << err);
        CHECK(err < 1e-2);
        CHECK(same_bits(std::vector<float>(o1.begin() + static_cast<std::ptrdiff_t>(used), o1.end()),
                        std::vector<float>(oc.begin() + static_cast<std::ptrdiff_t>(used), oc.end())));  // the poison
        fwd(Side{p, true});
        p.gpu->synchronize();
        CHECK(same_bits(out.gpu_values(), o1));

        auto dout = act(p, {R, c.OC}, 352 + c.OC);
        auto pre = act(p, {R, c.IC}, 353 + c.IC, 1.5f);
        for (bool gelu : {false, true})
          for (bool overwrite : {false, true}) {
            INFO("gelu " << gelu << " overwrite " << overwrite);
            auto dx = poisoned(p, Kind::act, {R, c.IC});
            // Accumulate onto random gradients; overwrite poisoned ones (experts 1 and 5 must get 0).
            Dual dw = overwrite ? poisoned(p, Kind::f32, wshape) : f32(p, wshape, 354);
            auto back = [&](const Side& s) {
              s.b().grouped_linear_backward({.dx = s(dx),
                                             .dweight = s(dw),
                                             .dout = s(dout),
                                             .x = s(x),
                                             .weight = s(w),
                                             .dx_gelu_pre = gelu ? s(pre) : TensorView{},
                                             .offsets_host = off,
                                             .weight_in_out = in_out,
                                             .dweight_overwrite = overwrite});
            };
            on_both(p, back);
            KILN_CHECK_CLOSE(dx, 1e-2);
            KILN_CHECK_CLOSE(dw, 1e-4);
            const auto dwg = dw.gpu_values();
            CHECK(std::count(dwg.begin(), dwg.end(), 1234.5f) == 0);
            if (overwrite) {
              const auto dx1 = dx.gpu_values();
              back(Side{p, true});
              p.gpu->synchronize();
              CHECK(same_bits(dx.gpu_values(), dx1));
              CHECK(same_bits(dw.gpu_values(), dwg));
            }
          }
        // Without dx: the weight gradient alone.
        auto dw = f32(p, wshape, 355);
        on_both(p, [&](const Side& s) {
          s.b().grouped_linear_backward({.dweight = s(dw),
                                         .dout = s(dout),
                                         .x = s(x),
                                         .weight = s(w),
                                         .offsets_host = off,
                                         .weight_in_out = in_out});
        });
        KILN_CHECK_CLOSE(dw, 1e-4);
      }
  }
}

TEST_CASE("cuda grouped linears over row groups that share experts match the CPU (expert parallelism's layout)") {
  // Rows by source rank, then expert: groups q E + e through expert e; expert 2 has no rows from
  // either source, expert 0's groups are split over the passes of its weight gradient.
  const int E = 3, IC = 72, OC = 136;
  const std::vector<std::int32_t> off = {0, 37, 53, 53, 90, 90, 90};  // 6 groups, 90 rows, 7 left alone
  const std::vector<std::int32_t> expert_of = {0, 1, 2, 0, 1, 2};
  const int G = 6, R = 97;
  for (const auto impl : {ops::GroupedGemmImpl::grouped, ops::GroupedGemmImpl::per_expert}) {
    CAPTURE(impl == ops::GroupedGemmImpl::grouped);
    auto p = test::backend_pair({.grouped_gemm = impl});
    KILN_REQUIRE_GPU(p);
    for (bool in_out : {false, true}) {
      CAPTURE(in_out);
      const Shape wshape = in_out ? Shape{E, IC, OC} : Shape{E, OC, IC};
      auto x = act(p, {R, IC}, 360), w = act(p, wshape, 361, 0.2f), dout = act(p, {R, OC}, 362);
      auto out = poisoned(p, Kind::act, {R, OC});
      on_both(p, [&](const Side& s) {
        s.b().grouped_linear_forward({s(out), s(x), s(w), off.data(), in_out, G, expert_of.data()});
      });
      KILN_CHECK_CLOSE(out, 1e-2);
      for (bool overwrite : {false, true}) {
        CAPTURE(overwrite);
        auto dx = poisoned(p, Kind::act, {R, IC});
        Dual dw = overwrite ? poisoned(p, Kind::f32, wshape) : f32(p, wshape, 363);
        on_both(p, [&](const Side& s) {
          s.b().grouped_linear_backward({.dx = s(dx),
                                         .dweight = s(dw),
                                         .dout = s(dout),
                                         .x = s(x),
                                         .weight = s(w),
                                         .offsets_host = off.data(),
                                         .weight_in_out = in_out,
                                         .dweight_overwrite = overwrite,
                                         .groups = G,
                                         .expert_of = expert_of.data()});
        });
        KILN_CHECK_CLOSE(dx, 1e-2);
        KILN_CHECK_CLOSE(dw, 1e-4);
        const auto dwg = dw.gpu_values();
        CHECK(std::count(dwg.begin(), dwg.end(), 1234.5f) == 0);  // expert 2 written (zero) with overwrite
      }
    }
  }
}

TEST_CASE("cuda grouped linears run their data GEMMs as one grouped cuBLAS call where asked and the matrices allow") {
  for (const auto impl : {ops::GroupedGemmImpl::grouped, ops::GroupedGemmImpl::per_expert}) {
    auto p = test::backend_pair({.grouped_gemm = impl});
    KILN_REQUIRE_GPU(p);
    const int E = kGroupedE, R = kGroupedR;
    const std::int32_t* off = kGroupedOffsets.data();
    // The op table names the path: "..._per_expert" where the data GEMMs ran one per expert.
    for (const GroupedCase c : {GroupedCase{72, 136}, GroupedCase{72, 130}}) {
      const bool grouped = impl == ops::GroupedGemmImpl::grouped && c.OC % 8 == 0;
      INFO("IC = " << c.IC << " OC = " << c.OC);
      auto x = act(p, {R, c.IC}, 360);
      auto w = act(p, {E, c.OC, c.IC}, 361, 0.2f);
      auto out = poisoned(p, Kind::act, {R, c.OC});
      auto dout = act(p, {R, c.OC}, 362);
      auto dx = poisoned(p, Kind::act, {R, c.IC});
      auto dw = poisoned(p, Kind::f32, {E, c.OC, c.IC});
      p.gpu->set_profiling(true);
      p.gpu->reset_op_times();
      p.gpu->grouped_linear_forward({out.gpu(), x.gpu(), w.gpu(), off});
      p.gpu->grouped_linear_backward({.dx = dx.gpu(),
                                      .dweight = dw.gpu(),
                                      .dout = dout.gpu(),
                                      .x = x.gpu(),
                                      .weight = w.gpu(),
                                      .offsets_host = off,
                                      .dweight_overwrite = true});
      const auto times = p.gpu->op_times();
      p.gpu->set_profiling(false);
      for (const char* op : {"grouped_linear_forward", "grouped_linear_backward"}) {
        const auto* one = find_op(times, op);
        const auto* each = find_op(times, std::string(op) + "_per_expert");
        INFO(op);
        CHECK((one != nullptr) == grouped);
        CHECK((each != nullptr) == !grouped);
        if (one) CHECK(one->calls == 1);
      }
    }
  }
}

TEST_CASE("cuda moe_dropout draws the CPU's masks bit for bit, by each row's id, rows past `rows` untouched") {
  auto p = test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int R = 111, rows = 100;
  const rng::PhiloxArgs r{0xfeed, 11, nullptr};
  // Ids of a global batch (distinct, large); ids past `rows` are -1 as moe_permute leaves them.
  std::vector<std::int32_t> id_values(static_cast<std::size_t>(R), -1);
  std::mt19937_64 gen(370);
  std::vector<std::int32_t> pool(5000);
  std::iota(pool.begin(), pool.end(), 100000);
  std::shuffle(pool.begin(), pool.end(), gen);
  std::copy(pool.begin(), pool.begin() + rows, id_values.begin());
  auto ids = ints(p, {R}, id_values);
  struct Case {
    int F;
    std::int64_t col_offset, cols_total;
  };
  // The 16-byte path at an offset into wider rows, a chunk starting mid Philox block (col_offset 3),
  // the element-wise path, cols_total = 0 (F).
  for (const Case c : {Case{72, 8, 216}, Case{72, 3, 75}, Case{130, 20, 300}, Case{130, 0, 0}}) {
    INFO("F = " << c.F << " col_offset " << c.col_offset << " cols_total " << c.cols_total);
    const auto x0 = random_values(static_cast<std::size_t>(R) * c.F, 371 + c.F);
    Dual x(p, Kind::act, {R, c.F});
    x.set(x0);
    auto run = [&](const Side& s) {
      s.b().moe_dropout({.x = s(x),
                         .ids = s(ids),
                         .rows = rows,
                         .p = 0.3f,
                         .rng = r,
                         .col_offset = c.col_offset,
                         .cols_total = c.cols_total});
    };
    on_both(p, run);
    const auto g = x.gpu_values(), cpu = x.cpu_values();
    std::size_t mask_mismatch = 0, dropped = 0;
    for (std::size_t i = 0; i < g.size(); ++i) {
      mask_mismatch += (g[i] == 0.0f) != (cpu[i] == 0.0f);
      dropped += cpu[i] == 0.0f;
    }
    CHECK(mask_mismatch == 0);
    CHECK(dropped > 0);
    KILN_CHECK_CLOSE(x, 1e-3);
    const std::size_t tail = static_cast<std::size_t>(rows) * c.F;  // past `rows`: untouched
    std::vector<float> x0_bf16(x0.begin() + static_cast<std::ptrdiff_t>(tail), x0.end());
    for (auto& v : x0_bf16) v = round_bf16(v);
    CHECK(same_bits(std::vector<float>(g.begin() + static_cast<std::ptrdiff_t>(tail), g.end()), x0_bf16));
    x.set(x0);
    run(Side{p, true});
    p.gpu->synchronize();
    CHECK(same_bits(x.gpu_values(), g));
  }
}
