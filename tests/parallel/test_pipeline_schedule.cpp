#include <doctest/doctest.h>

#include <algorithm>
#include <set>

#include "kiln/core/error.hpp"
#include "kiln/parallel/pipeline_schedule.hpp"
#include "kiln/parallel/pipeline_split.hpp"

using namespace kiln::parallel;
using Kind = PipelineAction::Kind;

TEST_CASE("1F1B: warm-up, steady state and cool-down as Megatron-LM orders them") {
  const PipelineShape s{2, 1, 4};
  CHECK(format_actions(pipeline_schedule(s, 0)) == "F0 F1 B0 F2 B1 F3 B2 B3");
  CHECK(format_actions(pipeline_schedule(s, 1)) == "F0 B0 F1 B1 F2 B2 F3 B3");
  // Fewer micro-batches than ranks: every forward first.
  CHECK(format_actions(pipeline_schedule({4, 1, 2}, 0)) == "F0 F1 B0 B1");
  CHECK(format_actions(pipeline_schedule({4, 1, 2}, 3)) == "F0 B0 F1 B1");
}

TEST_CASE("interleaved 1F1B: micro-batches through the chunks in groups of pp") {
  const PipelineShape s{2, 2, 4};
  CHECK(format_actions(pipeline_schedule(s, 0)) == "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3");
  CHECK(format_actions(pipeline_schedule(s, 1)) == "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3");
}

TEST_CASE("every schedule runs each pass once, forwards before their backwards, and keeps pp - rank alive in 1F1B") {
  for (int pp : {1, 2, 3, 4, 8})
    for (int vpp : {1, 2, 3})
      for (int m : {1, 2, 3, 4, 5, 8, 12, 16}) {
        const PipelineShape s{pp, vpp, m};
        if (!pipeline_shape_problem(s).empty()) {
          CHECK((vpp > 1 && m % pp != 0));
          CHECK_THROWS_AS(pipeline_schedule(s, 0), kiln::Error);
          continue;
        }
        for (int r = 0; r < pp; ++r) {
          const auto plan = pipeline_schedule(s, r);
          REQUIRE(static_cast<int>(plan.size()) == 2 * m * vpp);
          std::set<std::pair<int, int>> forwarded, done;
          for (const auto& a : plan) {
            const auto id = std::make_pair(a.micro_batch, a.chunk);
            REQUIRE(a.micro_batch >= 0);
            REQUIRE(a.micro_batch < m);
            REQUIRE(a.chunk >= 0);
            REQUIRE(a.chunk < vpp);
            if (a.kind == Kind::forward) {
              REQUIRE(forwarded.insert(id).second);
            } else {
              REQUIRE(forwarded.count(id) == 1);
              REQUIRE(done.insert(id).second);
            }
          }
          if (vpp == 1) CHECK(max_in_flight(plan) == std::min(pp - r, m));
        }
      }
}

TEST_CASE("the simulated bubble equals (pp - 1) / (vpp m + pp - 1), and transfers lengthen it") {
  for (int pp : {2, 3, 4, 8})
    for (int vpp : {1, 2, 4})
      for (int m : {pp, 2 * pp, 8, 16}) {
        const PipelineShape s{pp, vpp, m};
        if (!pipeline_shape_problem(s).empty()) continue;
        const auto t = simulate_pipeline(s, 1.0, 2.0);
        CAPTURE(pp);
        CAPTURE(vpp);
        CAPTURE(m);
        CHECK(t.bubble == doctest::Approx(pipeline_bubble(s)).epsilon(1e-12));
        CHECK(t.makespan == doctest::Approx(3.0 * (vpp * m + pp - 1)));
        CHECK(simulate_pipeline(s, 1.0, 2.0, 0.25).bubble > t.bubble);
      }
  CHECK(simulate_pipeline({1, 1, 4}, 1.0, 2.0).bubble == 0.0);
}

TEST_CASE("schedules that wait on each other forever are named") {
  // Rank 1 runs micro-batch 1 before 0, rank 0 backward 0 before forward 1: rank 1 waits for F1 from
  // rank 0, which waits for B0 from rank 1.
  const std::vector<std::vector<PipelineAction>> plans = {
      {{Kind::forward, 0, 0}, {Kind::backward, 0, 0}, {Kind::forward, 1, 0}, {Kind::backward, 1, 0}},
      {{Kind::forward, 1, 0}, {Kind::backward, 1, 0}, {Kind::forward, 0, 0}, {Kind::backward, 0, 0}}};
  try {
    simulate_pipeline({2, 1, 2}, plans, 1.0, 2.0);
    FAIL("no error");
  } catch (const kiln::Error& e) {
    const std::string what = e.what();
    CHECK(what.find("rank 0 at B0") != std::string::npos);
    CHECK(what.find("rank 1 at F1") != std::string::npos);
  }
}

TEST_CASE("balanced splits: even blocks evenly, the head's cost taken off the last chunk") {
  const std::vector<double> ones(12, 1.0);
  CHECK(balanced_split(ones, 0, 0, 4) == std::vector<int>{3, 3, 3, 3});
  CHECK(balanced_split(ones, 0, 0, 1) == std::vector<int>{12});
  const std::vector<double> ten(10, 1.0);
  const auto uneven = balanced_split(ten, 0, 0, 4);
  CHECK(*std::max_element(uneven.begin(), uneven.end()) == 3);
  CHECK(*std::min_element(uneven.begin(), uneven.end()) == 2);
  CHECK(balanced_split(ones, 0, 4.0, 2) == std::vector<int>{8, 4});
  CHECK(balanced_split(ones, 2.0, 2.0, 2) == std::vector<int>{6, 6});
  CHECK(balanced_split({1, 1, 5, 1}, 0, 0, 2) == std::vector<int>{2, 2});
  CHECK(balanced_split({1, 1}, 0, 0, 2) == std::vector<int>{1, 1});
  CHECK_THROWS_AS(balanced_split({1, 1}, 0, 0, 3), kiln::Error);
}

TEST_CASE("hand-made splits are checked") {
  CHECK(split_problem({2, 2}, 4, 2).empty());
  CHECK(split_problem({2, 2}, 4, 4).find("4 chunks") != std::string::npos);
  CHECK(split_problem({4, 0}, 4, 2).find("at least one") != std::string::npos);
  CHECK(split_problem({2, 3}, 4, 2).find("model.n_layer") != std::string::npos);
  CHECK(split_starts({2, 3, 1}) == std::vector<int>{0, 2, 5, 6});
}

TEST_CASE("the schedules' grouped transfers meet in order and never wait on each other forever") {
  for (int pp : {2, 3, 4, 8})
    for (int vpp : {1, 2, 3})
      for (int m : {1, 2, 3, 4, 8, 12, 16}) {
        const PipelineShape s{pp, vpp, m};
        if (!pipeline_shape_problem(s).empty()) continue;
        CAPTURE(pp);
        CAPTURE(vpp);
        CAPTURE(m);
        CHECK(check_pipeline_transfers(s) == "");
        for (int r = 0; r < pp; ++r) CHECK(pipeline_transfers(s, r).size() == 2 * static_cast<std::size_t>(m * vpp) + 1);
      }
}
