// The CUDA backend's non-attention ops against the CPU reference (bf16-rounding emulated), on
// random data at awkward sizes. Every output is poisoned first, so an unwritten element fails.
//
// Tolerances (relative L2 error, ||gpu - cpu|| / ||cpu||):
//  - bf16 outputs: 1e-2 (one bf16 rounding is ~2e-3 relative; GEMM accumulation order differs).
//  - f32 statistics (mean, rstd, losses): 1e-5 (same math, different summation order).
//  - f32 gradients accumulated from bf16 inputs: 1e-3 (summation order over up to N terms).
//  - Philox draws, conversions, dropout masks, residual adds: bit-identical by construction.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include <cuda_runtime_api.h>

#include "kiln/ops/backend.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/rng/tracker.hpp"
#include "op_harness.hpp"

using namespace kiln;
using test::act;
using test::Dual;
using test::f32;
using test::on_both;
using test::poisoned;
using test::Side;
using test::Kind;
using test::random_ints;
using test::random_values;
using test::same_bits;

namespace {

// Number of positions whose values differ bit for bit.
std::size_t mismatches(const std::vector<float>& a, const std::vector<float>& b) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// linear (cuBLASLt)

TEST_CASE("cuda linear_forward matches the CPU: no bias, bias, GELU epilogue") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int N = 333, IC = 72;
  // OC = 216: the fused cuBLASLt epilogues; OC = 100: the aux ld is not a multiple of 8, so the
  // GELU epilogue runs unfused (plain GEMM + kernel).
  for (int OC : {216, 100}) {
    INFO("OC = " << OC);
    auto x = act(p, {N, IC}, 11);
    auto w = act(p, {OC, IC}, 12, 0.1f);
    auto bias = act(p, {OC}, 13, 0.5f);
    {
      auto out = poisoned(p, Kind::act, {N, OC});
      on_both(p, [&](const Side& s) { s.b().linear_forward({s(out), {}, s(x), s(w), {}}); });
      KILN_CHECK_CLOSE(out, 1e-2);
    }
    {
      auto out = poisoned(p, Kind::act, {N, OC});
      on_both(p, [&](const Side& s) { s.b().linear_forward({s(out), {}, s(x), s(w), s(bias)}); });
      KILN_CHECK_CLOSE(out, 1e-2);
    }
    {
      auto out = poisoned(p, Kind::act, {N, OC});
      auto pre = poisoned(p, Kind::act, {N, OC});
      on_both(p, [&](const Side& s) { s.b().linear_forward({s(out), s(pre), s(x), s(w), s(bias)}); });
      KILN_CHECK_CLOSE(pre, 1e-2);
      KILN_CHECK_CLOSE(out, 1e-2);
    }
    {  // GELU without a bias (cuBLASLt's GELU_AUX)
      auto out = poisoned(p, Kind::act, {N, OC});
      auto pre = poisoned(p, Kind::act, {N, OC});
      on_both(p, [&](const Side& s) { s.b().linear_forward({s(out), s(pre), s(x), s(w), {}}); });
      KILN_CHECK_CLOSE(pre, 1e-2);
      KILN_CHECK_CLOSE(out, 1e-2);
    }
  }
}

TEST_CASE("cuda GEMM autotune: the timed algorithm choice writes the real outputs, matching the CPU, with the "
          "untuned bits") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  std::unique_ptr<ops::Backend> untuned;  // outlives the tensors below, whatever made them
  p.gpu = ops::make_cuda_backend(0, {.gemm_autotune = true});
  const int N = 1024, IC = 768, OC = 3072;
  auto x = act(p, {N, IC}, 14);
  auto w = act(p, {OC, IC}, 15, 0.05f);
  auto bias = act(p, {OC}, 16, 0.5f);
  auto out = poisoned(p, Kind::act, {N, OC});
  auto pre = poisoned(p, Kind::act, {N, OC});
  on_both(p, [&](const Side& s) { s.b().linear_forward({s(out), s(pre), s(x), s(w), s(bias)}); });
  KILN_CHECK_CLOSE(pre, 1e-2);
  KILN_CHECK_CLOSE(out, 1e-2);
  auto dout = act(p, {N, OC}, 17, 0.1f);
  auto dx = poisoned(p, Kind::act, {N, IC});
  auto dw = f32(p, {OC, IC}, 18);  // accumulated onto: the tuning runs must not touch it
  auto db = f32(p, {OC}, 19);
  on_both(p, [&](const Side& s) { s.b().linear_backward({s(dx), s(dw), s(db), s(dout), s(x), s(w), {}}); });
  KILN_CHECK_CLOSE(dx, 1e-2);
  KILN_CHECK_CLOSE(dw, 1e-3);
  KILN_CHECK_CLOSE(db, 1e-3);
  // The same calls without the tuning: the same bits (a tuned algorithm sums in the heuristic's order).
  const auto tuned = std::vector{out.gpu_values(), pre.gpu_values(), dx.gpu_values(), dw.gpu_values(), db.gpu_values()};
  untuned = ops::make_cuda_backend(0, {});
  std::swap(untuned, p.gpu);  // p.gpu untuned now; the tuned one lives on in `untuned`
  out.poison();
  pre.poison();
  dx.poison();
  dw.set(kiln::test::random_values(static_cast<std::size_t>(OC * IC), 18));
  db.set(kiln::test::random_values(static_cast<std::size_t>(OC), 19));
  const kiln::test::Side g{p, true};
  g.b().linear_forward({g(out), g(pre), g(x), g(w), g(bias)});
  g.b().linear_backward({g(dx), g(dw), g(db), g(dout), g(x), g(w), {}});
  p.gpu->synchronize();
  CHECK(out.gpu_values() == tuned[0]);
  CHECK(pre.gpu_values() == tuned[1]);
  CHECK(dx.gpu_values() == tuned[2]);
  CHECK(dw.gpu_values() == tuned[3]);
  CHECK(db.gpu_values() == tuned[4]);
}

TEST_CASE("cuda linear_backward matches the CPU: dx, dx with dgelu, dweight and dbias accumulated") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int N = 333;
  // IC = 72: fused DGELU epilogue; IC = 100: dx's ld is not a multiple of 8, dgelu runs unfused.
  // dbias from the weight gradient's GEMM (cuBLASLt's BGRADB), OC = 213 with dout's rows 2-byte aligned.
  for (int OC : {216, 213})
  for (int IC : {72, 100}) {
    INFO("OC = " << OC << ", IC = " << IC);
    auto x = act(p, {N, IC}, 21);
    auto w = act(p, {OC, IC}, 22, 0.1f);
    auto dout = act(p, {N, OC}, 23);
    auto pre = act(p, {N, IC}, 24, 2.0f);
    for (bool gelu : {false, true}) {
      INFO("dgelu " << gelu);
      auto dx = poisoned(p, Kind::act, {N, IC});
      auto dw = f32(p, {OC, IC}, 25);   // non-zero start: dweight is accumulated
      auto db = f32(p, {OC}, 26, 3.0f);  // likewise dbias
      on_both(p, [&](const Side& s) {
        ops::LinearBackward a;
        a.dx = s(dx);
        a.dweight = s(dw);
        a.dbias = s(db);
        a.dout = s(dout);
        a.x = s(x);
        a.weight = s(w);
        if (gelu) a.dx_gelu_pre = s(pre);
        s.b().linear_backward(a);
      });
      KILN_CHECK_CLOSE(dx, 1e-2);
      KILN_CHECK_CLOSE(dw, 1e-3);
      KILN_CHECK_CLOSE(db, 1e-3);
    }
  }
}

