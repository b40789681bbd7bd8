#pragma once
// Events the model (and the optimizer: AdamWStep) publishes; FSDP gathers/frees on them, data parallelism starts gradient buckets
// on LayerBackwardEnd, activation checkpointing saves and recomputes on them.
#include <cstdint>

#include "kiln/tensor/tensor.hpp"

namespace kiln::nn {

// `training`: false in a forward pass no backward pass follows (validation): modules that prepare the
// backward pass (activation offload) stand aside.
struct LayerForwardBegin { int unit; bool training = true; };
struct LayerForwardEnd { int unit; bool training = true; };
struct LayerBackwardBegin { int unit; };
struct LayerBackwardEnd { int unit; };  // the unit's parameter gradients are complete for this micro-batch
// Around the forward pass a layer replays in its backward pass (activation recompute); FP8 layers
// reuse the original forward's scales in between, the RNG tracker is set back to the states the
// original forward started from.
struct LayerRecomputeBegin { int unit; };
struct LayerRecomputeEnd { int unit; };
struct ForwardEnd { int micro_batch; };
struct BackwardEnd { int micro_batch; };
// backend.cuda_graph (model::StepGraph) captures a micro-batch's forward and backward passes once and
// launches the graph in every later step instead of running them; where every system of the
// grad_sync and optimizer phases is replayable (SystemDesc::replayable), the last micro-batch's graph
// holds those phases too (`through_optimizer`): the whole step's device work is one launch.
// - PassesGraphBegin: before the capture begins and before each later launch. A module with a stream
//   of its own makes the compute stream wait for what it queued there eagerly (the graph's branches
//   are not ordered after it) and forgets events recorded outside the graph (a capture cannot wait
//   for them).
// - PassesCaptureEnd: the passes' systems ran under capture and the capture is about to end: such a
//   module joins its stream's captured work into the compute stream (a capture must end joined).
// - PassesReplayed: after each launch (the capture's own included); no layer event of the micro-batch
//   was published for it, so a module keeping host bookkeeping on those events sets it as the
//   captured passes left it, and records again any event the graph recorded that eager work after it
//   waits for.
struct PassesGraphBegin {
  int micro_batch;
  bool through_optimizer = false;
};
struct PassesCaptureEnd {
  int micro_batch;
  bool through_optimizer = false;
};
// With `through_optimizer`, a module keeping host bookkeeping in the grad_sync or optimizer phase
// (counters, a step's events) does there what those systems would have done on the host, except
// after the capture's own launch (`captured_now`: those systems ran on the host as it was recorded).
struct PassesReplayed {
  int micro_batch;
  bool through_optimizer = false;
  bool captured_now = false;
};

// Published by the optimizer once per step, after it queued its own AdamW update on the compute
// stream, for the parameters marked UpdatedBy: each handler applies exactly that update
// (ops::adamw_update with these hyperparameters) to its parameters, reading the state at the
// parameter's offset and the step's learning rate, gradient scale (clipping) and bias corrections
// from `scalars` when its kernels run (ops::AdamW::scalars: a NaN scale skips the step).
struct AdamWStep {
  std::int64_t step = 0;  // the optimizer's step count, from 1
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0;  // lr: this step's, also in scalars
  float weight_decay = 0;         // for parameters with Param::weight_decay
  const float* scalars = nullptr;  // device: lr, gradient scale, bias corrections (ops::AdamWScalar)
  TensorView m, v;  // [ParamStore::held] f32 or bf16 (optim.moments), laid out like the held parameters
};

// Published (in Phase::setup) after a checkpoint replaced the held master weights, their compute
// copy and the other training state: whoever keeps copies derived from the weights (gathered FSDP
// units, FP8 weight codes) makes them again.
struct ParamsLoaded {
  std::int64_t step = 0;  // the checkpoint's
};

}  // namespace kiln::nn
