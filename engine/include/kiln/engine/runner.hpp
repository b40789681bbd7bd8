#pragma once
// Building a World from a resolved pipeline and driving the step loop.
#include "kiln/engine/config/pipeline.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/engine/world.hpp"

namespace kiln {

// Installs the pipeline's modules into `world` (dependencies first), after creating RunControl and
// RankInfo (if absent), then checks the system order. Nothing runs yet.
void install_pipeline(World& world, const config::PipelineConfig& cfg, const ModuleRegistry& registry);

// setup; then per step (RunControl::step incremented first): step_begin, micro_batches x (data, forward,
// backward) or the passes of StepPasses in its order, grad_sync,
// optimizer, step_end, checkpoint; until RunControl::stop; then shutdown. Queued events are
// drained after every phase.
void run_pipeline(World& world);

}  // namespace kiln