TEST_CASE("cuda linear_backward split as tensor parallelism's overlap calls it: dx alone by row ranges, then dweight and dbias alone") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int N = 333, OC = 216, IC = 72, cut = 150;
  auto x = act(p, {N, IC}, 31);
  auto w = act(p, {OC, IC}, 32, 0.1f);
  auto dout = act(p, {N, OC}, 33);
  auto pre = act(p, {N, IC}, 34, 2.0f);
  auto dx = poisoned(p, Kind::act, {N, IC});
  auto dw = f32(p, {OC, IC}, 35);
  auto db = f32(p, {OC}, 36, 3.0f);
  on_both(p, [&](const Side& s) {
    for (const auto& [r0, rows] : {std::pair{0, cut}, std::pair{cut, N - cut}}) {
      ops::LinearBackward a;  // dx alone, these rows
      a.dx = s(dx).rows(r0, rows);
      a.dout = s(dout).rows(r0, rows);
      a.x = s(x).rows(r0, rows);
      a.weight = s(w);
      a.dx_gelu_pre = s(pre).rows(r0, rows);
      s.b().linear_backward(a);
    }
    ops::LinearBackward g;  // the weight and bias gradients alone
    g.dweight = s(dw);
    g.dbias = s(db);
    g.dout = s(dout);
    g.x = s(x);
    g.weight = s(w);
    s.b().linear_backward(g);
  });
  KILN_CHECK_CLOSE(dx, 1e-2);
  KILN_CHECK_CLOSE(dw, 1e-3);
  KILN_CHECK_CLOSE(db, 1e-3);
}

TEST_CASE("cuda gelu_forward matches the CPU (also in place)") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int n = 1001;  // not a multiple of 8: a scalar tail
  auto x = act(p, {n}, 27, 2.0f);
  auto out = poisoned(p, Kind::act, {n});
  on_both(p, [&](const Side& s) { s.b().gelu_forward({s(out), s(x)}); });
  KILN_CHECK_CLOSE(out, 1e-2);  // same formula; only exp2 / reciprocal's last bits may differ before rounding
  on_both(p, [&](const Side& s) { s.b().gelu_forward({s(x), s(x)}); });
  KILN_CHECK_CLOSE(x, 1e-2);
}

// ---------------------------------------------------------------------------------------------
// layernorm

TEST_CASE("cuda layernorm forward and backward match the CPU") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int N = 333;
  // 72: vectorised paths; 75: C % 8 != 0, generic paths; 2048: 8 chunks per lane in registers.
  for (int C : {72, 75, 2048}) {
    INFO("C = " << C);
    auto x = act(p, {N, C}, 31, 2.0f, 0.5f);
    auto w = act(p, {C}, 32, 0.3f, 1.0f);
    auto b = act(p, {C}, 33, 0.3f);
    auto out = poisoned(p, Kind::act, {N, C});
    auto mean = poisoned(p, Kind::f32, {N});
    auto rstd = poisoned(p, Kind::f32, {N});
    on_both(p, [&](const Side& s) { s.b().layernorm_forward({s(out), s(mean), s(rstd), s(x), s(w), s(b), 1e-5f}); });
    KILN_CHECK_CLOSE(out, 1e-2);
    KILN_CHECK_CLOSE(mean, 1e-5);
    KILN_CHECK_CLOSE(rstd, 1e-5);

    // Backward from the CPU's statistics on both sides, so only the backward itself is compared.
    mean.set(mean.cpu_values());
    rstd.set(rstd.cpu_values());
    auto dout = act(p, {N, C}, 34);
    auto dx = act(p, {N, C}, 35);  // non-zero start: dx is accumulated
    auto dw = f32(p, {C}, 36);
    auto db = f32(p, {C}, 37);
    on_both(p, [&](const Side& s) {
      s.b().layernorm_backward({s(dx), s(dw), s(db), s(dout), s(x), s(w), s(mean), s(rstd)});
    });
    KILN_CHECK_CLOSE(dx, 1e-2);
    KILN_CHECK_CLOSE(dw, 1e-3);
    KILN_CHECK_CLOSE(db, 1e-3);
  }
}

// ---------------------------------------------------------------------------------------------
// embedding

TEST_CASE("cuda embedding forward and backward match the CPU (repeated tokens)") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int T = 111, B = 3, N = B * T, V = 517, Tmax = 128;
  for (int C : {72, 36}) {  // 36: C % 8 != 0, element-wise paths
    INFO("C = " << C);
    auto tok_host = random_ints(N, 41, 0, 40);  // 40 distinct ids over 333 positions: many repeats
    tok_host[5] = V - 1;
    Dual tokens(p, Kind::i32, {N});
    tokens.set_ints(tok_host);
    auto wte = act(p, {V, C}, 42);
    auto wpe = act(p, {Tmax, C}, 43);
    auto out = poisoned(p, Kind::act, {N, C});
    on_both(p, [&](const Side& s) { s.b().embedding_forward({s(out), s(tokens), s(wte), s(wpe), T}); });
    KILN_CHECK_CLOSE(out, 1e-2);

    auto dout = act(p, {N, C}, 44);
    auto dwte = f32(p, {V, C}, 45);  // non-zero starts: accumulated
    auto dwpe = f32(p, {Tmax, C}, 46);
    on_both(p, [&](const Side& s) {
      s.b().embedding_backward({s(dwte), s(dwpe), s(dout), s(tokens), tok_host.data(), T});
    });
    // The GPU adds each token's rows in position order onto the old value, the CPU's order of
    // additions: the results are bit-identical by construction; 1e-6 leaves room only for that.
    KILN_CHECK_CLOSE(dwte, 1e-6);
    KILN_CHECK_CLOSE(dwpe, 1e-6);
  }
}

TEST_CASE("cuda vocabulary-parallel embedding rows match the CPU (tokens of other rows read zeros)") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int T = 111, B = 3, N = B * T, V = 517, Tmax = 128, begin = 200, rows = 250;
  for (int C : {72, 36}) {
    INFO("C = " << C);
    auto tok_host = random_ints(N, 47, 150, 500);  // about a third outside [200, 450)
    Dual tokens(p, Kind::i32, {N});
    tokens.set_ints(tok_host);
    auto wte = act(p, {rows, C}, 48);
    auto wpe = act(p, {Tmax, C}, 49);
    for (bool positions : {true, false}) {
      auto out = poisoned(p, Kind::act, {N, C});
      on_both(p, [&](const Side& s) {
        s.b().embedding_forward({s(out), s(tokens), s(wte), s(wpe), T, begin, V, positions});
      });
      CHECK(mismatches(out.gpu_values(), out.cpu_values()) == 0);
    }
    auto dout = act(p, {N, C}, 50);
    auto dwte = f32(p, {rows, C}, 51);
    auto dwpe = f32(p, {Tmax, C}, 52);
    on_both(p, [&](const Side& s) {
      s.b().embedding_backward({s(dwte), s(dwpe), s(dout), s(tokens), tok_host.data(), T, begin, V});
    });
    KILN_CHECK_CLOSE(dwte, 1e-6);
    KILN_CHECK_CLOSE(dwpe, 1e-6);
  }
}

// ---------------------------------------------------------------------------------------------
// residual and dropout

namespace {
ops::DropoutArgs dropout_args(float prob) {
  ops::DropoutArgs d;
  d.p = prob;
  d.rng = {0x1234abcdull, 977, nullptr};
  d.row_offset = 3;  // odd offsets: chunks start at every position within a Philox block
  d.col_offset = 5;
  return d;
}
}  // namespace

