#pragma once
// backend.cuda_graph: each micro-batch's forward and backward captured once as a CUDA graph (after
// two eager steps, which size every buffer and settle the FP8 scales' state) and replayed in every
// later step instead of launching the ops one by one. The micro-batch's tokens are uploaded in the
// data phase, outside the graph; the dropout masks come from the RNG tracker's graph-safe mode (each
// replay's base offsets are copied in before its launch, so every step draws fresh masks and the
// tracker advances as an eager step would). A graph per micro-batch index: the loss slot and whether
// the weight gradients are written or accumulated differ between them.
//
// Where every system of the grad_sync and optimizer phases is replayable (SystemDesc::replayable: on
// one rank, the gradient clipping and AdamW on the device, the FP8 scale update and fused weight
// update), the last micro-batch's graph holds them too: the whole step is one launch per micro-batch.
// The step's learning rate and bias corrections are copied to the device at step_begin (optim), the
// loss is read at step_end, with the step's other reads. Elsewhere (ranks: the gradients'
// collectives and norm, FSDP) those phases run eagerly after the last graph, said once at start.
//
// It runs the phases through the engine's PhaseHook: on a replaying step the forward and backward
// phases' systems do not run at all, so whatever they would do on the host must be the same every
// step. What breaks that is refused at start (eager steps, said once): the CPU backend, op profiling,
// ranks that are threads of one process (their exchanges go through host memory), pipeline stages
// (their transfers follow the host's schedule), mixtures of experts (the experts' group sizes reach
// the host every step), and any other system in the forward or backward phase. A module acting
// on the layer events (LayerForwardBegin, ...) sees them in the eager steps and the captured one only;
// one that keeps host bookkeeping on them, or streams of its own, hears nn::PassesGraphBegin,
// nn::PassesCaptureEnd and nn::PassesReplayed.
//
// With more than one rank (processes, NCCL) the passes' collectives are captured with them: tensor
// parallelism's all-reduces, gathers and reduce-scatters (and their side stream under
// parallel.tp_comm_overlap), the data-parallel gradient buckets the last micro-batch's backward
// starts, and FSDP's gathers and reduce-scatters on its communication stream (which buffer each unit
// takes is decided once, in the capture, and the fsdp module's host state set as the capture left it
// after each launch). Every rank captures at the same step and replays the same sequence, so the
// collectives still meet; the NCCL watchdog times each launch as one collective.
#include <memory>
#include <string>
#include <vector>

#include "kiln/engine/world.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/rng/tracker.hpp"

namespace kiln::model {

class StepGraph {
 public:
  static constexpr int kEagerSteps = 2;
  // Why the step cannot be captured in this world ("" when it can).
  static std::string refusal(World& w);
  // Why the grad_sync and optimizer phases stay out of the graphs ("" when the last holds them).
  static std::string optimizer_refusal(World& w);
  // Installs the PhaseHook that captures and replays.
  static void install(World& w);

  bool before(World& w, Phase p);
  void after(World& w, Phase p);
  int graphs() const;  // captured so far
  bool through_optimizer() const { return through_optimizer_; }

 private:
  struct Captured {
    std::unique_ptr<ops::CapturedWork> work;
    rng::GraphCapture rng;
    Buffer bases;  // the RNG states' base offsets the graph's kernels read
  };
  void replay(World& w, Captured& c, int micro_batch);  // a later step's launch
  void launch(World& w, Captured& c, int micro_batch, bool captured_now);
  bool holds_optimizer(World& w, int micro_batch) const;  // this micro-batch's graph runs through it
  void end_capture(World& w);

  std::vector<Captured> by_micro_batch_;
  int steps_ = 0;          // steps begun
  int capturing_ = -1;     // the micro-batch being captured
  bool replayed_ = false;  // this micro-batch's forward and backward ran as a replay
  bool through_optimizer_ = false;  // the last micro-batch's graph holds grad_sync and optimizer
};

}  // namespace kiln::model
