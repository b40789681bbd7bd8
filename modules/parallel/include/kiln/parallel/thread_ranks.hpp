#pragma once
// Ranks as threads (engine glue, kiln::parallel_module). On the CPU backend `kiln run --nproc N`
// runs N ranks as threads of one process, each with its own World, connected by an InProcessHub. A
// rank that fails aborts the collectives of the others, which stop with a message naming it.
#include <functional>
#include <string>
#include <vector>

#include "kiln/engine/config/pipeline.hpp"
#include "kiln/engine/world.hpp"

namespace kiln::parallel {

struct RankOutcome {
  int rank = 0;
  bool ok = true;
  bool config_error = false;
  bool file_error = false;  // a kiln::FileError (a bad checkpoint, a full disk)
  std::string error;  // the rank's own message
  std::string stop_reason;  // why the step loop stopped (RunControl::stop_reason), when ok
};

// Builds and runs one World per rank on `nproc` threads. `before_run` (after the modules are
// installed) and `after_run` (after shutdown) are called on each rank's thread with its World.
// Returns every rank's outcome, in rank order.
std::vector<RankOutcome> run_thread_ranks(int nproc, const config::PipelineConfig& cfg, const ModuleRegistry& registry,
                                          const std::function<void(World&)>& before_run = {},
                                          const std::function<void(World&)>& after_run = {});

// The outcome's messages, root causes first, each prefixed with "[rank r] ".
std::string describe_failures(const std::vector<RankOutcome>& outcomes);

}  // namespace kiln::parallel