TEST_CASE("cuda residual_forward matches the CPU with and without dropout") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int N = 333;
  for (int C : {72, 75}) {
    for (float prob : {0.0f, 0.1f}) {
      INFO("C = " << C << ", p = " << prob);
      auto res = act(p, {N, C}, 51);
      auto x = act(p, {N, C}, 52);
      auto out = poisoned(p, Kind::act, {N, C});
      auto d = dropout_args(prob);
      d.cols_total = C + 13;  // a column shard of a wider tensor
      on_both(p, [&](const Side& s) { s.b().residual_forward({s(out), s(res), s(x), d}); });
      // Same rounded fp32 operations on both sides: identical bits.
      CHECK(mismatches(out.gpu_values(), out.cpu_values()) == 0);
      KILN_CHECK_CLOSE(out, 1e-6);
    }
  }
}

TEST_CASE("cuda zero_many zeroes exactly its pieces (odd offsets and sizes), as the CPU, twice and with new pieces") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const std::int64_t n = 5003;
  auto buf = f32(p, {n}, 71, 1.0f, 3.0f);  // no zeros
  auto pieces = [](const Dual& d, bool gpu, std::vector<std::pair<std::int64_t, std::int64_t>> at) {
    std::vector<TensorView> out;
    const TensorView flat = gpu ? d.gpu() : d.cpu();
    for (auto [begin, count] : at) out.push_back(flat.flat_slice(begin, count));
    return out;
  };
  const std::vector<std::pair<std::int64_t, std::int64_t>> first = {{1, 3}, {7, 4093}, {4101, 1}, {4200, 800}, {5002, 1}};
  const std::vector<std::pair<std::int64_t, std::int64_t>> second = {{0, 2}, {4102, 9}};
  const std::vector<float> before = buf.cpu_values();
  std::vector<bool> zeroed(static_cast<std::size_t>(n), false);
  for (const auto* at : {&first, &first, &second}) {  // the same pieces again, then new ones
    on_both(p, [&](const Side& s) { s.b().zero_many(pieces(buf, s.gpu, *at)); });
    for (const auto& [b, k] : *at)
      for (std::int64_t i = b; i < b + k; ++i) zeroed[static_cast<std::size_t>(i)] = true;
    const auto g = buf.gpu_values();
    std::int64_t wrong = 0;
    for (std::size_t i = 0; i < g.size(); ++i) wrong += g[i] != (zeroed[i] ? 0.0f : before[i]);
    CHECK(wrong == 0);
    CHECK(g == buf.cpu_values());
  }
}

TEST_CASE("cuda residual_forward in place (out aliases residual)") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int N = 64, C = 72;
  auto res = act(p, {N, C}, 53);
  auto x = act(p, {N, C}, 54);
  on_both(p, [&](const Side& s) { s.b().residual_forward({s(res), s(res), s(x), dropout_args(0.2f)}); });
  CHECK(mismatches(res.gpu_values(), res.cpu_values()) == 0);
}

