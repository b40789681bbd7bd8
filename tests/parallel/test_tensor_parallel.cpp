// kiln::tensor_parallel's layers on their own (no World, no model): tp = 2 and 4 CPU-thread ranks
// against the unsplit layer on one rank, with and without sequence parallelism, on random data.
// What each rank computes alone (its output columns, its weight gradient rows or columns, lookups)
// must be bit-identical to the unsplit layer; what is summed over the group (partial products)
// equal to fp32 rounding.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kiln/fp8/linear.hpp"
#include "kiln_test.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/ops/linear_impl.hpp"
#include "kiln/parallel/comm_overlap.hpp"
#include "kiln/parallel/in_process.hpp"
#include "kiln/parallel/parallel_linear.hpp"
#include "kiln/parallel/tensor_parallel.hpp"
#include "kiln/parallel/vocab_parallel.hpp"

using namespace kiln;
using namespace kiln::parallel;

namespace {

using Vec = std::vector<float>;

Vec random_vec(std::size_t n, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  Vec v(n);
  for (auto& x : v) x = d(g);
  return v;
}

TensorView view(Vec& v, Shape s) { return TensorView(v.data(), s, DType::f32, Device::cpu); }

// The elements of `global` (a logical tensor of shape `shape`) that `shard` holds, in local order.
Vec take(const Vec& global, const Shape& shape, const TensorShard& shard) {
  Vec out(static_cast<std::size_t>(shard.local_shape(shape).numel()));
  shard.for_each_block(shape, [&](const TensorShard::Block& b) {
    std::copy_n(global.begin() + b.global, b.count, out.begin() + b.local);
  });
  return out;
}

// Columns [c0, c0 + n) of a row-major [rows, cols] matrix.
Vec columns(const Vec& m, std::int64_t rows, std::int64_t cols, std::int64_t c0, std::int64_t n) {
  Vec out(static_cast<std::size_t>(rows * n));
  for (std::int64_t r = 0; r < rows; ++r) std::copy_n(m.begin() + r * cols + c0, n, out.begin() + r * n);
  return out;
}

// Each row's `shard` of a row-major [rows, cols] matrix (a column-parallel layer's output columns).
Vec shard_columns(const Vec& m, std::int64_t rows, std::int64_t cols, const TensorShard& shard) {
  Vec out;
  for (std::int64_t r = 0; r < rows; ++r) {
    const Vec part = take(Vec(m.begin() + r * cols, m.begin() + (r + 1) * cols), {cols}, shard);
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

Vec rows_of(const Vec& m, std::int64_t cols, std::int64_t r0, std::int64_t n) {
  return Vec(m.begin() + r0 * cols, m.begin() + (r0 + n) * cols);
}

double relative_difference(const Vec& a, const Vec& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += double(a[i] - b[i]) * (a[i] - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Runs fn(tp) on `size` thread ranks forming one TP group (sequence/vocabulary parallel as asked),
// each with its own CPU backend; fails the test with every rank's error.
void run_group(int size, TensorParallelOptions options, const std::function<void(const TensorParallel&)>& fn) {
  auto hub = std::make_shared<InProcessHub>(size, std::chrono::seconds(20));
  std::vector<int> members(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) members[static_cast<std::size_t>(r)] = r;
  std::vector<std::string> errors(static_cast<std::size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r)
    threads.emplace_back([&, r] {
      try {
        auto be = ops::make_cpu_backend({.threads = 1});
        auto comm = hub->communicator("tp", members, r);
        const TensorParallel tp(*comm, *be, options);
        fn(tp);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
        hub->abort(cat("rank ", r, " failed: ", e.what()));
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < size; ++r) CHECK_MESSAGE(errors[static_cast<std::size_t>(r)].empty(), "rank ", r, ": ", errors[static_cast<std::size_t>(r)]);
}

// One rank alone: the unsplit layer.
void run_single(const std::function<void(const TensorParallel&)>& fn) { run_group(1, {}, fn); }

// The unsplit linear layer on one rank: y = x W^T + b and its gradients for dy.
struct LinearReference {
  Vec y, dx, dw, db;
};
LinearReference unsplit_linear(const Vec& x, const Vec& w, const Vec& b, const Vec& dy, std::int64_t N, std::int64_t in,
                               std::int64_t out) {
  LinearReference r{Vec(N * out), Vec(N * in, 0.0f), Vec(out * in, 0.0f), Vec(out, 0.0f)};
  run_single([&](const TensorParallel& tp) {
    auto& be = tp.backend();
    Vec xs = x, ws = w, bs = b, dys = dy;
    be.linear_forward({view(r.y, {N, out}), {}, view(xs, {N, in}), view(ws, {out, in}), view(bs, {out})});
    be.linear_backward({view(r.dx, {N, in}), view(r.dw, {out, in}), view(r.db, {out}), view(dys, {N, out}),
                        view(xs, {N, in}), view(ws, {out, in})});
  });
  return r;
}

struct Layout {
  int tp;
  bool sp;
  std::string str() const { return cat("tp=", tp, sp ? " with sequence parallelism" : ""); }
};
const Layout kLayouts[] = {{2, false}, {4, false}, {2, true}, {4, true}};

}  // namespace

TEST_CASE("a column-parallel linear computes the unsplit layer's output columns and weight gradients, and its summed input gradient") {
  const std::int64_t N = 20, in = 7;
  for (int parts : {1, 3}) {
    const std::int64_t out = 24;
    const Vec x = random_vec(N * in, 1), w = random_vec(out * in, 2), b = random_vec(out, 3), dy = random_vec(N * out, 4);
    const auto [y_ref, dx_ref, dw_ref, db_ref] = unsplit_linear(x, w, b, dy, N, in, out);
    for (const Layout& L : kLayouts) {
      INFO(L.str(), ", ", parts, " parts");
      run_group(L.tp, {L.sp, false}, [&](const TensorParallel& tp) {
        const ColumnParallelLinear layer(tp, in, out, parts);
        const std::int64_t lo = layer.local_out(), Nl = tp.local_rows(N);
        CHECK(lo == out / L.tp);
        const TensorShard shard = layer.weight_shard();
        Vec wl = take(w, {out, in}, shard), bl = take(b, {out}, shard);
        Vec x_full(N * in, 0.0f), x_local = rows_of(x, in, tp.first_local_row(N), Nl);
        Vec y(N * lo);
        const auto impl = ops::backend_linear_impl(tp.backend());
        layer.forward(impl, {view(y, {N, lo}), {}, view(x_full, {N, in}), view(wl, {lo, in}), view(bl, {lo})},
                      view(x_local, {Nl, in}));
        CHECK(y == shard_columns(y_ref, N, out, shard));  // this rank's output columns, bit for bit
        if (L.sp) CHECK(x_full == x);                      // the input was gathered

        Vec dy_local = shard_columns(dy, N, out, shard);
        Vec& x_used = L.sp ? x_full : x_local;  // the input the forward multiplied
        Vec dx(N * in, 0.0f), dx_local(Nl * in, 0.0f), dw(lo * in, 0.0f), db(lo, 0.0f);
        const TensorView got = layer.backward(impl,
                                              {view(dx, {N, in}), view(dw, {lo, in}), view(db, {lo}),
                                               view(dy_local, {N, lo}), view(x_used, {N, in}), view(wl, {lo, in})},
                                              view(dx_local, {Nl, in}));
        CHECK(dw == take(dw_ref, {out, in}, shard));
        CHECK(db == take(db_ref, {out}, shard));
        CHECK(got.numel() == Nl * in);
        const Vec mine(got.as<float>(), got.as<float>() + got.numel());
        CHECK(relative_difference(mine, rows_of(dx_ref, in, tp.first_local_row(N), Nl)) < 1e-6);
      });
    }
  }
}

TEST_CASE("a row-parallel linear sums its partial outputs over the group, the bias added once, and computes its own gradient columns") {
  const std::int64_t N = 12, in = 24, out = 5;
  const Vec x = random_vec(N * in, 11), w = random_vec(out * in, 12), b = random_vec(out, 13), dy = random_vec(N * out, 14);
  const auto [y_ref, dx_ref, dw_ref, db_ref] = unsplit_linear(x, w, b, dy, N, in, out);
  for (const Layout& L : kLayouts) {
    INFO(L.str());
    run_group(L.tp, {L.sp, false}, [&](const TensorParallel& tp) {
      const RowParallelLinear layer(tp, in, out);
      const std::int64_t li = layer.local_in(), Nl = tp.local_rows(N), r0 = tp.first_local_row(N);
      const auto [c0, c1] = tp.split(in);
      CHECK(li == c1 - c0);
      Vec wl = take(w, {out, in}, layer.weight_shard()), bs = b;
      Vec xl = columns(x, N, in, c0, li);
      Vec y_full(N * out, 0.0f), y_local(Nl * out, 0.0f);
      const auto impl = ops::backend_linear_impl(tp.backend());
      layer.forward(impl, {view(y_full, {N, out}), {}, view(xl, {N, li}), view(wl, {out, li}), view(bs, {out})},
                    view(y_local, {Nl, out}));
      CHECK(relative_difference(y_local, rows_of(y_ref, out, r0, Nl)) < 1e-6);

      Vec dy_full(N * out, 0.0f), dy_local = rows_of(dy, out, r0, Nl);
      Vec dx(N * li, 0.0f), dw(out * li, 0.0f), db(out, 0.0f);
      layer.backward(impl,
                     {view(dx, {N, li}), view(dw, {out, li}), view(db, {out}), view(dy_full, {N, out}),
                      view(xl, {N, li}), view(wl, {out, li})},
                     view(dy_local, {Nl, out}));
      CHECK(dx == columns(dx_ref, N, in, c0, li));
      CHECK(dw == take(dw_ref, {out, in}, layer.weight_shard()));
      CHECK(db == db_ref);  // whole on every rank
    });
  }
}

TEST_CASE("a vocabulary-parallel embedding looks up and learns exactly what the whole table does") {
  const std::int64_t V = 32, C = 6, T = 4, N = 16;
  const Vec wte = random_vec(V * C, 21), wpe = random_vec(T * C, 22), dout = random_vec(N * C, 23);
  std::vector<std::int32_t> tokens(N);
  std::mt19937 g(24);
  for (auto& t : tokens) t = static_cast<std::int32_t>(g() % V);
  Vec out_ref(N * C), dwte_ref(V * C, 0.0f), dwpe_ref(T * C, 0.0f);
  auto tokens_view = [&] { return TensorView(tokens.data(), {N}, DType::i32, Device::cpu); };
  run_single([&](const TensorParallel& tp) {
    const VocabParallelEmbedding emb(tp, V, C);
    Vec we = wte, wp = wpe, d = dout;
    emb.forward({view(out_ref, {N, C}), tokens_view(), view(we, {V, C}), view(wp, {T, C}), int(T)}, view(out_ref, {N, C}));
    emb.backward({view(dwte_ref, {V, C}), view(dwpe_ref, {T, C}), view(d, {N, C}), tokens_view(), tokens.data(), int(T)},
                 view(d, {N, C}));
  });
  for (const Layout& L : kLayouts)
    for (bool vp : {false, true}) {
      INFO(L.str(), vp ? ", vocabulary parallel" : "");
      run_group(L.tp, {L.sp, vp}, [&](const TensorParallel& tp) {
        const VocabParallelEmbedding emb(tp, V, C);
        const std::int64_t Vl = emb.local_vocab(), Nl = tp.local_rows(N), r0 = tp.first_local_row(N);
        CHECK(Vl == (vp ? V / L.tp : V));
        Vec wl = take(wte, {V, C}, emb.weight_shard()), wp = wpe;
        Vec full(N * C, 0.0f), local(Nl * C, 0.0f);
        emb.forward({view(full, {N, C}), tokens_view(), view(wl, {Vl, C}), view(wp, {T, C}), int(T)}, view(local, {Nl, C}));
        CHECK(local == rows_of(out_ref, C, r0, Nl));

        Vec d_full(N * C, 0.0f), d_local = rows_of(dout, C, r0, Nl), dwte(Vl * C, 0.0f), dwpe(T * C, 0.0f);
        emb.backward({view(dwte, {Vl, C}), view(dwpe, {T, C}), view(d_full, {N, C}), tokens_view(), tokens.data(), int(T)},
                     view(d_local, {Nl, C}));
        CHECK(dwte == take(dwte_ref, {V, C}, emb.weight_shard()));
        CHECK(dwpe == dwpe_ref);
      });
    }
}

TEST_CASE("a vocabulary-parallel cross-entropy gives every rank the whole loss and its columns of dlogits") {
  const std::int64_t Vp = 40, N = 9;
  const int V = 37;  // the last 3 columns are padding
  const Vec logits = random_vec(N * Vp, 31);
  std::vector<std::int32_t> targets(N);
  std::mt19937 g(32);
  for (auto& t : targets) t = static_cast<std::int32_t>(g() % V);
  targets[4] = -1;  // ignored
  auto targets_view = [&] { return TensorView(targets.data(), {N}, DType::i32, Device::cpu); };
  Vec loss_ref(N), dlogits_ref = logits;
  const float dloss = 1.0f / 9;
  run_single([&](const TensorParallel& tp) {
    VocabParallelCrossEntropy(tp, Vp, V, N).forward(view(loss_ref, {N}), view(dlogits_ref, {N, Vp}), targets_view(), dloss);
  });
  CHECK(loss_ref[4] == 0.0f);
  for (int size : {2, 4}) {
    INFO("tp=", size);
    run_group(size, {false, true}, [&](const TensorParallel& tp) {
      const VocabParallelCrossEntropy ce(tp, Vp, V, N);
      const auto [c0, c1] = tp.split(Vp);
      Vec mine = columns(logits, N, Vp, c0, c1 - c0), loss(N);
      ce.forward(view(loss, {N}), view(mine, {N, c1 - c0}), targets_view(), dloss);
      CHECK(relative_difference(loss, loss_ref) < 1e-6);
      CHECK(relative_difference(mine, columns(dlogits_ref, N, Vp, c0, c1 - c0)) < 1e-6);
    });
  }
}

TEST_CASE("entering a sequence-parallel region gathers the rows, its backward sums every rank's partial rows") {
  const std::int64_t N = 8, C = 3;
  for (int size : {2, 4})
    run_group(size, {true, false}, [&](const TensorParallel& tp) {
      const std::int64_t Nl = tp.local_rows(N);
      REQUIRE(Nl == N / size);
      Vec local(Nl * C), full(N * C, 0.0f);
      for (std::int64_t i = 0; i < Nl * C; ++i) local[i] = float(tp.first_local_row(N) * C + i);
      tp.enter(view(full, {N, C}), view(local, {Nl, C}));
      for (std::int64_t i = 0; i < N * C; ++i) CHECK(full[i] == float(i));
      // Every rank holds rank+1 times the whole: the sum of its rows is (1 + ... + size) times them.
      Vec partial(N * C), mine(Nl * C);
      for (std::int64_t i = 0; i < N * C; ++i) partial[i] = float(i) * float(tp.rank() + 1);
      tp.enter_backward(view(mine, {Nl, C}), view(partial, {N, C}));
      const float times = float(size * (size + 1) / 2);
      for (std::int64_t i = 0; i < Nl * C; ++i) CHECK(mine[i] == float(tp.first_local_row(N) * C + i) * times);
      // Rows kept in parts whatever the SP setting: a rank's part and all of them back.
      Vec part(N / size * C), again(N * C, 0.0f);
      const TensorView p = tp.row_part(view(full, {N, C}));
      std::copy_n(p.as<float>(), p.numel(), part.begin());
      tp.gather_row_parts(view(again, {N, C}), view(part, {N / size, C}));
      CHECK(again == full);
    });
}

TEST_CASE("without sequence parallelism the region's entry is free and its exit an all-reduce in place") {
  run_group(2, {false, false}, [](const TensorParallel& tp) {
    Vec t = {1.0f + tp.rank(), 10.0f};
    tp.enter(view(t, {1, 2}), view(t, {1, 2}));  // nothing to gather
    CHECK(t == Vec{1.0f + tp.rank(), 10.0f});
    tp.exit(view(t, {1, 2}), view(t, {1, 2}));
    CHECK(t == Vec{3.0f, 20.0f});
    Vec other(2);
    CHECK_THROWS_WITH(tp.enter(view(t, {1, 2}), view(other, {1, 2})), doctest::Contains("needs one tensor"));
  });
}

TEST_CASE("dimensions that do not split over the group are refused, naming the key") {
  const auto problems =
      check_splits(4, {{12, "model.n_head", "attention heads"}, {6, "model.vocab_size", "vocabulary rows"}, {8, "k", "x"}});
  REQUIRE(problems.size() == 1);
  CHECK(problems[0].key == "model.vocab_size");
  CHECK(problems[0].message == "6 vocabulary rows do not split over the 4 ranks of the tensor-parallel group (parallel.tp)");
  CHECK(check_splits(1, {{7, "a", "b"}}).empty());
  run_group(4, {}, [](const TensorParallel& tp) {
    CHECK_THROWS_WITH(ColumnParallelLinear(tp, 8, 6), doctest::Contains("do not split over the 4 ranks"));
    CHECK_THROWS_WITH(RowParallelLinear(tp, 10, 8), doctest::Contains("10 input features do not split"));
    CHECK_NOTHROW(ColumnParallelLinear(tp, 8, 6, 1, /*split=*/false));
    const ColumnParallelLinear qkv(tp, 8, 24, 3);  // 3 parts of 8 rows: 2 of each per rank
    CHECK(qkv.weight_shard().ranges.size() == 3);
    CHECK(qkv.weight_shard().extent() == 6);
  });
}

// ---- parallel.tp_comm_overlap: the same schedule in pieces, bit for bit ----

TEST_CASE("row pieces cover each rank's share in near-equal consecutive pieces, every rank's k-th piece before the k+1-th") {
  const auto p = row_pieces(20, 4, 3);  // shares of 5 rows: pieces of 1, 2, 2
  REQUIRE(p.size() == 12);
  CHECK(p[0].begin == 0);
  CHECK(p[0].rows == 1);
  CHECK(p[1].owner == 1);
  CHECK(p[1].begin == 5);
  CHECK(p[4].begin == 1);
  CHECK(p[4].rows == 2);
  std::vector<int> seen(20, 0);
  for (const RowPiece& r : p) {
    CHECK(r.rows > 0);
    CHECK(r.begin / 5 == r.owner);
    for (std::int64_t i = r.begin; i < r.begin + r.rows; ++i) ++seen[static_cast<std::size_t>(i)];
  }
  CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
  CHECK(row_pieces(6, 2, 8).size() == 6);  // a share of 3 rows: 3 pieces of one row
  CHECK_THROWS(row_pieces(7, 2, 1));
}

namespace {

// Every tensor a rank's column- and row-parallel layers produce, forward and backward, per rank.
struct LayerRun {
  std::vector<Vec> col, row;  // per rank: the outputs concatenated
  std::vector<int> backward_calls, told;  // per rank: the layers' backward calls, those with dgrad_queued
  std::vector<int> piece_calls;           // per rank: forward_pieces calls
};

// `splits`: the implementation takes calls split by rows (ops::LinearImpl::splits_rows), as the
// backend's does; without, as an FP8 layer's, fc1's backward overlaps (one call, dgrad_queued) and,
// with `pieces` (LinearImpl::forward_pieces), fc2's forward.
LayerRun run_layers(const Layout& L, bool overlap, int chunks, std::int64_t N = 20, bool splits = true,
                    bool pieces = false) {
  const std::int64_t in = 8, hid = 12;
  const Vec x = random_vec(N * in, 41), w1 = random_vec(hid * in, 42), b1 = random_vec(hid, 43),
            w2 = random_vec(in * hid, 44), b2 = random_vec(in, 45), dy = random_vec(N * in, 46),
            pre = random_vec(N * hid, 47);
  const auto n = static_cast<std::size_t>(L.tp);
  LayerRun out{std::vector<Vec>(n), std::vector<Vec>(n), std::vector<int>(n), std::vector<int>(n),
               std::vector<int>(n)};
  run_group(L.tp, {L.sp, false, overlap, chunks}, [&](const TensorParallel& tp) {
    CHECK((tp.comm_overlap() != nullptr) == overlap);
    const auto me = static_cast<std::size_t>(tp.rank());
    auto impl = ops::backend_linear_impl(tp.backend());
    impl.splits_rows = splits;
    if (pieces)
      impl.forward_pieces = [&be = tp.backend(), &out, me](const ops::LinearForward& f,
                                                          std::span<const ops::RowsOut> rows,
                                                          const ops::PieceQueued& queued) {
        ++out.piece_calls[me];
        for (std::size_t k = 0; k < rows.size(); ++k) {
          ops::LinearForward p = f;
          p.x = ops::plain_tensor(f.x).rows(rows[k].begin, rows[k].rows);
          p.out = rows[k].out;
          be.linear_forward(p);
          queued(k);
        }
      };
    impl.backward = [&be = tp.backend(), &out, me](const ops::LinearBackward& a) {
      ++out.backward_calls[me];
      if (a.dgrad_queued) ++out.told[me];
      be.linear_backward(a);
    };
    const std::int64_t Nl = tp.local_rows(N), r0 = tp.first_local_row(N);
    auto keep = [](Vec& into, std::initializer_list<const Vec*> vs) {
      for (const Vec* v : vs) into.insert(into.end(), v->begin(), v->end());
    };
    // fc1: column-parallel with a GELU epilogue
    const ColumnParallelLinear fc1(tp, in, hid);
    const std::int64_t lh = fc1.local_out();
    Vec w1l = take(w1, {hid, in}, fc1.weight_shard()), b1l = take(b1, {hid}, fc1.weight_shard());
    Vec x_full(N * in, 0.0f), x_local = rows_of(x, in, r0, Nl), h(N * lh), hpre(N * lh);
    fc1.forward(impl, {view(h, {N, lh}), view(hpre, {N, lh}), view(x_full, {N, in}), view(w1l, {lh, in}), view(b1l, {lh})},
                view(x_local, {Nl, in}));
    Vec dh = shard_columns(random_vec(N * hid, 48), N, hid, fc1.weight_shard());
    Vec& x_used = L.sp ? x_full : x_local;
    Vec dx(N * in, 0.0f), dx_local(Nl * in, 0.0f), dw1(lh * in, 0.5f), db1(lh, 0.25f);
    const TensorView got = fc1.backward(impl,
                                        {view(dx, {N, in}), view(dw1, {lh, in}), view(db1, {lh}), view(dh, {N, lh}),
                                         view(x_used, {N, in}), view(w1l, {lh, in})},
                                        view(dx_local, {Nl, in}));
    const Vec mine(got.as<float>(), got.as<float>() + got.numel());
    keep(out.col[static_cast<std::size_t>(tp.rank())], {&h, &hpre, &x_used, &mine, &dw1, &db1});

    // fc2: row-parallel, its input gradient through gelu'(pre)
    const RowParallelLinear fc2(tp, hid, in);
    Vec w2l = take(w2, {in, hid}, fc2.weight_shard()), b2s = b2;
    Vec hl = shard_columns(random_vec(N * hid, 49), N, hid, fc1.weight_shard());
    Vec prel = shard_columns(pre, N, hid, fc1.weight_shard());
    Vec y_full(N * in, 0.0f), y_local(Nl * in, 0.0f);
    fc2.forward(impl, {view(y_full, {N, in}), {}, view(hl, {N, lh}), view(w2l, {in, lh}), view(b2s, {in})},
                view(y_local, {Nl, in}));
    Vec dy_full(N * in, 0.0f), dy_local = rows_of(dy, in, r0, Nl);
    Vec dhl(N * lh, 0.0f), dw2(in * lh, -0.5f), db2(in, 0.0f);
    ops::LinearBackward b{view(dhl, {N, lh}), view(dw2, {in, lh}), view(db2, {in}), view(dy_full, {N, in}),
                          view(hl, {N, lh}), view(w2l, {in, lh}), view(prel, {N, lh})};
    fc2.backward(impl, b, view(dy_local, {Nl, in}));
    keep(out.row[static_cast<std::size_t>(tp.rank())], {&y_local, &dy_full, &dhl, &dw2, &db2});
  });
  return out;
}

}  // namespace

TEST_CASE("with the communication overlapped, the column- and row-parallel layers give the same bits as without") {
  for (const Layout& L : kLayouts) {
    const LayerRun plain = run_layers(L, false, 1);
    for (int chunks : {1, 2, 3}) {
      INFO(L.str(), ", ", chunks, " pieces per rank");
      const LayerRun lapped = run_layers(L, true, chunks);
      for (int r = 0; r < L.tp; ++r) {
        CHECK(lapped.col[static_cast<std::size_t>(r)] == plain.col[static_cast<std::size_t>(r)]);
        CHECK(lapped.row[static_cast<std::size_t>(r)] == plain.row[static_cast<std::size_t>(r)]);
      }
    }
  }
  // Without sequence parallelism the token rows need not split over the ranks.
  for (const Layout& L : {Layout{4, false}}) {
    const LayerRun plain = run_layers(L, false, 1, 22), lapped = run_layers(L, true, 2, 22);
    for (int r = 0; r < L.tp; ++r) {
      CHECK(lapped.col[static_cast<std::size_t>(r)] == plain.col[static_cast<std::size_t>(r)]);
      CHECK(lapped.row[static_cast<std::size_t>(r)] == plain.row[static_cast<std::size_t>(r)]);
    }
  }
}

TEST_CASE("an implementation that does not split by rows still sums its input gradient beside the weight gradient") {
  // As an FP8 layer: the gathers run whole, fc1's backward is one call whose dgrad_queued starts the
  // sum. The same bits as without overlap.
  // With forward_pieces, fc2's forward sums its output piece by piece too.
  for (const Layout& L : kLayouts)
    for (const bool pieces : {false, true}) {
      INFO(L.str(), pieces ? ", forward_pieces" : "");
      const LayerRun plain = run_layers(L, false, 1, 20, false, pieces),
                     lapped = run_layers(L, true, 2, 20, false, pieces);
      for (std::size_t r = 0; r < static_cast<std::size_t>(L.tp); ++r) {
        CHECK(lapped.col[r] == plain.col[r]);
        CHECK(lapped.row[r] == plain.row[r]);
        CHECK(plain.told[r] == 0);
        CHECK(plain.piece_calls[r] == 0);
        // fc1's backward and fc2's: one call each, fc1's with dgrad_queued.
        CHECK(lapped.backward_calls[r] == 2);
        CHECK(lapped.told[r] == 1);
        CHECK(lapped.piece_calls[r] == (pieces ? 1 : 0));
      }
    }
}

namespace {

// One rank's FP8 column-parallel layer (per-tensor scaling, keeping its input's FP8 copy) over two
// steps, its input gathered as bf16 (input_read_after) or as its own codes; per step the output,
// the input gradient this rank keeps and the weight gradient, then the FP8 meta after step 1.
std::vector<Vec> fp8_column_steps(const TensorParallel& tp, fp8::RecipeKind kind, bool codes) {
  const std::int64_t N = 24, in = 32, out = 48;
  auto ops = fp8::make_cpu_ops({.threads = 1});
  fp8::Fp8MetaStore meta(*ops, {fp8::Format::e4m3, fp8::Format::e4m3, fp8::Format::e5m2},
                         kind == fp8::RecipeKind::delayed ? 4 : 1);
  fp8::Fp8Workspace ws(*ops);
  fp8::Fp8Linear lin(*ops, meta, 0, ws, fp8::Fp8Recipe{kind, 4, fp8::AmaxAlgo::max, 0, fp8::FormatPolicy::hybrid, true},
                     "fc", /*keep_input=*/true);
  int gathered = 0;
  ops::LinearImpl impl{.forward = [&](const ops::LinearForward& a) { lin.forward(a, 1); },
                       .backward = [&](const ops::LinearBackward& a) { lin.backward(a); },
                       .keeps_input = true,
                       .forward_gathered = [&](const ops::LinearForward& a, const TensorView& local,
                                               const ops::RowGather& g) {
                         ++gathered;
                         lin.forward_gathered(a, local, 1, false, g);
                       }};
  const ColumnParallelLinear fc(tp, in, out);
  const std::int64_t lo = fc.local_out(), Nl = tp.local_rows(N), r0 = tp.first_local_row(N);
  Vec w = take(random_vec(out * in, 61), {out, in}, fc.weight_shard());
  std::vector<Vec> got;
  for (int step = 1; step <= 2; ++step) {
    Vec x = random_vec(N * in, 62 + step), dy = random_vec(N * out, 64 + step);
    for (std::size_t i = 0; i < x.size(); i += 7) x[i] *= 9.0f;  // an amax that differs between the ranks' rows
    Vec x_full(N * in, -3.0f), x_local = rows_of(x, in, r0, Nl), y(N * lo);
    fc.forward(impl, {view(y, {N, lo}), {}, view(x_full, {N, in}), view(w, {lo, in})}, view(x_local, {Nl, in}),
               /*input_read_after=*/!codes);
    Vec dyl = shard_columns(dy, N, out, fc.weight_shard()), dx(N * in, 0.0f), dx_local(Nl * in, 0.0f), dw(lo * in, 0.0f);
    const TensorView mine = fc.backward(
        impl, {view(dx, {N, in}), view(dw, {lo, in}), {}, view(dyl, {N, lo}), view(x_full, {N, in}), view(w, {lo, in})},
        view(dx_local, {Nl, in}));
    got.push_back(y);
    got.emplace_back(mine.as<float>(), mine.as<float>() + mine.numel());
    got.push_back(dw);
    if (step == 1) {  // before step 2's record, which is this rank's rows' amax alone under delayed scaling
      const TensorView st = meta.state();
      got.emplace_back(st.as<float>(), st.as<float>() + st.numel());
      if (kind == fp8::RecipeKind::delayed) meta.update(*ops, fp8::AmaxAlgo::max, 0);
    }
  }
  CHECK(gathered == (codes ? 2 : 0));
  return got;
}

}  // namespace

TEST_CASE("an FP8 column-parallel layer under sequence parallelism gathers its input as one-byte codes, with the bf16 gather's results") {
  // With the communication overlapped (2 pieces a rank) the codes move in pieces, each piece's GEMM
  // as it arrives.
  for (const int size : {2, 4})
    for (const auto kind : {fp8::RecipeKind::delayed, fp8::RecipeKind::current})
      for (const bool overlap : {false, true}) {
        INFO("tp = ", size, ", ", kind == fp8::RecipeKind::delayed ? "delayed" : "current", " scaling",
             overlap ? ", overlapped" : "");
        std::vector<std::vector<Vec>> plain(static_cast<std::size_t>(size)), codes(plain);
        for (const bool c : {false, true})
          run_group(size, {true, false, overlap && c, 2}, [&](const TensorParallel& tp) {
            (c ? codes : plain)[static_cast<std::size_t>(tp.rank())] = fp8_column_steps(tp, kind, c);
          });
        for (std::size_t r = 0; r < plain.size(); ++r) {
          REQUIRE(codes[r].size() == plain[r].size());
          for (std::size_t i = 0; i < plain[r].size(); ++i) CHECK(kiln::test::same_bits(codes[r][i], plain[r][i]));
        }
      }
}
