#include <doctest/doctest.h>

#include <atomic>
#include <functional>
#include <thread>

#include "kiln/core/error.hpp"
#include "kiln/parallel/grad_buckets.hpp"
#include "kiln/parallel/in_process.hpp"
#include "kiln/parallel/topology.hpp"
#include "kiln/tensor/bf16.hpp"

using namespace kiln;
using namespace kiln::parallel;
using namespace std::chrono_literals;

namespace {
// Runs fn(rank, comm) on `world` threads sharing one group of all ranks; returns each rank's error.
std::vector<std::string> run_ranks(int world, const std::function<void(int, Communicator&)>& fn,
                                   std::chrono::milliseconds timeout = 10s) {
  auto hub = std::make_shared<InProcessHub>(world, timeout);
  std::vector<int> all(world);
  for (int r = 0; r < world; ++r) all[r] = r;
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        auto comm = hub->communicator("world", all, r);
        fn(r, *comm);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        hub->abort(cat("rank ", r, " failed: ", e.what()));
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

TensorView host(std::vector<float>& v) { return TensorView(v.data(), {static_cast<std::int64_t>(v.size())}, DType::f32, Device::cpu); }
}  // namespace

TEST_CASE("all_reduce sums, averages and takes the max, identically on every rank") {
  for (int world : {1, 2, 3, 5}) {
    std::vector<std::vector<float>> results(world);
    auto errors = run_ranks(world, [&](int r, Communicator& c) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
        std::vector<float> v(7);
        for (int i = 0; i < 7; ++i) v[i] = 0.1f * (r + 1) * (i + 1) - (r == 1 ? 3.0f : 0.0f);
        c.all_reduce(host(v), op, nullptr);
        for (int i = 0; i < 7; ++i) {
          float sum = 0, mx = -1e30f;
          for (int q = 0; q < world; ++q) {
            float x = 0.1f * (q + 1) * (i + 1) - (q == 1 ? 3.0f : 0.0f);
            sum += x;
            mx = std::max(mx, x);
          }
          float expect = op == ReduceOp::sum ? sum : op == ReduceOp::avg ? sum / world : mx;
          REQUIRE(v[i] == doctest::Approx(expect).epsilon(1e-6));
        }
        if (op == ReduceOp::sum) results[r] = v;
      }
    });
    for (auto& e : errors) {
    INFO(e);
    CHECK(e.empty());
  }
    for (int r = 1; r < world; ++r) CHECK(results[r] == results[0]);
  }
}

TEST_CASE("all_gather concatenates in group order and reduce_scatter keeps each rank's chunk") {
  const int world = 4;
  auto errors = run_ranks(world, [&](int r, Communicator& c) {
    std::vector<float> mine = {float(r), float(10 * r)}, all(8);
    c.all_gather(host(all), host(mine), nullptr);
    for (int q = 0; q < world; ++q) {
      REQUIRE(all[2 * q] == q);
      REQUIRE(all[2 * q + 1] == 10 * q);
    }
    std::vector<float> in(8), out(2);
    for (int i = 0; i < 8; ++i) in[i] = float(i + r);
    c.reduce_scatter(host(out), host(in), ReduceOp::sum, nullptr);
    REQUIRE(out[0] == float(4 * (2 * r) + 6));
    REQUIRE(out[1] == float(4 * (2 * r + 1) + 6));
  });
  for (auto& e : errors) {
    INFO(e);
    CHECK(e.empty());
  }
}

TEST_CASE("broadcast, barrier, bf16 and i32 buffers") {
  auto errors = run_ranks(3, [&](int r, Communicator& c) {
    std::vector<float> v = {float(r), float(r)};
    c.broadcast(host(v), 2, nullptr);
    REQUIRE(v[0] == 2.0f);
    c.barrier();
    std::vector<std::uint16_t> b = {float_to_bf16_bits(1.5f), float_to_bf16_bits(float(r))};
    c.all_reduce(TensorView(b.data(), {2}, DType::bf16, Device::cpu), ReduceOp::sum, nullptr);
    REQUIRE(bf16_bits_to_float(b[0]) == 4.5f);
    REQUIRE(bf16_bits_to_float(b[1]) == 3.0f);
    std::vector<std::int32_t> n = {r + 1};
    c.all_reduce(TensorView(n.data(), {1}, DType::i32, Device::cpu), ReduceOp::max, nullptr);
    REQUIRE(n[0] == 3);
  });
  for (auto& e : errors) {
    INFO(e);
    CHECK(e.empty());
  }
}