TEST_CASE("graph-safe dropout: every replay of a captured CUDA graph draws fresh masks, equal to eager draws") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int N = 129, C = 72;
  auto res = act(p, {N, C}, 55);
  auto x = act(p, {N, C}, 56);
  auto make_tracker = [] {
    rng::RngStatesTracker t(77);
    t.add(rng::kModelParallelRng, 78);
    return t;
  };
  auto drop = [](const rng::PhiloxArgs& r) {
    ops::DropoutArgs d;
    d.p = 0.3f;
    d.rng = r;
    return d;
  };
  // Eager: three steps, one draw each.
  auto eager = make_tracker();
  std::vector<std::vector<float>> expected;
  auto out = poisoned(p, Kind::act, {N, C});
  for (int k = 0; k < 3; ++k) {
    p.gpu->residual_forward({out.gpu(), res.gpu(), x.gpu(), drop(eager.draw(N * C))});
    p.gpu->synchronize();
    expected.push_back(out.gpu_values());
  }
  CHECK(mismatches(expected[0], expected[1]) > 0);
  // Captured once, replayed three times.
  auto t = make_tracker();
  Buffer bases = p.gpu->alloc(sizeof(std::uint64_t) * static_cast<std::size_t>(t.num_states()));
  auto stream = static_cast<cudaStream_t>(p.gpu->stream());
  t.begin_graph_capture(static_cast<std::uint64_t*>(bases.data()));
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  p.gpu->residual_forward({out.gpu(), res.gpu(), x.gpu(), drop(t.draw(N * C))});
  cudaGraph_t graph = nullptr;
  REQUIRE(cudaStreamEndCapture(stream, &graph) == cudaSuccess);
  const auto g = t.end_graph_capture();
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  for (int k = 0; k < 3; ++k) {
    const auto values = t.next_replay(g);
    REQUIRE(cudaMemcpyAsync(bases.data(), values.data(), values.size() * sizeof(std::uint64_t), cudaMemcpyHostToDevice,
                            stream) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
    p.gpu->synchronize();
    CHECK(mismatches(out.gpu_values(), expected[static_cast<std::size_t>(k)]) == 0);
  }
  CHECK(t.get_states() == eager.get_states());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_CASE("cuda dropout_backward: the zero pattern and values match the CPU exactly") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int N = 333;
  for (int C : {72, 75}) {
    for (bool in_place : {false, true}) {
      INFO("C = " << C << ", in place " << in_place);
      auto dout = act(p, {N, C}, 61);  // random normals: no zeros, so zeros are exactly the drops
      auto dx = poisoned(p, Kind::act, {N, C});
      auto d = dropout_args(0.25f);
      on_both(p, [&](const Side& s) {
        s.b().dropout_backward({in_place ? s(dout) : s(dx), s(dout), d});
      });
      const Dual& result = in_place ? dout : dx;
      auto g = result.gpu_values(), c = result.cpu_values();
      std::size_t zeros = 0, pattern_mismatch = 0;
      for (std::size_t i = 0; i < g.size(); ++i) {
        zeros += c[i] == 0.0f;
        pattern_mismatch += (g[i] == 0.0f) != (c[i] == 0.0f);
      }
      CHECK(pattern_mismatch == 0);
      CHECK(mismatches(g, c) == 0);
      // About a quarter dropped.
      CHECK(zeros > g.size() / 5);
      CHECK(zeros < g.size() * 3 / 10);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// cross-entropy

TEST_CASE("cuda cross_entropy matches the CPU: losses, dlogits, padded vocabulary, ignored rows") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  struct Case {
    int N, V, Vr;
  };
  // 517: odd V (element-wise kernel); 1032: cached in registers; 66000: too long to cache.
  for (auto [N, V, Vr] : {Case{37, 517, 500}, Case{37, 1032, 1000}, Case{5, 66000, 65990}}) {
    INFO("N = " << N << ", V = " << V << ", vocab_real = " << Vr);
    auto logits = act(p, {N, V}, 71, 2.0f);
    auto t = random_ints(N, 72, 0, Vr);
    t[1] = -1;      // ignored row
    t[2] = Vr - 1;  // the last real column
    Dual targets(p, Kind::i32, {N});
    targets.set_ints(t);
    auto losses = poisoned(p, Kind::f32, {N});
    const float dloss = 1.0f / N;
    on_both(p, [&](const Side& s) { s.b().cross_entropy({s(losses), s(logits), s(targets), Vr, dloss}); });
    KILN_CHECK_CLOSE(losses, 1e-5);
    KILN_CHECK_CLOSE(logits, 1e-2);
    auto g = logits.gpu_values();
    auto l = losses.gpu_values();
    CHECK(l[1] == 0.0f);
    bool zero_row = true, zero_pad = true;
    for (int v = 0; v < V; ++v) zero_row &= g[static_cast<std::size_t>(V) + v] == 0.0f;
    for (int n = 0; n < N; ++n)
      for (int v = Vr; v < V; ++v) zero_pad &= g[static_cast<std::size_t>(n) * V + v] == 0.0f;
    CHECK(zero_row);
    CHECK(zero_pad);
  }
}

TEST_CASE("cuda vocabulary-parallel cross-entropy (stats, then finish) matches the CPU") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int N = 37, R = 3, V = 344, Vr = 1000;  // 3 shards of 344 columns of a 1032-column vocabulary
  auto t = random_ints(N, 73, 0, Vr);
  t[1] = -1;
  t[2] = Vr - 1;  // in the last shard
  t[3] = 0;       // in the first
  Dual targets(p, Kind::i32, {N});
  targets.set_ints(t);
  std::vector<Dual> shards;
  auto all = poisoned(p, Kind::f32, {R, N, 3});
  for (int r = 0; r < R; ++r) {
    shards.emplace_back(act(p, {N, V}, 74 + r, 2.0f));
    auto st = poisoned(p, Kind::f32, {N, 3});
    on_both(p, [&](const Side& s) {
      s.b().cross_entropy_stats({s(st), s(shards[r]), s(targets), std::int64_t(r) * V, Vr});
      s.b().copy(s(all).flat_slice(std::int64_t(r) * N * 3, N * 3), s(st).reshape({N * 3}));
    });
    KILN_CHECK_CLOSE(st, 1e-5);
  }
  for (int r = 0; r < R; ++r) {
    auto losses = poisoned(p, Kind::f32, {N});
    on_both(p, [&](const Side& s) {
      s.b().cross_entropy_finish({s(losses), s(shards[r]), s(targets), s(all), std::int64_t(r) * V, Vr, 1.0f / N});
    });
    KILN_CHECK_CLOSE(losses, 1e-5);
    KILN_CHECK_CLOSE(shards[r], 1e-2);
    CHECK(losses.gpu_values()[1] == 0.0f);
  }
}

// ---------------------------------------------------------------------------------------------
// adamw

// AdamW's operands on both backends: random params, gradients and first moments, positive second
// moments, a poisoned bf16 copy (optional); run() applies one step with the given segments.
// moments: Kind::f32, or Kind::bf16 (optim.moments = "bf16"); gradient: the same (optim.grads).
struct AdamWCase {
  Dual params, grads, m, v, pact;
  bool with_act;
  // act_elements: the bf16 copy's size (P by default; more where segments put it elsewhere).
  AdamWCase(test::BackendPair& p, int P, std::uint64_t seed, bool act, Kind moments = Kind::f32, int act_elements = 0,
            Kind gradient = Kind::f32)
      : params(f32(p, {P}, seed)),
        grads(p, gradient, {P}),
        m(p, moments, {P}),
        v(p, moments, {P}),
        pact(act ? poisoned(p, Kind::act, {act_elements > 0 ? act_elements : P}) : Dual(p, Kind::act, {1})),
        with_act(act) {
    grads.set(random_values(P, seed + 1, 0.1f));
    m.set(random_values(P, seed + 2, 0.01f));
    auto vv = random_values(P, seed + 3, 1e-3f);
    for (auto& e : vv) e = std::fabs(e) + 1e-6f;  // second moments are positive
    v.set(vv);
  }
  void run(test::BackendPair& p, const std::vector<ops::AdamWSegment>& segs, float grad_scale, std::int64_t step) {
    on_both(p, [&](const Side& s) {
      ops::AdamW a;
      a.params = s(params);
      if (with_act) a.params_act = s(pact);
      a.grads = s(grads);
      a.m = s(m);
      a.v = s(v);
      a.segments = segs;
      a.lr = 1e-2f;
      a.weight_decay = 0.1f;
      a.grad_scale = grad_scale;
      a.step = step;
      s.b().adamw(a);
    });
    // The same formula; only FMA contraction differs: f32 results agree to ~1e-7.
    KILN_CHECK_CLOSE(params, 1e-6);
    KILN_CHECK_CLOSE(m, 1e-6);
    KILN_CHECK_CLOSE(v, 1e-6);
  }
};

TEST_CASE("cuda adamw matches the CPU: params, moments, bf16 copy, decay per segment") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int P = 1037;  // not a multiple of 4: a scalar tail
  AdamWCase c(p, P, 81, true);
  // Out of order, and a one-element segment inside a 4-element vector.
  c.run(p, {{601, 436, true}, {0, 600, true}, {600, 1, false}}, 0.7f, 3);
  KILN_CHECK_CLOSE(c.pact, 1e-2);
}

TEST_CASE("cuda adamw with bf16 moments matches the CPU's bits (vector path and scalar tail)") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  for (const int P : {1037, 4099}) {
    INFO("P " << P);
    AdamWCase c(p, P, 87, true, Kind::bf16);
    c.run(p, {{601, P - 601, true}, {0, 600, true}, {600, 1, false}}, 0.7f, 3);
    // The device computes adamw_update without contraction, as the host: the same f32 values, so
    // the same rounding to bf16.
    CHECK(c.params.gpu_values() == c.params.cpu_values());
    CHECK(c.m.gpu_values() == c.m.cpu_values());
    CHECK(c.v.gpu_values() == c.v.cpu_values());
  }
}

TEST_CASE("cuda adamw writes each segment's bf16 copy where it says, or none, as the CPU") {
  // A parameter store whose one-byte compute copies are apart (fp8.keep_weight_transpose = false):
  // act-dtype parts at other indices of the compute copy (one of them not a multiple of 4: the
  // scalar path), the one-byte parts and the padding with none.
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int P = 1037, A = 1500;
  AdamWCase c(p, P, 89, true, Kind::f32, A);
  using S = ops::AdamWSegment;
  c.run(p, {{0, 600, true, true, 700}, {600, 1, false, true, S::kNoAct}, {601, 400, true, true, 21},
            {1001, 36, false, true, S::kNoAct}},
        0.7f, 2);
  const auto got = c.pact.gpu_values(), want = c.pact.cpu_values(), params = c.params.cpu_values();
  CHECK(got == want);
  for (int k = 0; k < 600; ++k) CHECK(want[700 + k] == round_bf16(params[k]));
  for (int k = 0; k < 400; ++k) CHECK(want[21 + k] == round_bf16(params[601 + k]));
  CHECK(want[0] == round_bf16(1234.5f));  // not written: the poison as the act tensor holds it
  CHECK(want[A - 1] == round_bf16(1234.5f));
  // A copy outside the buffer is refused naming the segment.
  Dual small(p, Kind::act, {100});
  CHECK_THROWS_WITH_AS(
      on_both(p, [&](const Side& s) {
        ops::AdamW a;
        a.params = s(c.params);
        a.params_act = s(small);
        a.grads = s(c.grads);
        a.m = s(c.m);
        a.v = s(c.v);
        a.segments = {{0, P, true, true, 0}};
        s.b().adamw(a);
      }),
      doctest::Contains("act copy"), Error);
}

