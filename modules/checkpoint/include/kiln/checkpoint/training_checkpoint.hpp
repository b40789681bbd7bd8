#pragma once
// The "checkpoint" module: training-state checkpoints. Every `every` steps (and after the last,
// with at_end) each rank writes the parts of the global tensors it holds (f32 master weights and
// every buffer registered in train::TrainingState, e.g. AdamW's moments) and its own state (RNG
// tracker, FP8 scaling) into DIR/step_NNNNNN.tmp/rank_RRRRR.bin; once every rank has, rank 0
// writes the manifest, renames the directory to step_NNNNNN and points DIR/latest at it. In
// Phase::setup, after every other setup system, it resumes from the checkpoint `resume` names:
// each rank reads the slices of the global tensors it now holds, whatever layout saved them.
// docs/CHECKPOINTS.md describes the format and the rules for a changed layout.
#include <cstdint>
#include <string>

#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/module.hpp"

namespace kiln::checkpoint {

struct CheckpointConfig {
  std::string dir = "checkpoints";
  std::int64_t every = 0;
  int keep = 0;
  bool async = false;
  std::string resume = "auto";
  bool at_end = true;
  void validate(config::Checks& c) const {
    c.expect(!dir.empty(), "dir", "must name a folder");
    c.expect(every >= 0, "every", "must be >= 0 (0: save only at the end, with at_end)");
    c.expect(keep >= 0, "keep", "must be >= 0 (0: keep every checkpoint)");
    c.expect(!resume.empty(), "resume", "must be \"auto\", \"never\" or the path of a checkpoint");
  }
};
KILN_CONFIG(CheckpointConfig,
            (dir, "folder of the run's checkpoints: one step_NNNNNN/ directory each, `latest` naming the newest"),
            (every, "save every this many steps; 0: only after the last step (at_end)"),
            (keep, "keep the newest this many checkpoints, removing older ones once a newer one is complete; 0: all"),
            (async,
             "the step waits only while the state is copied to host memory; a background thread writes the files, "
             "and the next save (or the end of the run) waits for it; a failed write stops the run at the next step"),
            (resume,
             "auto: continue from the newest complete checkpoint under dir, if there is one; never: start fresh; or "
             "the path of a checkpoint directory (or of a folder of them: its newest)"),
            (at_end, "save after the last step (a fresh run of train.steps = 0: its starting state, as step 0)"))

void register_state_module(ModuleRegistry& registry);

}  // namespace kiln::checkpoint
