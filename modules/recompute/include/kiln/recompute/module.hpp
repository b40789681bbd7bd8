#pragma once
// The "activation_checkpoint" module: recompute activations in the backward pass instead of keeping
// them. It picks the transformer blocks, attaches an nn::ActivationRecompute component to each (the
// model then keeps only what the scope leaves out, in Phase::setup), captures the RNG tracker's
// states on LayerForwardBegin of those blocks and replays them between LayerRecomputeBegin and
// LayerRecomputeEnd, so the recompute draws the dropout masks of the original forward and the
// gradients are bit-identical to a run without recompute.
#include <memory>
#include <vector>

#include <boost/describe/enum.hpp>

#include "kiln/recompute/rng_replay.hpp"
#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/config/schema.hpp"
#include "kiln/engine/module.hpp"
#include "kiln/engine/world.hpp"

namespace kiln::recompute {

enum class CheckpointMode { none, full, selective };
BOOST_DESCRIBE_ENUM(CheckpointMode, none, full, selective)
enum class SelectiveScope { attention, mlp };
BOOST_DESCRIBE_ENUM(SelectiveScope, attention, mlp)

struct ActivationCheckpointConfig {
  CheckpointMode mode = CheckpointMode::none;
  SelectiveScope selective = SelectiveScope::attention;
  int every = 1;
  int first = 0;
  bool distribute_saved_activations = false;
  void validate(config::Checks& c) const {
    c.expect(every >= 1, "every", "must be at least 1");
    c.expect(first >= 0, "first", "must be 0 (every block) or a number of blocks");
  }
  // Whether block `b` (0-based) is checkpointed.
  bool covers(int block) const {
    return mode != CheckpointMode::none && block % every == 0 && (first == 0 || block < first);
  }
};
KILN_CONFIG(ActivationCheckpointConfig,
            (mode,
             "none; full: keep only each chosen block's input and recompute its forward pass in the backward pass; "
             "selective: recompute only the part named by `selective`"),
            (selective,
             "selective mode: attention (LayerNorm 1, QKV GEMM and attention core: 4 of the block's 10 saved values "
             "per token and channel) or mlp (LayerNorm 2 and FC1+GELU: 4 or 8 of them)"),
            (every, "checkpoint the blocks whose index is a multiple of this (1: every block)"),
            (first, "checkpoint only among the first n blocks (0: all blocks)"),
            (distribute_saved_activations,
             "with tensor parallelism (without sequence parallelism): each TP rank keeps 1/tp of a checkpointed "
             "block's saved input and all-gathers it before the recompute"))

// World resource: the checkpointed units and their RNG replay.
struct ActivationCheckpointState {
  std::vector<int> units;  // layer units (block + 1) with recompute, ascending
  std::unique_ptr<RngReplay> rng;
  std::vector<Subscription> subscriptions;
  std::int64_t recomputes = 0;  // recomputes done (all units, all steps)
};

void register_module(ModuleRegistry& registry);

}  // namespace kiln::recompute