TEST_CASE("cuda adamw with two segments, with and without decay") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int P = 4099;
  auto params = f32(p, {P}, 85);
  auto grads = f32(p, {P}, 86, 0.1f);
  Dual m(p, Kind::f32, {P}), v(p, Kind::f32, {P});
  m.set(std::vector<float>(P, 0.0f));
  v.set(std::vector<float>(P, 0.0f));
  on_both(p, [&](const Side& s) {
    ops::AdamW a;
    a.params = s(params);
    a.grads = s(grads);
    a.m = s(m);
    a.v = s(v);
    a.segments = {{0, 3000, true}, {3000, P - 3000, false}};
    a.lr = 3e-3f;
    a.weight_decay = 0.5f;
    a.grad_scale = 2.0f;
    a.step = 1;
    s.b().adamw(a);
  });
  KILN_CHECK_CLOSE(params, 1e-6);
  KILN_CHECK_CLOSE(m, 1e-6);
  KILN_CHECK_CLOSE(v, 1e-6);
}

// The optimizer's path without the host: the norm and clipping scale made on the device equal the
// host path's of the same backend bit for bit (the same f32 partial sums, added in double in order;
// the optimizer's numbers do not change), the two backends' within 1e-6, AdamW reading its numbers
// from device memory equals AdamW given them on the host, and a NaN scale (a non-finite gradient)
// leaves parameters and moments as they were.
TEST_CASE("cuda grad_clip and AdamW from device scalars match the CPU, a non-finite gradient skips the step") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int P = 5003;
  for (const double max_norm : {0.0, 1.0, 1e9}) {
    INFO("max_norm " << max_norm);
    AdamWCase c(p, P, 91, true);
    Dual scalars(p, Kind::f32, {6});  // four floats, then the norm (a double) in the last two
    float lr = 1e-2f, bc1 = 0, bc2 = 0;
    ops::adamw_bias_corrections(0.9f, 0.95f, 4, bc1, bc2);
    scalars.set({lr, -1.0f, bc1, bc2, 0.0f, 0.0f});
    on_both(p, [&](const Side& s) {
      const TensorView sc = s(scalars);
      s.b().grad_clip({s(c.grads), max_norm, sc.as<float>(), reinterpret_cast<double*>(sc.as<float>() + 4)});
      ops::AdamW a;
      a.params = s(c.params);
      a.params_act = s(c.pact);
      a.grads = s(c.grads);
      a.m = s(c.m);
      a.v = s(c.v);
      a.segments = {{0, P, true}};
      a.weight_decay = 0.1f;
      a.scalars = sc.as<float>();
      s.b().adamw(a);
    });
    // Each backend's device-made norm is its host path's to the bit (its own sum_squares, in double,
    // then the same formula); the two backends' sums differ in order only.
    for (const bool gpu : {false, true}) {
      INFO((gpu ? "cuda" : "cpu"));
      const auto got = gpu ? scalars.gpu_values() : scalars.cpu_values();
      double norm = 0;
      std::memcpy(&norm, got.data() + 4, sizeof(norm));
      ops::Backend& b = gpu ? *p.gpu : *p.cpu;
      const double host = std::sqrt(b.sum_squares(gpu ? c.grads.gpu() : c.grads.cpu()));
      CHECK(std::memcmp(&norm, &host, sizeof(norm)) == 0);
      CHECK(got[ops::kAdamWGradScale] == ops::grad_clip_scale(host, max_norm));
    }
    double gpu_norm = 0, cpu_norm = 0;
    std::memcpy(&gpu_norm, scalars.gpu_values().data() + 4, sizeof(double));
    std::memcpy(&cpu_norm, scalars.cpu_values().data() + 4, sizeof(double));
    CHECK(gpu_norm == doctest::Approx(cpu_norm).epsilon(1e-6));
    KILN_CHECK_CLOSE(c.params, 1e-6);
    KILN_CHECK_CLOSE(c.m, 1e-6);
    KILN_CHECK_CLOSE(c.v, 1e-6);
  }
  // An infinite gradient: the scale is NaN and nothing is written, on either side.
  AdamWCase c(p, P, 93, true);
  auto grads = c.grads.cpu_values();
  grads[1234] = INFINITY;
  c.grads.set(grads);
  Dual scalars(p, Kind::f32, {6});
  scalars.set({1e-2f, 1.0f, 0.5f, 0.5f, 0.0f, 0.0f});
  const auto p0 = c.params.gpu_values(), m0 = c.m.gpu_values(), v0 = c.v.gpu_values();
  on_both(p, [&](const Side& s) {
    const TensorView sc = s(scalars);
    s.b().grad_clip({s(c.grads), 1.0, sc.as<float>(), reinterpret_cast<double*>(sc.as<float>() + 4)});
    ops::AdamW a;
    a.params = s(c.params);
    a.grads = s(c.grads);
    a.m = s(c.m);
    a.v = s(c.v);
    a.segments = {{0, P, true}};
    a.scalars = sc.as<float>();
    s.b().adamw(a);
  });
  CHECK(std::isnan(scalars.gpu_values()[ops::kAdamWGradScale]));
  CHECK(std::isnan(scalars.cpu_values()[ops::kAdamWGradScale]));
  CHECK(c.params.gpu_values() == p0);
  CHECK(c.m.gpu_values() == m0);
  CHECK(c.v.gpu_values() == v0);
  CHECK(c.params.cpu_values() == p0);
}

// Where ranks share the gradient the optimizer sums each rank's share of the squared norm on the
// device (sum_squares_parts: parts at awkward sizes, some held by several ranks, one left out), the
// ranks add those up on the stream, and grad_clip takes the sum: each backend's result is its host
// arithmetic's (its own sum_squares_each, the quotients added in double in order, rounded to f32) to
// the bit, and the norm and scale follow from that f32 as the host would make them.
TEST_CASE("cuda sum_squares_parts and grad_clip from a summed square equal each backend's host arithmetic") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const std::vector<int> sizes = {5003, 1, 77, 40000, 129};
  const std::vector<int> divisors = {1, 2, 0, 3, 1};
  std::vector<Dual> parts;
  for (std::size_t i = 0; i < sizes.size(); ++i) parts.push_back(f32(p, {sizes[i]}, 301 + i, 0.3f));
  Dual scalars(p, Kind::f32, {7});  // four floats, the norm (a double), the summed square
  for (const double max_norm : {0.0, 1.0, 1e9}) {
    INFO("max_norm " << max_norm);
    scalars.set({1e-2f, -1.0f, 0.5f, 0.5f, 0.0f, 0.0f, 0.0f});
    on_both(p, [&](const Side& s) {
      std::vector<TensorView> views;
      for (auto& d : parts) views.push_back(s(d));
      const TensorView sc = s(scalars);
      const TensorView sum(sc.as<float>() + 6, {1}, DType::f32, sc.device);
      s.b().sum_squares_parts({views, divisors, sum});
      s.b().grad_clip({.max_norm = max_norm, .scalars = sc.as<float>(),
                       .norm = reinterpret_cast<double*>(sc.as<float>() + 4), .sum_squares = sum.as<float>()});
    });
    for (const bool gpu : {false, true}) {
      INFO((gpu ? "cuda" : "cpu"));
      ops::Backend& b = gpu ? *p.gpu : *p.cpu;
      std::vector<TensorView> views;
      for (auto& d : parts) views.push_back(gpu ? d.gpu() : d.cpu());
      const std::vector<double> each = b.sum_squares_each(views);
      double total = 0;
      for (std::size_t i = 0; i < each.size(); ++i)
        if (divisors[i] > 0) total += each[i] / divisors[i];
      const auto got = gpu ? scalars.gpu_values() : scalars.cpu_values();
      const float want = static_cast<float>(total);
      CHECK(std::memcmp(&got[6], &want, sizeof(float)) == 0);
      double norm = 0;
      std::memcpy(&norm, got.data() + 4, sizeof(norm));
      const double host = std::sqrt(static_cast<double>(want));
      CHECK(std::memcmp(&norm, &host, sizeof(norm)) == 0);
      CHECK(got[ops::kAdamWGradScale] == ops::grad_clip_scale(host, max_norm));
    }
  }
  // Its arguments: one divisor a part, none negative, one f32 out.
  const TensorView one = parts[0].gpu();
  const int two[2] = {1, 1}, negative = -1;
  const TensorView out = scalars.gpu();
  CHECK_THROWS_WITH(p.gpu->sum_squares_parts({std::span(&one, 1), two, out}),
                    doctest::Contains("1 parts but 2 divisors"));
  CHECK_THROWS_WITH(p.gpu->sum_squares_parts({std::span(&one, 1), std::span(&negative, 1), out}),
                    doctest::Contains("divisors[0] = -1"));
}

