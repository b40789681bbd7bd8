// RngReplay on its own (no World): capture, replay, restore, nesting, exceptions and misuse.
#include <doctest/doctest.h>

#include <stdexcept>

#include "kiln/recompute/rng_replay.hpp"
#include "kiln/core/error.hpp"

using namespace kiln;
using recompute::RngReplay;

namespace {
rng::RngStatesTracker make() {
  rng::RngStatesTracker t(11);
  t.add(rng::kModelParallelRng, 12);
  t.add(rng::kDataParallelRng, 13);
  return t;
}
}  // namespace

TEST_CASE("a replay draws what the captured forward drew, then the draws continue where they were") {
  auto t = make();
  RngReplay replay(t);
  t.draw(7);
  replay.capture(3);
  rng::PhiloxArgs fwd_default = t.draw(100), fwd_mp;
  {
    auto f = t.fork(rng::kModelParallelRng);
    fwd_mp = t.draw(50);
  }
  t.draw(1000);  // later layers
  const auto before = t.get_states();
  {
    auto scope = replay.replay(3);
    CHECK(replay.depth() == 1);
    const auto again = t.draw(100);
    CHECK(again.seed == fwd_default.seed);
    CHECK(again.offset == fwd_default.offset);
    auto f = t.fork(rng::kModelParallelRng);
    const auto mp = t.draw(50);
    CHECK(mp.seed == fwd_mp.seed);
    CHECK(mp.offset == fwd_mp.offset);
  }
  CHECK(replay.depth() == 0);
  CHECK(t.get_states() == before);
}

TEST_CASE("replays nest, and an exception inside one still restores the states") {
  auto t = make();
  RngReplay replay(t);
  replay.capture(1);
  t.draw(10);
  replay.capture(2);
  t.draw(10);
  const auto now = t.get_states();
  try {
    auto outer = replay.replay(2);
    t.draw(3);
    auto inner = replay.replay(1);
    CHECK(t.default_state().offset == 0);
    throw std::runtime_error("recompute failed");
  } catch (const std::runtime_error&) {
  }
  CHECK(replay.depth() == 0);
  CHECK(t.get_states() == now);
}

TEST_CASE("begin/end pairs from events, and misuse is an error") {
  auto t = make();
  RngReplay replay(t);
  CHECK_FALSE(replay.captured(5));
  CHECK_THROWS_WITH_AS(replay.begin(5), doctest::Contains("no RNG states were captured"), Error);
  replay.capture(5);
  replay.capture(6);
  t.draw(4);
  replay.begin(5);
  CHECK_THROWS_WITH_AS(replay.end(6), doctest::Contains("unit 5's is the innermost"), Error);
  replay.end(5);
  CHECK(t.default_state().offset == 1);
  CHECK_THROWS_WITH_AS(replay.end(5), doctest::Contains("no recompute"), Error);
}
