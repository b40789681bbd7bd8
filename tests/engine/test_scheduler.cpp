#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "kiln/engine/world.hpp"

using kiln::Phase;
using kiln::SystemDesc;
using kiln::World;

namespace {
struct Log {
  std::vector<std::string> lines;
};
SystemDesc sys(std::string name, Phase phase, std::vector<std::string> after = {}, std::vector<std::string> before = {}) {
  return SystemDesc{name, phase, [name](World& w) { w.resource<Log>().lines.push_back(name); }, after, before};
}
}  // namespace

TEST_CASE("systems of a phase run in registration order without constraints") {
  World w;
  w.emplace_resource<Log>();
  w.systems().add(sys("a", Phase::forward));
  w.systems().add(sys("b", Phase::forward));
  w.systems().add(sys("c", Phase::backward));
  w.systems().run(Phase::forward, w);
  CHECK(w.resource<Log>().lines == std::vector<std::string>{"a", "b"});
}

TEST_CASE("before and after constraints reorder systems") {
  World w;
  w.emplace_resource<Log>();
  w.systems().add(sys("log", Phase::step_end, {"timer"}));
  w.systems().add(sys("timer", Phase::step_end));
  w.systems().add(sys("first", Phase::step_end, {}, {"timer"}));
  w.systems().build();
  CHECK(w.systems().order(Phase::step_end) == std::vector<std::string>{"first", "timer", "log"});
}

TEST_CASE("a system after \"*\" runs after every other system of its phase, one before \"*\" before them") {
  World w;
  w.emplace_resource<Log>();
  w.systems().add(sys("last", Phase::setup, {kiln::kAllSystems}));
  w.systems().add(sys("a", Phase::setup));
  w.systems().add(sys("first", Phase::setup, {}, {kiln::kAllSystems}));
  w.systems().add(sys("b", Phase::setup, {"a"}));
  w.systems().add(sys("other_phase", Phase::step_begin));
  w.systems().build();
  CHECK(w.systems().order(Phase::setup) == std::vector<std::string>{"first", "a", "b", "last"});
}

TEST_CASE("constraints across phases agree with phase order or are errors") {
  World w;
  w.systems().add(sys("opt", Phase::optimizer, {"fwd"}));
  w.systems().add(sys("fwd", Phase::forward));
  CHECK_NOTHROW(w.systems().build());
  w.systems().add(sys("early", Phase::data, {"opt"}));
  CHECK_THROWS_WITH_AS(w.systems().build(), doctest::Contains("'early'"), kiln::Error);
}

TEST_CASE("an unknown system name in a constraint is an error naming both systems") {
  World w;
  w.systems().add(sys("log", Phase::step_end, {"timr"}));
  CHECK_THROWS_WITH_AS(w.systems().build(), doctest::Contains("'log' wants to run after unknown system 'timr'"), kiln::Error);
}

TEST_CASE("a cycle is an error that names the systems in it") {
  World w;
  w.systems().add(sys("a", Phase::forward, {"c"}));
  w.systems().add(sys("b", Phase::forward, {"a"}));
  w.systems().add(sys("c", Phase::forward, {"b"}));
  w.systems().add(sys("free", Phase::forward));
  try {
    w.systems().build();
    FAIL("expected a cycle error");
  } catch (const kiln::Error& e) {
    std::string m = e.what();
    CHECK(m.find("cycle") != std::string::npos);
    CHECK(m.find("'a'") != std::string::npos);
    CHECK(m.find("'b'") != std::string::npos);
    CHECK(m.find("'c'") != std::string::npos);
    CHECK(m.find("'free'") == std::string::npos);
  }
}

TEST_CASE("a phase is replayable when all its systems are, and the first that is not is named, in order") {
  World w;
  auto replayable = [](std::string name, Phase phase, std::vector<std::string> after = {}) {
    SystemDesc d = sys(std::move(name), phase, std::move(after));
    d.replayable = true;
    return d;
  };
  w.systems().add(replayable("fwd", Phase::forward));
  w.systems().add(replayable("clip", Phase::optimizer, {"host"}));
  w.systems().add(sys("host", Phase::optimizer));
  w.systems().add(sys("late", Phase::optimizer, {"clip"}));
  w.systems().build();
  CHECK(w.systems().not_replayable(Phase::forward) == std::nullopt);
  CHECK(w.systems().not_replayable(Phase::backward) == std::nullopt);  // no systems
  CHECK(w.systems().not_replayable(Phase::optimizer) == std::optional<std::string>("host"));
  CHECK(w.systems().has("late"));
  CHECK_FALSE(w.systems().has("model.loss"));
}

TEST_CASE("a duplicate system name is an error") {
  World w;
  w.systems().add(sys("a", Phase::forward));
  CHECK_THROWS_AS(w.systems().add(sys("a", Phase::backward)), kiln::Error);
}

TEST_CASE("phase names round trip") {
  for (auto p : kiln::all_phases()) CHECK(kiln::phase_from_name(kiln::phase_name(p)) == p);
  CHECK_FALSE(kiln::phase_from_name("forwards").has_value());
}