TEST_CASE("cuda adamw with bf16 gradients matches the CPU (f32 and bf16 moments, vector path and scalar tail)") {
  // optim.grads = "bf16": the gradient read as f32 exactly; the same tolerance as the f32 gradient's
  // cases (bits where the moments are bf16, as there).
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  for (const Kind moments : {Kind::f32, Kind::bf16})
    for (const int P : {1037, 4099}) {
      INFO("P " << P << (moments == Kind::bf16 ? " bf16 moments" : " f32 moments"));
      AdamWCase c(p, P, 97, true, moments, 0, Kind::bf16);
      c.run(p, {{601, P - 601, true}, {0, 600, true}, {600, 1, false}}, 0.7f, 3);
      KILN_CHECK_CLOSE(c.pact, 1e-2);
      if (moments == Kind::bf16) {
        CHECK(c.params.gpu_values() == c.params.cpu_values());
        CHECK(c.m.gpu_values() == c.m.cpu_values());
        CHECK(c.v.gpu_values() == c.v.cpu_values());
      }
    }
}

TEST_CASE("cuda adamw with a bf16 gradient equals the GPU's step with an f32 gradient of the same values, bit for bit") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int P = 4099;
  AdamWCase with16(p, P, 99, true, Kind::f32, 0, Kind::bf16), with32(p, P, 99, true, Kind::f32, 0, Kind::f32);
  with32.grads.set(with16.grads.cpu_values());  // the bf16 values, held as f32
  for (AdamWCase* c : {&with16, &with32}) {
    ops::AdamW a;
    a.params = c->params.gpu();
    a.params_act = c->pact.gpu();
    a.grads = c->grads.gpu();
    a.m = c->m.gpu();
    a.v = c->v.gpu();
    a.segments = {{0, 1001, true}, {1001, P - 1001, false}};
    a.lr = 1e-2f;
    a.weight_decay = 0.1f;
    a.grad_scale = 0.7f;
    a.step = 2;
    p.gpu->adamw(a);
  }
  CHECK(test::same_bits(with16.params.gpu_values(), with32.params.gpu_values()));
  CHECK(test::same_bits(with16.m.gpu_values(), with32.m.gpu_values()));
  CHECK(test::same_bits(with16.v.gpu_values(), with32.v.gpu_values()));
  CHECK(test::same_bits(with16.pact.gpu_values(), with32.pact.gpu_values()));
}

// The norms of a bf16 gradient (optim.grads = "bf16"): on the GPU the partial sums of its elements'
// f32 values are those of an f32 tensor of the same values, so every result is the f32 gradient's to
// the bit; against the CPU, the f32 cases' tolerance (the summation order differs).
TEST_CASE("cuda sum_squares, grad_clip and sum_squares_parts of bf16 gradients equal the f32 gradients' bits") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const std::vector<int> sizes = {5003, 1, 77, 40000, 129};
  const std::vector<int> divisors = {1, 2, 0, 3, 1};
  std::vector<Dual> g16, g32;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    g16.emplace_back(p, Kind::bf16, Shape{sizes[i]});
    g16.back().set(random_values(sizes[i], 401 + i, 0.3f));
    g32.emplace_back(p, Kind::f32, Shape{sizes[i]});
    g32.back().set(g16.back().cpu_values());
  }
  std::vector<TensorView> v16, v32;
  for (std::size_t i = 0; i < sizes.size(); ++i) v16.push_back(g16[i].gpu()), v32.push_back(g32[i].gpu());
  const std::vector<double> each16 = p.gpu->sum_squares_each(v16), each32 = p.gpu->sum_squares_each(v32);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    INFO("part " << i);
    CHECK(std::memcmp(&each16[i], &each32[i], sizeof(double)) == 0);
    const double s = p.gpu->sum_squares(v16[i]);
    CHECK(std::memcmp(&s, &each16[i], sizeof(double)) == 0);
    CHECK(s == doctest::Approx(p.cpu->sum_squares(g16[i].cpu())).epsilon(1e-6));
  }
  Dual scalars(p, Kind::f32, {16});  // two sets: four floats, the norm (a double), the summed square
  scalars.set(std::vector<float>(16, 0.0f));
  const TensorView sc = scalars.gpu();
  float* base = sc.as<float>();
  const TensorView out16(base + 6, {1}, DType::f32, Device::cuda), out32(base + 14, {1}, DType::f32, Device::cuda);
  p.gpu->sum_squares_parts({v16, divisors, out16});
  p.gpu->sum_squares_parts({v32, divisors, out32});
  p.gpu->grad_clip({v16[3], 1.0, base, reinterpret_cast<double*>(base + 4)});
  p.gpu->grad_clip({v32[3], 1.0, base + 8, reinterpret_cast<double*>(base + 12)});
  const auto got = scalars.gpu_values();
  CHECK(std::memcmp(&got[0], &got[8], 8 * sizeof(float)) == 0);
  CHECK(got[6] > 0.0f);
  CHECK(got[ops::kAdamWGradScale] < 1.0f);  // the norm of 40000 values of 0.3 is above 1: clipped
}

TEST_CASE("cuda adamw leaves segments another module updates untouched") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int P = 2051;
  AdamWCase c(p, P, 87, true);
  const auto p0 = c.params.cpu_values(), m0 = c.m.cpu_values(), v0 = c.v.cpu_values();
  // Skipped: [64, 1088) (whole vectors) and [1301, 1302) (one element inside a vector).
  const std::vector<ops::AdamWSegment> segs = {
      {0, 64, true}, {64, 1024, true, false}, {1088, 213, false}, {1301, 1, true, false}, {1302, P - 1302, true}};
  c.run(p, segs, 0.9f, 2);
  const auto gp = c.params.gpu_values(), gm = c.m.gpu_values(), gv = c.v.gpu_values(), ga = c.pact.gpu_values();
  const auto poison = c.pact.cpu_values();  // the poison as the act dtype holds it (CPU side: untouched too)
  std::size_t moved = 0, untouched_act = 0, skipped = 0;
  for (const auto& seg : segs)
    for (std::int64_t i = seg.offset; i < seg.offset + seg.count; ++i) {
      const auto k = static_cast<std::size_t>(i);
      if (seg.update) {
        moved += gp[k] != p0[k];
      } else {
        ++skipped;
        CHECK(gp[k] == p0[k]);
        CHECK(gm[k] == m0[k]);
        CHECK(gv[k] == v0[k]);
        untouched_act += ga[k] == poison[k];  // never written
      }
    }
  CHECK(untouched_act == skipped);
  CHECK(moved > static_cast<std::size_t>(P) - skipped - 8);
}