TEST_CASE("a failing rank stops the others with a message naming it") {
  auto errors = run_ranks(3, [&](int r, Communicator& c) {
    std::vector<float> v(4, 1.0f);
    c.all_reduce(host(v), ReduceOp::sum, nullptr);
    if (r == 2) throw Error("rank 2 hit a bad batch");
    c.all_reduce(host(v), ReduceOp::sum, nullptr);  // ranks 0 and 1 wait here for rank 2
  });
  CHECK(errors[2].find("bad batch") != std::string::npos);
  for (int r : {0, 1}) {
    INFO(errors[r]);
    CHECK(errors[r].find("stopped in world all_reduce") != std::string::npos);
    CHECK(errors[r].find("rank 2 failed") != std::string::npos);
  }
}

TEST_CASE("a rank that never arrives makes the others time out naming it and the collective") {
  auto errors = run_ranks(
      3,
      [&](int r, Communicator& c) {
        if (r == 1) return;  // this rank hangs up without a word
        std::vector<float> v(4, 1.0f);
        c.all_reduce(host(v), ReduceOp::sum, nullptr);
      },
      300ms);
  bool named = false;
  for (int r : {0, 2}) {
    INFO(errors[r]);
    CHECK(!errors[r].empty());
    named |= errors[r].find("timed out after 0.3 s in world all_reduce") != std::string::npos &&
             errors[r].find("waiting for rank(s) 1") != std::string::npos;
  }
  CHECK(named);
}

TEST_CASE("mismatched collectives are caught") {
  auto errors = run_ranks(2, [&](int r, Communicator& c) {
    std::vector<float> v(4, 1.0f), w(8);
    if (r == 0)
      c.all_reduce(host(v), ReduceOp::sum, nullptr);
    else
      c.all_gather(host(w), host(v), nullptr);
  });
  CHECK((errors[0].find("mismatched collectives") != std::string::npos ||
         errors[1].find("mismatched collectives") != std::string::npos));
}

TEST_CASE("groups of a topology work side by side") {
  const int world = 4;
  auto hub = std::make_shared<InProcessHub>(world, 10s);
  Topology topo(world, 2, 1, 1, 1, 0);
  std::vector<std::thread> threads;
  std::vector<float> tp_sum(world), dp_sum(world);
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      auto tp = hub->communicator("tp", topo.tp_group(r), r);
      auto dp = hub->communicator("dp", topo.dp_group(r), r);
      std::vector<float> a = {float(r)}, b = {float(r)};
      tp->all_reduce(host(a), ReduceOp::sum, nullptr);
      dp->all_reduce(host(b), ReduceOp::sum, nullptr);
      tp_sum[r] = a[0];
      dp_sum[r] = b[0];
    });
  for (auto& t : threads) t.join();
  CHECK(tp_sum == std::vector<float>{1, 1, 5, 5});  // [0,1] and [2,3]
  CHECK(dp_sum == std::vector<float>{2, 4, 2, 4});  // [0,2] and [1,3]
}

TEST_CASE("plan_buckets groups units in backward order into contiguous buckets") {
  // Units 0..4 with padding gaps between them, as the flat parameter layout has.
  const std::vector<UnitSpan> spans = {{0, 0, 100}, {1, 128, 178}, {2, 192, 242}, {3, 256, 306}, {4, 320, 330}};
  auto b = plan_buckets(spans, 60);
  REQUIRE(b.size() == 3);
  CHECK(b[0].units == std::vector<int>{4, 3});  // 10 + 50 elements reach 60
  CHECK(b[0].begin == 256);
  CHECK(b[0].end == 330);
  CHECK(b[1].units == std::vector<int>{2, 1});
  CHECK(b[1].begin == 128);
  CHECK(b[1].end == 242);
  CHECK(b[2].units == std::vector<int>{0});
  CHECK(plan_buckets(spans, 0).size() == 1);
  CHECK(plan_buckets(spans, 1).size() == 5);
  CHECK_THROWS_WITH_AS(plan_buckets({{0, 0, 100}, {1, 50, 150}}, 10), doctest::Contains("disjoint"), Error);
}

TEST_CASE("DpGradSync reduces each bucket when its last unit is ready, and the rest at finish") {
  const auto errors = run_ranks(3, [](int r, Communicator& c) {
    std::vector<float> g(40);
    for (int i = 0; i < 40; ++i) g[i] = float(r * 100 + i);
    DpGradSync sync(c, host(g), plan_buckets({{0, 0, 10}, {1, 10, 20}, {2, 20, 30}, {3, 30, 40}}, 15), nullptr);
    REQUIRE(sync.buckets().size() == 2);  // {3, 2} and {1, 0}
    sync.unit_ready(3);
    CHECK(g[35] == float(r * 100 + 35));  // its bucket waits for unit 2
    sync.unit_ready(2);
    CHECK(g[35] == float(0 + 100 + 200 + 3 * 35));
    CHECK(g[5] == float(r * 100 + 5));
    sync.unit_ready(1);
    sync.finish();  // unit 0 never reported: reduced here
    CHECK(g[5] == float(300 + 3 * 5));
    CHECK(sync.launched_early() == 1);
    sync.unit_ready(3);  // a new step starts clean
    CHECK_THROWS_WITH_AS(sync.unit_ready(3), doctest::Contains("ready twice"), Error);
  });
  for (auto& e : errors) CHECK(e.empty());
}

