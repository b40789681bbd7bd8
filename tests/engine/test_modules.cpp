#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "kiln/engine/config/pipeline.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/engine/module.hpp"
#include "kiln/engine/runner.hpp"

namespace demo {
// Each module has its own config type (it becomes a World resource).
template <int N>
struct EmptyConfig {
  int unused = 0;
};
KILN_CONFIG(EmptyConfig<0>, (unused, "nothing"))
KILN_CONFIG(EmptyConfig<1>, (unused, "nothing"))
KILN_CONFIG(EmptyConfig<2>, (unused, "nothing"))

struct Installed {
  std::vector<std::string> order;
};

template <int N = 0>
kiln::ModuleDesc module(std::string name, std::vector<std::string> deps) {
  return kiln::make_module<EmptyConfig<N>>(name, "a test module", std::move(deps),
                                        [name](kiln::World& w, const EmptyConfig<N>&) {
                                          if (!w.has_resource<Installed>()) w.emplace_resource<Installed>();
                                          w.resource<Installed>().order.push_back(name);
                                        });
}
}  // namespace demo

TEST_CASE("modules install after their dependencies") {
  kiln::ModuleRegistry reg;
  kiln::register_engine_module(reg);
  reg.add(demo::module<0>("optim", {"model"}));
  reg.add(demo::module<1>("model", {"rng"}));
  reg.add(demo::module<2>("rng", {}));
  CHECK(reg.install_order({"optim"}) == std::vector<std::string>{"rng", "model", "optim"});
  auto doc = kiln::config::parse_toml_text("[optim]\n", "p.toml");
  auto cfg = kiln::config::resolve(doc, "p.toml", reg);
  kiln::World w;
  kiln::install_pipeline(w, cfg, reg);
  CHECK(w.resource<demo::Installed>().order == std::vector<std::string>{"rng", "model", "optim"});
  CHECK(w.has_resource<demo::EmptyConfig<1>>());
}

TEST_CASE("a duplicate module name is an error") {
  kiln::ModuleRegistry reg;
  reg.add(demo::module("rng", {}));
  CHECK_THROWS_WITH_AS(reg.add(demo::module("rng", {})), doctest::Contains("'rng' is registered twice"), kiln::Error);
}

TEST_CASE("a missing dependency is an error naming both modules") {
  kiln::ModuleRegistry reg;
  reg.add(demo::module("fp8", {"parallel"}));
  CHECK_THROWS_WITH_AS(reg.install_order({"fp8"}), doctest::Contains("'fp8' depends on 'parallel'"), kiln::Error);
}

TEST_CASE("a dependency cycle is an error naming the modules in it") {
  kiln::ModuleRegistry reg;
  reg.add(demo::module("a", {"b"}));
  reg.add(demo::module("b", {"c"}));
  reg.add(demo::module("c", {"a"}));
  reg.add(demo::module("d", {}));
  try {
    reg.check();
    FAIL("expected a cycle");
  } catch (const kiln::Error& e) {
    std::string m = e.what();
    CHECK(m.find("cycle") != std::string::npos);
    CHECK(m.find("'a'") != std::string::npos);
    CHECK(m.find("'b'") != std::string::npos);
    CHECK(m.find("'c'") != std::string::npos);
    CHECK(m.find("'d'") == std::string::npos);
  }
}

namespace {
// A system per phase that logs its name; the run stops after step 2.
void log_phases(kiln::World& w, std::vector<std::string>& log) {
  for (auto p : kiln::all_phases())
    w.systems().add({std::string(kiln::phase_name(p)), p, [&log, p](kiln::World& world) {
                       log.push_back(std::string(kiln::phase_name(p)));
                       if (p == kiln::Phase::step_end && world.resource<kiln::RunControl>().step == 2)
                         world.resource<kiln::RunControl>().request_stop("done");
                     }});
}
}  // namespace

