#include <doctest/doctest.h>

#include <string>
#include <thread>
#include <vector>

#include "kiln/engine/world.hpp"

using kiln::Entity;
using kiln::World;

namespace {
struct Position {
  int x = 0;
};
struct Velocity {
  int dx = 0;
};
struct Counter {
  int value = 0;
};
}  // namespace

TEST_CASE("entities carry typed components") {
  World w;
  Entity a = w.create("a");
  Entity b = w.create();
  w.emplace<Position>(a, 1);
  w.emplace<Position>(b, 2);
  w.emplace<Velocity>(b, 5);
  CHECK(w.get<Position>(a).x == 1);
  CHECK(w.has<Velocity>(b));
  CHECK_FALSE(w.has<Velocity>(a));
  CHECK(w.try_get<Velocity>(a) == nullptr);
  CHECK(w.view<Position>().size() == 2);
  CHECK(w.view<Position, Velocity>() == std::vector<Entity>{b});
}

TEST_CASE("iteration follows creation order") {
  World w;
  std::vector<Entity> made;
  for (int i = 0; i < 20; ++i) {
    made.push_back(w.create());
    w.emplace<Position>(made.back(), i);
  }
  std::vector<int> seen;
  w.each<Position>([&](Entity, Position& p) { seen.push_back(p.x); });
  for (int i = 0; i < 20; ++i) CHECK(seen[i] == i);
}

TEST_CASE("each may add components while iterating") {
  World w;
  for (int i = 0; i < 5; ++i) w.emplace<Position>(w.create(), i);
  w.each<Position>([&](Entity e, Position& p) { w.emplace<Velocity>(e, p.x * 2); });
  CHECK(w.view<Velocity>().size() == 5);
}

TEST_CASE("a second component of the same type is an error naming the entity") {
  World w;
  Entity e = w.create("blocks.0.qkv");
  w.emplace<Position>(e);
  CHECK_THROWS_WITH_AS(w.emplace<Position>(e), doctest::Contains("blocks.0.qkv"), kiln::Error);
  CHECK_THROWS_WITH_AS(w.get<Velocity>(e), doctest::Contains("Velocity"), kiln::Error);
}

TEST_CASE("destroyed entities lose their components") {
  World w;
  Entity e = w.create();
  w.emplace<Position>(e);
  w.destroy(e);
  CHECK_FALSE(w.alive(e));
  CHECK(w.view<Position>().empty());
  CHECK_THROWS_AS(w.emplace<Position>(e), kiln::Error);
}

TEST_CASE("resources are typed singletons") {
  World w;
  w.emplace_resource<Counter>(3);
  CHECK(w.resource<Counter>().value == 3);
  CHECK_THROWS_AS(w.emplace_resource<Counter>(), kiln::Error);
  CHECK(w.try_resource<Position>() == nullptr);
  CHECK_THROWS_WITH_AS(w.resource<Position>(), doctest::Contains("Position"), kiln::Error);
}

TEST_CASE("resources are destroyed in reverse order of creation") {
  std::vector<int> log;
  struct Tracker {
    std::vector<int>* log;
    int id;
    ~Tracker() { log->push_back(id); }
  };
  struct A : Tracker {};
  struct B : Tracker {};
  {
    World w;
    w.emplace_resource<A>(A{{&log, 1}});
    w.emplace_resource<B>(B{{&log, 2}});
    log.clear();  // the temporaries above were destroyed too
  }
  CHECK(log == std::vector<int>{2, 1});
}

TEST_CASE("worlds on different threads share nothing") {
  std::vector<int> results(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r)
    threads.emplace_back([r, &results] {
      World w;
      w.emplace_resource<Counter>(r);
      for (int i = 0; i < 1000; ++i) w.emplace<Position>(w.create(), i);
      int sum = 0;
      w.each<Position>([&](Entity, Position& p) { sum += p.x; });
      results[r] = sum + w.resource<Counter>().value;
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) CHECK(results[r] == 499500 + r);
}
