#include "kiln/engine/runner.hpp"

#include <iostream>

namespace kiln {

void install_pipeline(World& world, const config::PipelineConfig& cfg, const ModuleRegistry& registry) {
  if (!world.has_resource<RunControl>()) world.emplace_resource<RunControl>();
  if (!world.has_resource<RankInfo>()) world.emplace_resource<RankInfo>(RankInfo{0, 1, 0, cfg.file});
  if (!world.has_resource<ConfigSources>())
    world.emplace_resource<ConfigSources>(ConfigSources{cfg.file, cfg.doc, config::to_toml(cfg, registry)});
  for (auto& name : cfg.modules) {
    const auto& desc = registry.get(name);
    try {
      desc.install(world, cfg.values.at(name));
    } catch (const ConfigError&) {
      throw;
    } catch (const FileError& e) {  // keeps its exit code (2)
      throw FileError(cat("installing module '", name, "': ", e.what()));
    } catch (const std::exception& e) {  // a plugin's module may throw anything: name the module
      throw Error(cat("installing module '", name, "': ", e.what()));
    }
  }
  world.systems().build();
  if (cfg.enabled("engine") && cfg.get<EngineConfig>("engine").print_schedule &&
      world.resource<RankInfo>().rank == 0) {
    for (auto phase : all_phases()) {
      std::cout << "phase " << phase_name(phase) << ":";
      for (auto& s : world.systems().order(phase)) std::cout << " " << s;
      std::cout << "\n";
    }
  }
}

void run_pipeline(World& world) {
  auto& ctl = world.resource<RunControl>();
  auto& sys = world.systems();
  auto phase = [&](Phase p) {
    const auto* hook = world.try_resource<PhaseHook>();
    if (!hook || !hook->before(world, p)) sys.run(p, world);
    if (hook) hook->after(world, p);
    world.events().drain();
  };
  phase(Phase::setup);
  while (!ctl.stop) {
    ++ctl.step;
    phase(Phase::step_begin);
    if (const auto* order = world.try_resource<StepPasses>()) {
      for (const StepPass& pass : order->passes) {
        ctl.micro_batch = pass.micro_batch;
        ctl.chunk = pass.chunk;
        if (pass.forward && pass.chunk == 0) phase(Phase::data);
        phase(pass.forward ? Phase::forward : Phase::backward);
      }
      ctl.chunk = 0;
    } else {
      for (ctl.micro_batch = 0; ctl.micro_batch < ctl.micro_batches; ++ctl.micro_batch) {
        phase(Phase::data);
        phase(Phase::forward);
        phase(Phase::backward);
      }
    }
    phase(Phase::grad_sync);
    phase(Phase::optimizer);
    phase(Phase::step_end);
    phase(Phase::checkpoint);
  }
  phase(Phase::shutdown);
}

}  // namespace kiln