TEST_CASE("cuda adamw skips a segment longer than the grid's stride") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int P = 20'000'003;  // more than one grid stride (8192 blocks x 256 threads x 4) on each side
  AdamWCase c(p, P, 91, false);
  const auto p0 = c.params.cpu_values();
  c.run(p, {{0, 1000, true}, {1000, 18'999'001, true, false}, {19'000'001, P - 19'000'001, false}}, 1.0f, 5);
  const auto gp = c.params.gpu_values();
  std::size_t changed_in_skip = 0, unchanged_outside = 0;
  for (std::size_t i = 0; i < gp.size(); ++i) {
    const bool skip = i >= 1000 && i < 19'000'001;
    if (skip) changed_in_skip += gp[i] != p0[i];
    else unchanged_outside += gp[i] == p0[i];
  }
  CHECK(changed_in_skip == 0);
  CHECK(unchanged_outside < 5);
}

// ---------------------------------------------------------------------------------------------
// utilities

TEST_CASE("cuda init_normal is bit-identical to the CPU") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  for (std::int64_t offset : {0, 3, 1001}) {
    INFO("global offset " << offset);
    auto d = poisoned(p, Kind::f32, {1001});
    rng::PhiloxArgs r{0xfeedbeefull, 12345, nullptr};
    on_both(p, [&](const Side& s) { s.b().init_normal(s(d), 0.02f, r, offset); });
    CHECK(same_bits(d.gpu_values(), d.cpu_values()));
  }
}

TEST_CASE("cuda fill and convert (both ways) match the CPU exactly") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int n = 1001;  // not a multiple of 8: a scalar tail
  auto src = f32(p, {n}, 91, 3.0f);
  auto as_act = poisoned(p, Kind::act, {n});
  on_both(p, [&](const Side& s) { s.b().convert(s(as_act), s(src)); });
  CHECK(same_bits(as_act.gpu_values(), as_act.cpu_values()));

  auto back = poisoned(p, Kind::f32, {n});
  on_both(p, [&](const Side& s) { s.b().convert(s(back), s(as_act)); });
  CHECK(same_bits(back.gpu_values(), back.cpu_values()));

  auto filled = poisoned(p, Kind::f32, {n});
  on_both(p, [&](const Side& s) { s.b().fill(s(filled), -0.375f); });
  CHECK(same_bits(filled.gpu_values(), filled.cpu_values()));
}

TEST_CASE("cuda add (dst += src, f32) matches the CPU exactly, aligned or not") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  for (int n : {1, 7, 1001, 65539}) {
    INFO("n = " << n);
    auto dst = f32(p, {n + 1}, 93, 2.0f);
    const auto src = f32(p, {n + 1}, 94, 0.5f, -1.0f);
    // From element 0 (16-byte aligned) and from element 1 (not): the vector and the scalar paths.
    for (std::int64_t at : {0, 1}) {
      const std::int64_t m = n + 1 - at;
      on_both(p, [&](const Side& s) { s.b().add(s(dst).flat_slice(at, m), s(src).flat_slice(at, m)); });
      CHECK(same_bits(dst.gpu_values(), dst.cpu_values()));
    }
  }
}

TEST_CASE("cuda sum_squares matches the CPU to 1e-6 relative") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  for (int n : {1, 1001, 100003, 3000001}) {
    INFO("n = " << n);
    auto x = f32(p, {n}, 92, 2.0f, 0.1f);
    const double cpu = p.cpu->sum_squares(x.cpu());
    const double gpu = p.gpu->sum_squares(x.gpu());
    CHECK(std::fabs(gpu - cpu) <= 1e-6 * cpu);
  }
}

TEST_CASE("cuda sum_squares_each equals sum_squares of each tensor bit for bit, with empty ones") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const std::vector<int> sizes{3001, 1, 0, 2048, 100003, 0, 4 * 8192 * 2 + 5, 77};
  std::vector<Dual> xs;
  std::vector<TensorView> gpu_views, cpu_views;
  xs.reserve(sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    xs.push_back(f32(p, {std::max(sizes[i], 1)}, 200 + i, 1.5f, -0.2f));
    TensorView g = xs.back().gpu(), c = xs.back().cpu();
    // An empty tensor: a view of no elements (the optimizer's list may hold one).
    gpu_views.push_back(sizes[i] ? g : TensorView(g.data, {0}, DType::f32, Device::cuda));
    cpu_views.push_back(sizes[i] ? c : TensorView(c.data, {0}, DType::f32, Device::cpu));
  }
  const auto gpu = p.gpu->sum_squares_each(gpu_views);
  const auto cpu = p.cpu->sum_squares_each(cpu_views);
  REQUIRE(gpu.size() == sizes.size());
  REQUIRE(cpu.size() == sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    INFO("tensor " << i << ", n = " << sizes[i]);
    const double alone = p.gpu->sum_squares(gpu_views[i]);
    CHECK(std::memcmp(&gpu[i], &alone, sizeof(double)) == 0);
    CHECK(std::fabs(gpu[i] - cpu[i]) <= 1e-6 * cpu[i]);
    if (sizes[i] == 0) CHECK(gpu[i] == 0.0);
    else CHECK(cpu[i] > 0.0);
  }
}

// ---------------------------------------------------------------------------------------------
// determinism: the same inputs give the same bits

