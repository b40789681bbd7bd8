#pragma once
// Events the model publishes; FSDP gathers/frees on them, data parallelism starts gradient buckets
// on LayerBackwardEnd, activation checkpointing saves and recomputes on them.
#include <cstdint>

namespace kiln::nn {

struct LayerForwardBegin { int unit; };
struct LayerForwardEnd { int unit; };
struct LayerBackwardBegin { int unit; };
struct LayerBackwardEnd { int unit; };  // the unit's parameter gradients are complete for this micro-batch
// Around the forward pass a layer replays in its backward pass (activation recompute); FP8 layers
// reuse the original forward's scales in between, the RNG tracker is set back to the states the
// original forward started from.
struct LayerRecomputeBegin { int unit; };
struct LayerRecomputeEnd { int unit; };
struct ForwardEnd { int micro_batch; };
struct BackwardEnd { int micro_batch; };

}  // namespace kiln::nn
