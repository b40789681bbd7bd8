#pragma once
// The "fp8" module: `--set fp8.enabled=true` runs a pipeline's linear layers as FP8 GEMMs, on the
// CUDA backend (cuBLASLt FP8) and on the CPU backend (the bit-exact emulation).
//
// Install: each selected nn::Linear entity gets an Fp8Meta component (its slots in the rank's
// Fp8MetaStore) and an ops::LinearImpl that calls its Fp8Linear; each nn::GroupedLinear of the
// blocks (a mixture of experts' experts) an ops::GroupedLinearImpl that calls its Fp8GroupedLinear. Systems, after the last backward of
// the step, before the next forward:
//   fp8.amax_reduce   (grad_sync) one all-reduce (max) of all this step's amaxes over fp8.amax_group (delayed)
//   fp8.scale_update  (grad_sync) the delayed update of every scale and the history roll, one kernel (delayed)
//   fp8.weights_changed  (optimizer) marks the cached FP8 weights stale (the optimizer changed the weights)
// With delayed scaling (and fuse_weight_update) the FP8 layers' weights are marked nn::UpdatedBy:
// the optimizer leaves them alone and publishes nn::AdamWStep, on which each layer runs the same
// AdamW step fused with its weight's quantisation (Fp8Linear::update_weight), using the scales
// fp8.scale_update just made: the next forward finds its FP8 weight ready. The experts' weights
// the same way (Fp8GroupedLinear::update_weight: all experts in one pass) where the masters are not
// sharded, marked in Phase::setup once that is known.
// Anything else that changes the weights (a checkpoint load) calls Fp8State::invalidate_weights().
// fp8.recipe = block attaches Fp8BlockLinear layers instead (no meta, no amax systems, nothing in
// checkpoints; the weights' codes are made once per version, from the f32 master into the compute
// copy's memory where the masters are whole (with fuse_weight_update the optimizer's step writes
// them), else each rank quantises its parts with the tiles' scales the ranks agree on and FSDP
// gathers the codes; a mixture of experts' grouped linears stay bf16 under it so far).
#include <memory>
#include <vector>

#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/module.hpp"
#include "kiln/fp8/block_grouped_linear.hpp"
#include "kiln/fp8/block_linear.hpp"
#include "kiln/fp8/grouped_linear.hpp"
#include "kiln/fp8/linear.hpp"
#include "kiln/fp8/meta.hpp"
#include "kiln/fp8/ops.hpp"
#include "kiln/fp8/recipe.hpp"
#include "kiln/parallel/communicator.hpp"