TEST_CASE("cuda backward reductions are deterministic (embedding, layernorm, linear with bias)") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int T = 128, B = 4, N = B * T, C = 72, V = 300, OC = 216;
  auto tok_host = random_ints(N, 101, 0, 20);
  Dual tokens(p, Kind::i32, {N});
  tokens.set_ints(tok_host);
  auto dout = act(p, {N, C}, 102);
  auto x = act(p, {N, C}, 103);
  auto w = act(p, {C}, 104, 0.3f, 1.0f);
  auto mean = f32(p, {N}, 105, 0.1f);
  auto rstd = f32(p, {N}, 106, 0.1f, 1.0f);
  auto lin_dout = act(p, {N, OC}, 107);
  auto lin_w = act(p, {OC, C}, 108, 0.1f);
  auto dwte = f32(p, {V, C}, 109), dwpe = f32(p, {T, C}, 110);
  auto ln_dx = act(p, {N, C}, 111), ln_dw = f32(p, {C}, 112), ln_db = f32(p, {C}, 113);
  auto lin_dx = poisoned(p, Kind::act, {N, C});
  auto lin_dw = f32(p, {OC, C}, 114), lin_db = f32(p, {OC}, 115);
  std::vector<Dual*> outputs = {&dwte, &dwpe, &ln_dx, &ln_dw, &ln_db, &lin_dx, &lin_dw, &lin_db};
  // Remember the starting values, then run twice from them.
  std::vector<std::vector<float>> start;
  for (auto* d : outputs) start.push_back(d->cpu_values());
  std::vector<std::vector<float>> first;
  for (int run = 0; run < 2; ++run) {
    for (std::size_t i = 0; i < outputs.size(); ++i) outputs[i]->set(start[i]);
    auto& g = *p.gpu;
    g.embedding_backward({dwte.gpu(), dwpe.gpu(), dout.gpu(), tokens.gpu(), tok_host.data(), T});
    g.layernorm_backward({ln_dx.gpu(), ln_dw.gpu(), ln_db.gpu(), dout.gpu(), x.gpu(), w.gpu(), mean.gpu(), rstd.gpu()});
    ops::LinearBackward lb;
    lb.dx = lin_dx.gpu();
    lb.dweight = lin_dw.gpu();
    lb.dbias = lin_db.gpu();
    lb.dout = lin_dout.gpu();
    lb.x = x.gpu();
    lb.weight = lin_w.gpu();
    g.linear_backward(lb);
    g.synchronize();
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      auto values = outputs[i]->gpu_values();
      if (run == 0) first.push_back(values);
      else CHECK(same_bits(values, first[i]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// bf16 parameter gradients (optim.grads = "bf16"): the same sums in f32, onto the old bf16 value,
// rounded once (kiln's kernels; cuBLASLt's accumulating GEMM rounds the product first, see the
// linear case). Their f32 sums differ only in order, so each element may land one bf16 step apart:
// checked element by element within two bf16 ulps of the CPU's value (with a floor for elements that
// nearly cancel).

namespace {

Dual bf16_grad(kiln::test::BackendPair& p, Shape s, std::uint64_t seed, float scale = 1.0f) {
  Dual d(p, Kind::bf16, s);
  d.set(random_values(static_cast<std::size_t>(s.numel()), seed, scale));
  return d;
}

// `floor`: of the largest value, the error allowed where an element nearly cancels (by default two
// bf16 ulps of a thousandth of it).
void check_within_bf16_ulps(const Dual& d, const char* what, float ulps = 2.0f, float floor = 2e-3f / 128) {
  const auto g = d.gpu_values(), c = d.cpu_values();
  float top = 0;
  for (float v : c) top = std::max(top, std::fabs(v));
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < c.size(); ++i) {
    const float tol = std::max(ulps * std::ldexp(1.0f, -7) * std::fabs(c[i]), floor * top);
    if (!(std::fabs(g[i] - c[i]) <= tol) && bad++ == 0) first = i;
  }
  INFO(what << ": " << bad << " of " << c.size() << " elements beyond " << ulps << " bf16 ulps, the first at " << first
            << " (gpu " << g[first] << ", cpu " << c[first] << ")");
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("cuda linear_backward into bf16 gradients matches the CPU within two bf16 ulps, accumulated or written") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int N = 333, IC = 72;
  for (int OC : {216, 213})
    for (bool overwrite : {false, true})
      for (bool bias : {false, true}) {
        INFO("OC = " << OC << ", overwrite " << overwrite << ", bias " << bias);
        auto x = act(p, {N, IC}, 121);
        auto w = act(p, {OC, IC}, 122, 0.1f);
        auto dout = act(p, {N, OC}, 123);
        auto dw = bf16_grad(p, {OC, IC}, 124, 4.0f);
        auto db = bf16_grad(p, {OC}, 125, 8.0f);
        on_both(p, [&](const Side& s) {
          ops::LinearBackward a;
          a.dweight = s(dw);
          if (bias) a.dbias = s(db);
          a.dout = s(dout);
          a.x = s(x);
          a.weight = s(w);
          a.dweight_overwrite = overwrite;
          s.b().linear_backward(a);
        });
        // cuBLASLt's accumulating kernel (algorithm 66 on an H200) lands up to 7 bf16 ulps from the
        // CPU's once-rounded sum on 1.3% of the elements, those that nearly cancel: within half an
        // ulp of the product's magnitude, as a product rounded to bf16 before the old value is added
        // (what Megatron's main_grad.add_ of a bf16 GEMM output does). Hence the floor of one bf16
        // ulp of the largest value.
        check_within_bf16_ulps(dw, "dweight", 2.0f, std::ldexp(1.0f, -8));
        if (bias) check_within_bf16_ulps(db, "dbias");
      }
}

TEST_CASE("cuda layernorm and rmsnorm backward into bf16 gradients match the CPU within two bf16 ulps") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int N = 333;
  for (int C : {72, 75}) {  // vectorised and generic paths
    INFO("C = " << C);
    auto x = act(p, {N, C}, 131, 2.0f, 0.5f);
    auto w = act(p, {C}, 132, 0.3f, 1.0f);
    auto b = act(p, {C}, 133, 0.3f);
    auto out = poisoned(p, Kind::act, {N, C});
    auto mean = poisoned(p, Kind::f32, {N});
    auto rstd = poisoned(p, Kind::f32, {N});
    p.cpu->layernorm_forward({out.cpu(), mean.cpu(), rstd.cpu(), x.cpu(), w.cpu(), b.cpu(), 1e-5f});
    mean.set(mean.cpu_values());
    rstd.set(rstd.cpu_values());
    auto dout = act(p, {N, C}, 134);
    auto dx = act(p, {N, C}, 135);
    auto dw = bf16_grad(p, {C}, 136, 8.0f), db = bf16_grad(p, {C}, 137, 8.0f);
    on_both(p, [&](const Side& s) {
      s.b().layernorm_backward({s(dx), s(dw), s(db), s(dout), s(x), s(w), s(mean), s(rstd)});
    });
    KILN_CHECK_CLOSE(dx, 1e-2);
    check_within_bf16_ulps(dw, "layernorm dweight");
    check_within_bf16_ulps(db, "layernorm dbias");

    auto rdx = act(p, {N, C}, 138);
    auto rdw = bf16_grad(p, {C}, 139, 8.0f);
    on_both(p, [&](const Side& s) { s.b().rmsnorm_backward({s(rdx), s(rdw), s(dout), s(x), s(w), s(rstd)}); });
    KILN_CHECK_CLOSE(rdx, 1e-2);
    check_within_bf16_ulps(rdw, "rmsnorm dweight");
  }
}

TEST_CASE("cuda embedding backward into bf16 gradients matches the CPU within two bf16 ulps") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  const int T = 111, B = 3, N = B * T, V = 517, Tmax = 128;
  for (int C : {72, 36}) {
    INFO("C = " << C);
    auto tok_host = random_ints(N, 141, 0, 40);
    Dual tokens(p, Kind::i32, {N});
    tokens.set_ints(tok_host);
    auto dout = act(p, {N, C}, 142);
    auto dwte = bf16_grad(p, {V, C}, 143), dwpe = bf16_grad(p, {Tmax, C}, 144);
    on_both(p, [&](const Side& s) {
      s.b().embedding_backward({s(dwte), s(dwpe), s(dout), s(tokens), tok_host.data(), T});
    });
    // The same additions in the same order as the CPU, one rounding: the same bits.
    CHECK(same_bits(dwte.gpu_values(), dwte.cpu_values()));
    CHECK(same_bits(dwpe.gpu_values(), dwpe.cpu_values()));
  }
}

TEST_CASE("cuda add of bf16 gradients matches the CPU exactly, aligned or not, and refuses mixed dtypes") {
  auto p = kiln::test::backend_pair();
  KILN_REQUIRE_GPU(p);
  for (int n : {1, 7, 1001, 65539}) {
    INFO("n = " << n);
    auto dst = bf16_grad(p, {n + 1}, 151, 2.0f);
    const auto src = bf16_grad(p, {n + 1}, 152, 0.5f);
    for (std::int64_t at : {0, 1}) {
      const std::int64_t m = n + 1 - at;
      on_both(p, [&](const Side& s) { s.b().add(s(dst).flat_slice(at, m), s(src).flat_slice(at, m)); });
      CHECK(same_bits(dst.gpu_values(), dst.cpu_values()));
    }
  }
  auto a = bf16_grad(p, {8}, 153);
  auto b = f32(p, {8}, 154);
  CHECK_THROWS_WITH(p.gpu->add(a.gpu(), b.gpu()), doctest::Contains("add src: expected a contiguous bf16"));
}
