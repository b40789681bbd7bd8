#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "kiln/engine/event_bus.hpp"

using kiln::EventBus;
using kiln::Subscription;

namespace {
struct LayerForwardBegin {
  int layer;
};
struct Other {
  std::string text;
};
}  // namespace

TEST_CASE("publish delivers immediately in subscription order") {
  EventBus bus;
  std::vector<std::string> log;
  auto s1 = bus.subscribe<LayerForwardBegin>([&](const auto& e) { log.push_back("a" + std::to_string(e.layer)); });
  auto s2 = bus.subscribe<LayerForwardBegin>([&](const auto& e) { log.push_back("b" + std::to_string(e.layer)); });
  auto s3 = bus.subscribe<Other>([&](const Other& e) { log.push_back(e.text); });
  bus.publish(LayerForwardBegin{1});
  bus.publish(Other{"x"});
  CHECK(log == std::vector<std::string>{"a1", "b1", "x"});
}

TEST_CASE("a subscription unsubscribes when destroyed") {
  EventBus bus;
  int calls = 0;
  {
    auto s = bus.subscribe<Other>([&](const Other&) { ++calls; });
    bus.publish(Other{});
  }
  bus.publish(Other{});
  CHECK(calls == 1);
  CHECK(bus.subscribers<Other>() == 0);
}

TEST_CASE("subscriptions are movable and reset explicitly") {
  EventBus bus;
  int calls = 0;
  Subscription keep;
  {
    auto s = bus.subscribe<Other>([&](const Other&) { ++calls; });
    keep = std::move(s);
  }
  bus.publish(Other{});
  keep.reset();
  bus.publish(Other{});
  CHECK(calls == 1);
}

TEST_CASE("enqueue defers delivery until drain, in FIFO order") {
  EventBus bus;
  std::vector<int> log;
  auto s = bus.subscribe<LayerForwardBegin>([&](const auto& e) { log.push_back(e.layer); });
  bus.enqueue(LayerForwardBegin{1});
  bus.enqueue(LayerForwardBegin{2});
  CHECK(log.empty());
  CHECK(bus.pending() == 2);
  CHECK(bus.drain() == 2);
  CHECK(log == std::vector<int>{1, 2});
}

TEST_CASE("events enqueued during a drain wait for the next drain") {
  EventBus bus;
  std::vector<int> log;
  auto s = bus.subscribe<LayerForwardBegin>([&](const auto& e) {
    log.push_back(e.layer);
    if (e.layer < 3) bus.enqueue(LayerForwardBegin{e.layer + 1});
  });
  bus.enqueue(LayerForwardBegin{1});
  bus.drain();
  CHECK(log == std::vector<int>{1});
  bus.drain();
  bus.drain();
  CHECK(log == std::vector<int>{1, 2, 3});
  CHECK(bus.pending() == 0);
}

TEST_CASE("a handler may publish, and nested events are delivered at once") {
  EventBus bus;
  std::vector<std::string> log;
  auto s1 = bus.subscribe<LayerForwardBegin>([&](const auto& e) {
    log.push_back("begin");
    if (e.layer == 0) bus.publish(Other{"nested"});
    log.push_back("end");
  });
  auto s2 = bus.subscribe<Other>([&](const Other& o) { log.push_back(o.text); });
  bus.publish(LayerForwardBegin{0});
  CHECK(log == std::vector<std::string>{"begin", "nested", "end"});
}

TEST_CASE("a handler may publish the same event type re-entrantly") {
  EventBus bus;
  std::vector<int> log;
  auto s = bus.subscribe<LayerForwardBegin>([&](const auto& e) {
    log.push_back(e.layer);
    if (e.layer < 3) bus.publish(LayerForwardBegin{e.layer + 1});
  });
  bus.publish(LayerForwardBegin{0});
  CHECK(log == std::vector<int>{0, 1, 2, 3});
}

TEST_CASE("unsubscribing during dispatch stops later delivery in the same dispatch") {
  EventBus bus;
  std::vector<std::string> log;
  Subscription second;
  auto first = bus.subscribe<Other>([&](const Other&) {
    log.push_back("first");
    second.reset();
  });
  second = bus.subscribe<Other>([&](const Other&) { log.push_back("second"); });
  bus.publish(Other{});
  bus.publish(Other{});
  CHECK(log == std::vector<std::string>{"first", "first"});
}

TEST_CASE("a handler may unsubscribe itself") {
  EventBus bus;
  int calls = 0;
  Subscription self;
  self = bus.subscribe<Other>([&](const Other&) {
    ++calls;
    self.reset();
  });
  bus.publish(Other{});
  bus.publish(Other{});
  CHECK(calls == 1);
}

TEST_CASE("a subscription added during dispatch sees only later events") {
  EventBus bus;
  std::vector<std::string> log;
  std::vector<Subscription> added;
  auto s = bus.subscribe<Other>([&](const Other& o) {
    log.push_back("outer:" + o.text);
    if (added.empty()) added.push_back(bus.subscribe<Other>([&](const Other& o2) { log.push_back("inner:" + o2.text); }));
  });
  bus.publish(Other{"1"});
  bus.publish(Other{"2"});
  CHECK(log == std::vector<std::string>{"outer:1", "outer:2", "inner:2"});
}

TEST_CASE("a subscription may outlive its bus") {
  Subscription s;
  {
    EventBus bus;
    s = bus.subscribe<Other>([](const Other&) {});
  }
  CHECK_FALSE(static_cast<bool>(s));
  s.reset();  // must not touch the destroyed bus
}

TEST_CASE("an exception in a handler leaves the bus usable") {
  EventBus bus;
  int calls = 0;
  auto s = bus.subscribe<Other>([&](const Other& o) {
    ++calls;
    if (o.text == "throw") throw std::runtime_error("boom");
  });
  CHECK_THROWS(bus.publish(Other{"throw"}));
  bus.publish(Other{"ok"});
  CHECK(calls == 2);
}