namespace kiln::fp8 {

enum class AmaxGroup { tp, tp_dp, world };
BOOST_DESCRIBE_ENUM(AmaxGroup, tp, tp_dp, world)
BOOST_DESCRIBE_ENUM(BlockGemmKernel, cublaslt, kiln, kiln_wgrad)

struct Fp8Config {
  bool enabled = false;
  RecipeKind recipe = RecipeKind::delayed;
  int amax_history_len = 1024;
  AmaxAlgo amax_compute_algo = AmaxAlgo::max;
  int margin = 0;
  FormatPolicy format = FormatPolicy::hybrid;
  bool first_last_bf16 = false;
  bool lm_head = false;
  AmaxGroup amax_group = AmaxGroup::tp_dp;
  bool forward_fast_accum = true;
  bool weights_in_compute_copy = true;
  bool fuse_weight_update = true;
  bool keep_weight_transpose = true;
  bool block_pow2_scales = false;
  bool block_2d_wgrad_input = false;
  BlockGemmKernel block_gemm = BlockGemmKernel::cublaslt;
  void validate(config::Checks& c) const {
    c.expect(amax_history_len >= 1, "amax_history_len", "must be at least 1");
    c.expect(margin >= 0 && margin <= 100, "margin", "must be in 0..100");
  }
};
KILN_CONFIG(Fp8Config,
            (enabled, "run the linear layers' GEMMs in FP8 (false: the module installs nothing)"),
            (recipe, "scaling recipe: delayed (amax history), current (amax of the tensor itself) or block (a scale "
                     "per 1x128 block of activations and gradients, per 128x128 block of weights)"),
            (amax_history_len, "delayed scaling: steps of amax history per tensor"),
            (amax_compute_algo, "delayed scaling: amax from the history's max or its most_recent entry"),
            (margin, "scale = fp8_max / amax / 2^margin"),
            (format, "hybrid: E4M3 forward, E5M2 gradients; e4m3: E4M3 everywhere (the block recipe is E4M3 throughout)"),
            (first_last_bf16, "keep the first and the last transformer block in bf16"),
            (lm_head, "run the LM head in FP8 too"),
            (amax_group, "ranks that share scales (one all-reduce of the amaxes per step): tp, tp_dp or world"),
            (forward_fast_accum, "FP8 fast accumulation in the forward GEMMs (backward GEMMs never use it)"),
            (weights_in_compute_copy,
             "an FP8 layer's weight copies are made from the f32 master weight into the memory of its bf16 compute "
             "copy, which nothing else reads (false: extra buffers, made from the compute copy)"),
            (fuse_weight_update,
             "with delayed scaling (or the block recipe) and weights_in_compute_copy: the optimizer's AdamW step of an "
             "FP8 layer's weight writes its FP8 copies in the same pass (false: the next forward quantises the updated "
             "master again)"),
            (keep_weight_transpose,
             "delayed and current scaling, weights_in_compute_copy: an FP8 layer keeps its weight's transposed codes "
             "beside the rowwise ones (two bytes a weight element); false: the rowwise codes alone (one byte: 1.13 GiB "
             "less at 1.3B), each data gradient transposing them into scratch the layers share, as under FSDP"),
            (block_pow2_scales, "block recipe: round each block's scale down to a power of two (TransformerEngine's option)"),
            (block_2d_wgrad_input,
             "block recipe: the weight gradient's input (the layer's input, transposed) in 128x128 blocks instead of "
             "1x128 along the tokens (TransformerEngine's 2D activation scaling, for the weight gradient alone: "
             "cuBLASLt's 1x128 x 128x128 products are faster than its 1x128 x 1x128 ones on Hopper)"),
            (block_gemm,
             "block recipe on CUDA: the kernels of the block-scaled GEMMs: cublaslt (cuBLASLt's), kiln (kiln's own "
             "Hopper kernel, kiln/fp8/cuda/block_gemm.hpp) or kiln_wgrad (kiln's for the weight gradients' 1x128 x "
             "1x128 products, cuBLASLt's for the rest)"))

// World resource: this rank's FP8 machinery.
struct Fp8State {
  Fp8Recipe recipe;
  std::unique_ptr<Fp8Ops> ops;
  std::unique_ptr<Fp8MetaStore> meta;
  std::unique_ptr<Fp8Workspace> workspace;
  std::vector<Entity> entities;                      // the FP8 Linear entities, in entity order
  std::vector<std::unique_ptr<Fp8Linear>> linears;   // their layers, same order
  std::vector<Entity> grouped_entities;              // the FP8 GroupedLinear entities (a mixture of experts')
  std::vector<std::unique_ptr<Fp8GroupedLinear>> grouped;  // their layers, same order
  std::vector<std::unique_ptr<Fp8BlockLinear>> block_linears;  // fp8.recipe = block: the layers (entities' order)
  std::vector<std::unique_ptr<Fp8BlockGroupedLinear>> block_grouped;  // ... and the grouped ones (grouped_entities')
  std::int64_t grouped_version = 0;                  // their weights' version: every optimizer step bumps it once
  std::vector<std::size_t> grouped_fused;            // grouped linears whose weight update is fused
  std::int64_t grouped_update_step = -1;             // the step whose optimizer update of them ran fused
  std::int64_t weights_version = 0;                  // the cached FP8 weights are of this version
  std::vector<std::size_t> in_compute_copy;          // linears whose FP8 weights live in the compute copy
  std::vector<std::size_t> gathered;                 // sharded masters: linears reading gathered FP8 codes
  Buffer block_tile_amax;  // block recipe, sharded masters: every gathered weight's tile amaxes (one all-reduce)
  std::unique_ptr<Fp8Workspace> transposed;          // their weights' colwise copies, one layer at a time
  std::vector<std::size_t> fused;                    // linears whose weight update is fused (fuse_weight_update)
  std::int64_t fused_update_step = -1;               // the step whose optimizer update ran fused
  parallel::Communicator* amax_comm = nullptr;
  std::int64_t updates = 0;    // delayed updates done
  bool replaying = false;      // inside an activation recompute (nn::LayerRecomputeBegin .. End)
  std::vector<Subscription> subscriptions;
  void invalidate_weights() { ++weights_version; }
};

// Published after a step's amaxes were reduced and every scale updated (delayed scaling).
struct AmaxReduced {
  std::int64_t step = 0;
};

void register_module(ModuleRegistry& registry);

}  // namespace kiln::fp8