TEST_CASE("the run loop runs setup, the step phases per step, and shutdown") {
  kiln::World w;
  auto& ctl = w.emplace_resource<kiln::RunControl>();
  ctl.micro_batches = 2;
  std::vector<std::string> log;
  log_phases(w, log);
  kiln::run_pipeline(w);
  std::vector<std::string> step = {"step_begin", "data", "forward", "backward", "data", "forward",
                                   "backward", "grad_sync", "optimizer", "step_end", "checkpoint"};
  std::vector<std::string> expected = {"setup"};
  for (int s = 0; s < 2; ++s) expected.insert(expected.end(), step.begin(), step.end());
  expected.push_back("shutdown");
  CHECK(log == expected);
  CHECK(ctl.stop_reason == "done");
}

TEST_CASE("a PhaseHook is asked before every phase and skips the systems of those it runs itself") {
  kiln::World w;
  auto& ctl = w.emplace_resource<kiln::RunControl>();
  std::vector<std::string> log;
  log_phases(w, log);
  // From step 2 on, the forward and backward run "another way" (as a replayed graph would).
  w.emplace_resource<kiln::PhaseHook>(kiln::PhaseHook{
      [&log](kiln::World& world, kiln::Phase p) {
        const bool skip = world.resource<kiln::RunControl>().step >= 2 &&
                          (p == kiln::Phase::forward || p == kiln::Phase::backward);
        if (skip) log.push_back(std::string("hooked ") + std::string(kiln::phase_name(p)));
        return skip;
      },
      [&log](kiln::World&, kiln::Phase p) {
        if (p == kiln::Phase::backward) log.push_back("after backward");
      }});
  kiln::run_pipeline(w);
  const std::vector<std::string> expected = {
      "setup",      "step_begin",     "data",           "forward",   "backward",  "after backward",
      "grad_sync",  "optimizer",      "step_end",       "checkpoint", "step_begin", "data",
      "hooked forward", "hooked backward", "after backward", "grad_sync", "optimizer", "step_end",
      "checkpoint", "shutdown"};
  CHECK(log == expected);
  CHECK(ctl.stop_reason == "done");
}

TEST_CASE("StepPasses orders a step's passes: data once per micro-batch, on its first chunk") {
  kiln::World w;
  auto& ctl = w.emplace_resource<kiln::RunControl>();
  ctl.micro_batches = 2;
  std::vector<std::string> log;
  for (auto p : kiln::all_phases())
    w.systems().add({std::string(kiln::phase_name(p)), p, [&log, p](kiln::World& world) {
                       const auto& c = world.resource<kiln::RunControl>();
                       std::string entry(kiln::phase_name(p));
                       if (p == kiln::Phase::data || p == kiln::Phase::forward || p == kiln::Phase::backward)
                         entry += " " + std::to_string(c.micro_batch) + "." + std::to_string(c.chunk);
                       log.push_back(entry);
                       if (p == kiln::Phase::step_end) world.resource<kiln::RunControl>().request_stop("done");
                     }});
  // An interleaved pipeline rank's order: micro-batches 0 and 1 on chunks 0 and 1.
  w.emplace_resource<kiln::StepPasses>(kiln::StepPasses{{{true, 0, 0},
                                                         {true, 1, 0},
                                                         {true, 0, 1},
                                                         {false, 0, 1},
                                                         {true, 1, 1},
                                                         {false, 1, 1},
                                                         {false, 0, 0},
                                                         {false, 1, 0}}});
  kiln::run_pipeline(w);
  const std::vector<std::string> expected = {
      "setup",        "step_begin",   "data 0.0",     "forward 0.0",  "data 1.0",     "forward 1.0",
      "forward 0.1",  "backward 0.1", "forward 1.1",  "backward 1.1", "backward 0.0", "backward 1.0",
      "grad_sync",    "optimizer",    "step_end",     "checkpoint",   "shutdown"};
  CHECK(log == expected);
  CHECK(ctl.chunk == 0);
}
