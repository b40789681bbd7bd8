#pragma once
// The "fsdp" module: fully sharded data parallelism over the data-parallel dimension of the
// topology (with parallel.tp > 1, 2-D: each TP rank's part of the model sharded over its DP group).
//
// Units are the model's layer units (its nn::Layer units: the embeddings, each transformer block,
// the final norm and head); each is one flat range of the parameter store's layout, padded so that
// every rank's part is equal and aligned (nn::ParamStore::shards). A rank holds its part of every
// unit's f32 master weights, compute copy, gradients and optimizer state (the AdamW moments are laid
// out like the held elements), and nothing else of them: initialisation writes only that part.
//
// The module knows no model: it learns which units there are from the store, which unit reads
// which unit's weights from the nn::Linear components (a tied LM head reads the embeddings' unit),
// and when a unit starts and ends its forward and backward pass from the layer events. On
// LayerForwardBegin / LayerBackwardBegin it gathers the unit's compute weights (all-gather of every
// rank's part) into one of a few buffers and points the store's unit_compute at it, and gathers
// the next units ahead on a communication stream (`prefetch`); on LayerForwardEnd (full_shard) and
// LayerBackwardEnd it lets the buffer go. The unit's gradients accumulate, for one micro-batch, in
// a zeroed buffer it points unit_grads at; when every unit reading the unit has ended its backward
// pass, the buffer is reduce-scattered (summed over the shard group) into this rank's part on the
// communication stream, overlapping the next units' backward passes: written by the step's first
// micro-batch, added to by the others (with `reduce = "step"` every unit has a buffer of its own
// that accumulates the step's micro-batches, reduce-scattered once after the last). Units read by other units (the embeddings, which a tied head
// reads) and the last unit stay gathered from their first use to their last, as PyTorch FSDP2's
// root module does.
#include <cstddef>

#include <boost/describe/enum.hpp>

#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/module.hpp"

namespace kiln::parallel {

enum class FsdpStrategy { full_shard, shard_grad_op, no_shard, hybrid_shard };
BOOST_DESCRIBE_ENUM(FsdpStrategy, full_shard, shard_grad_op, no_shard, hybrid_shard)
enum class FsdpDType { bf16, fp32 };
BOOST_DESCRIBE_ENUM(FsdpDType, bf16, fp32)
// When a unit's gradients are reduce-scattered: after each micro-batch's backward (one buffer of a
// micro-batch's gradients in flight per unit), or once a step, after its last micro-batch's (each
// unit accumulating its whole gradient over the step's micro-batches, as PyTorch's pipeline
// schedules run FSDP2 stages with gradient sync on the last micro-batch only).
enum class FsdpReduce { micro_batch, step };
BOOST_DESCRIBE_ENUM(FsdpReduce, micro_batch, step)

struct FsdpConfig {
  FsdpStrategy strategy = FsdpStrategy::full_shard;
  int shard_size = 0;
  int prefetch = 1;
  FsdpDType param_dtype = FsdpDType::bf16;
  FsdpDType reduce_dtype = FsdpDType::fp32;
  FsdpReduce reduce = FsdpReduce::micro_batch;
  void validate(config::Checks& c) const {
    c.expect(shard_size >= 0, "shard_size", "must be 0 (hybrid_shard: required) or a number of data-parallel ranks");
    c.expect(prefetch >= 0, "prefetch", "must be 0 (no gather ahead) or more");
  }
};
KILN_CONFIG(FsdpConfig,
            (strategy,
             "full_shard: parameters, gradients and optimizer state sharded, a unit's weights gathered for its "
             "forward and again for its backward; shard_grad_op: weights kept gathered from forward to backward; "
             "no_shard: plain data parallelism; hybrid_shard: full_shard inside groups of shard_size "
             "data-parallel ranks, gradients all-reduced between the groups"),
            (shard_size, "hybrid_shard: data-parallel ranks per shard group (must divide them)"),
            (prefetch,
             "units gathered ahead of the one computing (forward order in the forward pass, reverse in the backward); "
             "at most prefetch + 1 block units are gathered at once"),
            (param_dtype,
             "dtype of the gathered compute weights: bf16 (the CUDA backend's; on the CPU backend the compute copy is "
             "f32 either way, bf16-rounded with backend.cpu_round_bf16); fp32 only on the CPU backend"),
            (reduce_dtype, "dtype of the gradient reduce-scatter: fp32, or bf16 (half the bytes, rounded once)"),
            (reduce,
             "when gradients are reduce-scattered: micro_batch (after each micro-batch's backward; a micro-batch's "
             "gradients of a unit or two unsharded at a time) or step (once, after the step's last micro-batch: each "
             "unit's whole f32 gradient kept unsharded over the step, one reduce-scatter instead of one per "
             "micro-batch; for pipeline stages, whose step runs many micro-batches)"))

// World resource (with a sharding strategy): the bytes this rank holds once set up, and what one
// rank would hold unsharded. Parameters: f32 master and compute copy; gradients: f32, plus the
// buffers a micro-batch's unit gradients accumulate in (every unit's, reduced once a step); optimizer:
// the buffers laid out like the held parameters (train::TrainingState::held: AdamW's two moments, f32
// or bf16) per held element; gathered: the buffers of gathered compute weights.
struct FsdpMemory {
  std::size_t params = 0, grads = 0, optimizer = 0, gathered = 0;
  std::size_t params_unsharded = 0, grads_unsharded = 0, optimizer_unsharded = 0;
  int shards = 1;  // ranks of the shard group
};

void register_fsdp_module(ModuleRegistry& registry);

}  // namespace kiln::parallel
