#include <doctest/doctest.h>

#include <stdexcept>

#include "kiln/engine/error.hpp"
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
