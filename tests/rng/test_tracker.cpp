#include <doctest/doctest.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "kiln/core/error.hpp"
#include "kiln/rng/tracker.hpp"

using namespace kiln::rng;

TEST_CASE("fork makes a named state current and restores the previous one") {
  RngStatesTracker t(5);
  t.add(kModelParallelRng, 100);
  t.add(kDataParallelRng, 200);
  CHECK(t.current_name().empty());
  {
    auto a = t.fork(kModelParallelRng);
    CHECK(t.current().seed == 100);
    {
      auto b = t.fork(kDataParallelRng);
      CHECK(t.current().seed == 200);
    }
    CHECK(t.current_name() == kModelParallelRng);
  }
  CHECK(t.current().seed == 5);
}

TEST_CASE("fork restores the previous state when an exception leaves the scope") {
  RngStatesTracker t(5);
  t.add("x", 9);
  try {
    auto s = t.fork("x");
    t.draw(10);
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  CHECK(t.current_name().empty());
  CHECK(t.state("x").offset == 3);
}

TEST_CASE("draws advance the current state by whole Philox blocks") {
  RngStatesTracker t(1);
  auto a = t.draw(10);
  auto b = t.draw(1);
  CHECK(a.offset == 0);
  CHECK(b.offset == 3);
  CHECK(t.default_state().offset == 4);
}

TEST_CASE("a repeated name or seed is an error") {
  RngStatesTracker t;
  t.add("a", 1);
  CHECK_THROWS_WITH_AS(t.add("a", 2), doctest::Contains("'a' already exists"), kiln::Error);
  CHECK_THROWS_WITH_AS(t.add("b", 1), doctest::Contains("reuse seed 1"), kiln::Error);
  CHECK_THROWS_AS(t.fork("nope"), kiln::Error);
}

TEST_CASE("snapshots round trip through text and restore every state") {
  RngStatesTracker t(3);
  t.add(kModelParallelRng, 7);
  t.add(kExpertParallelRng, 8);
  t.draw(100);
  {
    auto s = t.fork(kExpertParallelRng);
    t.draw(5);
  }
  auto snap = t.get_states();
  auto text = snap.serialize();
  CHECK(RngSnapshot::deserialize(text) == snap);
  t.draw(1000);
  t.set_states(RngSnapshot::deserialize(text));
  CHECK(t.get_states() == snap);
  CHECK_THROWS_AS(RngSnapshot::deserialize("default 1 x\n"), kiln::Error);
  RngStatesTracker other(3);
  other.add("different", 1);
  other.add(kExpertParallelRng, 8);
  CHECK_THROWS_AS(other.set_states(snap), kiln::Error);
}

TEST_CASE("reset removes named states but not inside a fork") {
  RngStatesTracker t;
  t.add("a", 1);
  {
    auto s = t.fork("a");
    CHECK_THROWS_AS(t.reset(), kiln::Error);
  }
  t.reset();
  CHECK_FALSE(t.has("a"));
  t.add("a", 1);
}

namespace {
// One "training step" of draws: default, model-parallel inside a fork, default again.
std::vector<PhiloxArgs> step_draws(RngStatesTracker& t) {
  std::vector<PhiloxArgs> a;
  a.push_back(t.draw(10));
  {
    auto s = t.fork(kModelParallelRng);
    a.push_back(t.draw(7));
  }
  a.push_back(t.draw(5));
  return a;
}
RngStatesTracker graph_tracker() {
  RngStatesTracker t(21);
  t.add(kModelParallelRng, 22);
  t.add(kDataParallelRng, 23);
  t.draw(3);  // not at offset 0
  return t;
}
}  // namespace

TEST_CASE("graph-safe draws: each replay of a captured step draws what the eager step would") {
  auto eager = graph_tracker();
  std::vector<std::vector<std::uint64_t>> eager_starts;
  for (int k = 0; k < 3; ++k) {
    std::vector<std::uint64_t> s;
    for (auto& a : step_draws(eager)) {
      CHECK(a.offset_ptr == nullptr);
      s.push_back(a.start());
    }
    eager_starts.push_back(s);
  }

  auto t = graph_tracker();
  std::vector<std::uint64_t> bases(static_cast<std::size_t>(t.num_states()), 0xdeadbeef);  // "device" memory
  t.begin_graph_capture(bases.data());
  CHECK(t.capturing());
  const auto captured = step_draws(t);  // what the captured kernels were launched with
  const auto g = t.end_graph_capture();
  CHECK_FALSE(t.capturing());
  CHECK(captured[0].offset_ptr == bases.data() + 0);  // default state
  CHECK(captured[1].offset_ptr == bases.data() + 1);  // model-parallel-rng
  CHECK(captured[2].offset == 3);                     // relative: after the first draw's 3 blocks
  CHECK(g.increment == std::vector<std::uint64_t>{3 + 2, 2, 0});
  for (int k = 0; k < 3; ++k) {
    const auto values = t.next_replay(g);
    std::copy(values.begin(), values.end(), bases.begin());  // the copy to the device before cudaGraphLaunch
    std::vector<std::uint64_t> s;
    for (auto& a : captured) s.push_back(a.start());  // what the kernels read when the graph runs
    CHECK(s == eager_starts[static_cast<std::size_t>(k)]);
  }
  CHECK(t.get_states() == eager.get_states());  // and eager draws continue where the replays left off
}

TEST_CASE("graph-safe mode: snapshots copy values, and a restore inside a capture replays the same draws") {
  auto t = graph_tracker();
  std::vector<std::uint64_t> bases(static_cast<std::size_t>(t.num_states()), 0);
  t.begin_graph_capture(bases.data());
  t.draw(8);
  const auto snap = t.get_states();  // e.g. activation checkpointing at a layer's forward begin
  const auto first = t.draw(40);
  bases.assign(bases.size(), 1000);  // the device values change (a replay prologue): the snapshot does not
  CHECK(t.get_states().default_state.offset == snap.default_state.offset + 10);
  const auto after = t.get_states();
  t.set_states(snap);  // the recompute
  const auto again = t.draw(40);
  CHECK(again.offset == first.offset);
  CHECK(again.offset_ptr == first.offset_ptr);
  t.set_states(after);
  // A state set back before the capture began cannot be expressed relative to it.
  auto before = snap;
  before.default_state.offset = 0;
  t.set_states(before);
  CHECK_THROWS_WITH_AS(t.draw(1), doctest::Contains("before the start of the graph capture"), kiln::Error);
  t.set_states(after);
  CHECK_THROWS_AS(t.begin_graph_capture(bases.data()), kiln::Error);
  CHECK_THROWS_AS(t.add("late", 99), kiln::Error);
  CHECK_THROWS_AS(t.next_replay(GraphCapture{}), kiln::Error);
  t.end_graph_capture();
  CHECK_THROWS_AS(t.end_graph_capture(), kiln::Error);
  CHECK_THROWS_AS(t.begin_graph_capture(nullptr), kiln::Error);
}