// backend.cuda_graph: after the captured passes' launch no layer event reports the units, so the
// buckets their capture started must count as started (the graph reduced them) and finish() start
// only the others, exactly once.
TEST_CASE("DpGradSync after a replay starts only the buckets the captured passes did not") {
  const auto errors = run_ranks(2, [](int r, Communicator& c) {
    std::vector<float> g(40);
    auto fill = [&] {
      for (int i = 0; i < 40; ++i) g[i] = float(r * 100 + i);
    };
    fill();
    DpGradSync sync(c, host(g), plan_buckets({{0, 0, 10}, {1, 10, 20}, {2, 20, 30}, {3, 30, 40}}, 15), nullptr);
    sync.unit_ready(3);
    sync.unit_ready(2);  // bucket {3, 2} started inside the "capture"
    sync.capture_end();
    sync.finish();       // bucket {1, 0} started here
    CHECK(sync.launched_early() == 1);
    CHECK(g[35] == float(100 + 2 * 35));
    CHECK(g[5] == float(100 + 2 * 5));
    // A replay: the graph's reduction of bucket {3, 2} stands in for the one the capture recorded
    // (done by hand here); finish() must reduce bucket {1, 0} alone.
    fill();
    g[35] = -1;
    sync.replayed();
    sync.finish();
    CHECK(g[35] == -1);  // not reduced again
    CHECK(g[5] == float(100 + 2 * 5));
    CHECK(sync.launched_early() == 1);
    sync.unit_ready(3);  // the step after starts clean
  });
  for (auto& e : errors) CHECK(e.empty());
}

TEST_CASE("p2p: only the peers take part, messages meet in order, across calls") {
  // A ring of 3: each rank sends two buffers to the next, in two calls, and receives from the previous.
  auto errors = run_ranks(3, [](int r, Communicator& c) {
    const int next = (r + 1) % 3, prev = (r + 2) % 3;
    std::vector<float> a(5, 1.0f + r), b(3, 10.0f + r), ga(5), gb(3);
    c.p2p({{next, host(a)}}, {}, nullptr, "forward activation");
    c.p2p({{next, host(b)}}, {{prev, host(ga)}}, nullptr, "forward activation");
    c.p2p({}, {{prev, host(gb)}}, nullptr, "forward activation");
    REQUIRE(ga == std::vector<float>(5, 1.0f + prev));
    REQUIRE(gb == std::vector<float>(3, 10.0f + prev));
    // Ranks 0 and 1 only: rank 2 takes no part.
    if (r < 2) {
      std::vector<float> mine(2, 5.0f * r), theirs(2);
      c.p2p({{1 - r, host(mine)}}, {{1 - r, host(theirs)}}, nullptr, "exchange");
      REQUIRE(theirs == std::vector<float>(2, 5.0f * (1 - r)));
    }
  });
  for (const auto& e : errors) CHECK(e.empty());
}

TEST_CASE("p2p: a peer that never sends, or sends another shape, is named") {
  auto errors = run_ranks(
      2,
      [](int r, Communicator& c) {
        std::vector<float> x(4);
        if (r == 0) c.p2p({}, {{1, host(x)}}, nullptr, "receive of micro-batch 3's activation");
      },
      200ms);
  CHECK(errors[0].find("timed out") != std::string::npos);
  CHECK(errors[0].find("receive of micro-batch 3's activation") != std::string::npos);
  CHECK(errors[0].find("waiting for rank 1's send") != std::string::npos);
  errors = run_ranks(2, [](int r, Communicator& c) {
    std::vector<float> x(4 + r);
    if (r == 0) c.p2p({}, {{1, host(x)}}, nullptr, "backward gradient");
    if (r == 1) c.p2p({{0, host(x)}}, {}, nullptr, "backward gradient");
  });
  CHECK(errors[0].find("which sent 5 f32 elements") != std::string::npos);
  // A rank that dies stops its peer's receive, naming both.
  errors = run_ranks(2, [](int r, Communicator& c) {
    std::vector<float> x(4);
    if (r == 1) KILN_THROW("rank 1 died");
    c.p2p({}, {{1, host(x)}}, nullptr, "forward activation of micro-batch 0");
  });
  CHECK(errors[0].find("receiving from rank 1") != std::string::npos);
  CHECK(errors[0].find("rank 1 died") != std::string::npos);
}
