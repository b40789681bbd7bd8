#pragma once
// The engine's own [engine] section and run control. Registered like any module (name "engine").
#include <boost/describe/enum.hpp>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kiln/engine/config/node.hpp"
#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/module.hpp"

namespace kiln {

enum class DeviceKind { auto_, cuda, cpu };
BOOST_DESCRIBE_ENUM(DeviceKind, auto_, cuda, cpu)

struct EngineConfig {
  DeviceKind device = DeviceKind::auto_;
  std::vector<std::string> plugins;
  bool print_schedule = false;
};
KILN_CONFIG(EngineConfig,
            (device, "compute backend: auto (CUDA when a GPU is present), cuda or cpu"),
            (plugins, "shared libraries with extra modules, relative to the pipeline file"),
            (print_schedule, "print the systems of every phase in order at startup"))

// Steering of the step loop, a World resource created by the engine. The training module sets the
// number of micro-batches per step and asks for the stop.
struct RunControl {
  std::int64_t step = 0;         // the current step, counted from 1; 0 before the first
  int micro_batches = 1;         // data/forward/backward run this many times per step
  int micro_batch = 0;           // index of the current micro-batch
  int chunk = 0;                 // the model chunk the current pass runs on (StepPasses; else 0)
  bool stop = false;
  std::string stop_reason;
  void request_stop(std::string reason) {
    if (!stop) stop_reason = std::move(reason);
    stop = true;
  }
};

// One pass of a step (a pipeline schedule's order of them): a micro-batch's forward on one model
// chunk (Phase::data, on the micro-batch's first chunk only, then Phase::forward) or its backward
// (Phase::backward).
struct StepPass {
  bool forward = true;
  int micro_batch = 0;
  int chunk = 0;
  bool operator==(const StepPass&) const = default;
};

// A World resource setting the order of a step's passes (pipeline parallelism: the module that splits
// the model into stages emplaces its rank's schedule). Without it every micro-batch runs data,
// forward and backward in turn, on chunk 0. Each micro-batch's first forward must come in
// micro-batch order (the data phase reads the batches in turn).
struct StepPasses {
  std::vector<StepPass> passes;
};

// A World resource for a module that launches some phases' device work another way (the model
// replaying a CUDA graph of a micro-batch's forward and backward): the runner calls `before` ahead of
// every phase and runs the phase's systems only when it returns false, then calls `after`.
struct PhaseHook {
  std::function<bool(World&, Phase)> before;
  std::function<void(World&, Phase)> after;
};

// Where this World sits in the job: filled by the launcher before modules are installed.
struct RankInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string pipeline_file;
  int local_world_size = 1;  // ranks sharing this machine (threads of one process, or local processes)
};

// Where each value of the running pipeline came from (a World resource made by install_pipeline).
// A module's install reports what only shows once modules meet (a size that does not divide over
// the ranks, a setting that cannot run yet) as a ConfigError naming the key and its place.
struct ConfigSources {
  std::string file;
  config::Node doc;
  std::string effective;  // the complete effective configuration as TOML (what `kiln config` prints)
};

// "p.toml:12:1: parallel.pp: <message>" (or the --set argument, or "p.toml (default value)"), as
// the loader reports failed validations. Without a ConfigSources resource, the RankInfo's file.
ConfigError config_error(World& world, std::string_view key, const std::string& message);

void register_engine_module(ModuleRegistry& registry);

}  // namespace kiln
