#pragma once
// The GPT-2 model: token + learned position embeddings, L pre-LayerNorm blocks (causal multi-head
// attention, 4x GELU MLP, all linears with bias), final LayerNorm, LM head tied to the token
// embedding, softmax cross-entropy. Explicit forward and backward per layer. The model says which
// linears, norms and residuals there are; every tensor op goes through the backend (so the same
// code runs on CUDA and on the CPU) and every split over ranks through kiln::tensor_parallel's
// layers (the model calls no collective).
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "kiln/engine/world.hpp"
#include "kiln/model/arena.hpp"
#include "kiln/model/config.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/ops/linear_impl.hpp"
#include "kiln/parallel/data_parallel.hpp"
#include "kiln/parallel/parallel_linear.hpp"
#include "kiln/parallel/tensor_parallel.hpp"
#include "kiln/parallel/vocab_parallel.hpp"
#include "kiln/rng/tracker.hpp"
#include "kiln/train/train.hpp"

namespace kiln::model {

using nn::Layer;
using nn::LayerKind;
using nn::Linear;
using nn::Param;
using nn::ParamStore;
using nn::LayerForwardBegin;
using nn::LayerForwardEnd;
using nn::LayerBackwardBegin;
using nn::LayerBackwardEnd;
using nn::LayerRecomputeBegin;
using nn::LayerRecomputeEnd;

class GptModel {
 public:
  // Creates the parameter entities and the ParamStore resource in `world`; allocates activations
  // for micro-batches of B sequences of T tokens, with room for `micro_batches` loss slots.
  GptModel(World& world, const ModelConfig& cfg, int B, int T, int micro_batches);

  // What the model splits over the tensor-parallel group, each dimension with the key that sets
  // it: checked as config errors at install and required again by the constructor.
  static std::vector<parallel::SplitDim> tensor_parallel_splits(const ModelConfig& cfg, std::int64_t tokens,
                                                                bool sequence_parallel, bool vocab_parallel);

  // Allocates the activation memory, after every module has been installed: a block whose Layer
  // entity carries an nn::ActivationRecompute component keeps only what its scope leaves out (the
  // rest lives in scratch shared by all such blocks and is recomputed in the backward pass).
  void allocate_activations();
  // Bytes of activation memory (the arena: saved activations, scratch and backward buffers).
  std::size_t activation_bytes() const { return arena_.bytes(); }
  // The logits buffer, unused while the blocks run (see nn::BlockScratch).
  nn::BlockScratch block_scratch() const { return {logits_.data, logits_.bytes()}; }
  // Fills the master weights this rank holds from the tracker's default state (layout-invariant
  // draws, by global element index) and refreshes the compute copy.
  void initialise(rng::RngStatesTracker& tracker);
  // One micro-batch forward; the per-token losses go to loss slot `slot`. With `training`, draws
  // dropout masks from the tracker and prepares the backward (the logits become dlogits). Dropout
  // masks are functions of the step and of the token's place in the step's global batch
  // (train::Batch::global_index): every micro-batch draws from the states the step's first one
  // started from, each element at its global index, so any split of the batch over data-parallel
  // ranks and micro-batches draws what one rank with the whole batch would.
  void forward(const train::Batch& batch, int slot, bool training, rng::RngStatesTracker* tracker);
  // Backward of the last training forward; accumulates into the gradient buffer.
  void backward(const train::Batch& batch);
  // Mean loss over the first `slots` loss slots, and over the data-parallel replicas (synchronises).
  double mean_loss(int slots);
  // Mean validation loss over the batches (forward only, no dropout; uses slot 0).
  double evaluate(const std::vector<train::Batch>& batches);
  // Model FLOPs per trained token (see docs/PERF.md for the formula).
  double flops_per_token() const;
  std::int64_t parameter_count() const;
  // The dloss every token's loss gets: 1 / tokens in the global batch.
  void set_loss_scale(float s) { dloss_ = s; }

 private:
  struct BlockWeights {
    TensorView ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fcp_w, fcp_b;
  };
  struct BlockActs {
    TensorView ln1_mean, ln1_rstd, ln1, qkv, atty, lse, res2, ln2_mean, ln2_rstd, ln2, fc_pre, fc;
    rng::PhiloxArgs attn_rng, attn_drop_rng, mlp_drop_rng;
  };
  // A block's linear layers (entities), in the order of nn::LinearRole.
  struct BlockLinears {
    Entity qkv, attn_out, mlp_in, mlp_out;
  };
  // The parts of a block's forward pass, as run by forward() (all) and by a recompute (some).
  enum Stage : unsigned {
    kAttention = 1,   // LayerNorm 1, QKV, attention core
    kAttnOut = 2,     // projection (summed over TP), dropout + residual (res2)
    kMlpIn = 4,       // LayerNorm 2, FC1 + GELU
    kMlpOut = 8,      // FC2 (summed over TP), dropout + residual (the block's output)
    kAllStages = 15,
  };
  // Per block: what its backward pass recomputes, and whether its saved input is split over TP.
  struct BlockPlan {
    nn::RecomputeScope scope = nn::RecomputeScope::none;
    bool distribute = false;
  };
  void block_forward(int l, float p, rng::RngStatesTracker* tracker, unsigned stages);
  // The recompute at the start of block l's backward pass (when its plan says so).
  void recompute_block(int l);
  // A LayerNorm of this rank's rows of x into `out`, the input of a column-parallel linear: under
  // sequence parallelism written to the local scratch, which the linear gathers into `out`.
  // Returns what the linear gathers from.
  TensorView layernorm_local(const TensorView& out, const TensorView& mean, const TensorView& rstd, const TensorView& x,
                             const TensorView& w, const TensorView& b);
  Entity add_param(const std::string& name, Shape global_shape, const TensorShard& shard, int unit, bool decay,
                   float std, float value, std::vector<Entity>& layer_params);
  // A LayerNorm's weight or bias: replicated, but under sequence parallelism its gradient is this
  // rank's rows' part (nn::Param::tp_partial_grad).
  Entity add_norm_param(const std::string& name, int unit, float value, std::vector<Entity>& layer_params);
  Entity add_linear(const std::string& name, nn::LinearRole role, int unit, Entity w, std::optional<Entity> b,
                    std::int64_t in, std::int64_t out);
  // The linear's implementation: the backend's linear ops, or the ops::LinearImpl a module attached
  // to the entity.
  const ops::LinearImpl& impl(Entity linear) const;
  // The backward arguments as given, with dweight_overwrite set on a step's first micro-batch for
  // the weights nothing else adds to (nn::GradWrittenFirst; the step's zeroing skipped them).
  ops::LinearBackward backward_args(Entity linear, ops::LinearBackward a) const;
  // The linear computes its LayerNorm input itself (LinearImpl::takes_layernorm_input), forward and
  // backward, so the model neither writes nor recomputes that output: where the output is not
  // stored anyway (recompute_norm) and not gathered over the TP group (sequence parallelism).
  bool layernorm_on_load(Entity linear) const;
  BlockWeights block_weights(int l, bool grads) const;
  TensorView tensor(Entity e, bool grad) const;
  ops::DropoutArgs hidden_dropout(float p, const rng::PhiloxArgs& r) const;

  World& world_;
  ModelConfig cfg_;
  ops::Backend& be_;
  parallel::TensorParallel tp_;
  parallel::DataParallel dp_;
  int B_, T_, slots_;
  int C_, H_, Vp_, L_;
  std::int64_t N_;   // tokens of a micro-batch
  std::int64_t batch_sequences_;  // sequences of the step's global batch (all ranks, all micro-batches)
  std::int64_t seq_offset_ = 0;   // the global index of the current micro-batch's first sequence
  rng::RngSnapshot step_rng_;     // the tracker's states at the step's first micro-batch
  std::int64_t Nl_;  // this rank's tokens outside the TP regions (N without sequence parallelism)
  int Hl_ = 0;       // this rank's attention heads
  int head_begin_ = 0;
  // The layers: shapes and splits (the weights come with each call), one of each kind for every block.
  parallel::VocabParallelEmbedding embedding_;
  parallel::ColumnParallelLinear qkv_, mlp_in_, lm_head_;
  parallel::RowParallelLinear attn_out_, mlp_out_;
  parallel::VocabParallelCrossEntropy loss_;
  ops::LinearImpl backend_linear_;  // the backend's linear ops, for linears without a module's impl
  float dloss_ = 1.0f;
  std::vector<Entity> layers_;  // unit -> layer entity
  Entity wte_{}, wpe_{}, lnf_w_{}, lnf_b_{};
  std::vector<std::array<Entity, 12>> block_params_;
  std::vector<BlockLinears> block_linears_;
  Entity lm_head_entity_{};

  Arena arena_;
  TensorView tokens_, targets_, losses_;
  std::vector<TensorView> res_;  // L+1 residual streams: res_[l] is block l's input
  std::vector<BlockActs> acts_;
  std::vector<BlockPlan> plan_;
  BlockActs shared_acts_;             // the recomputed activations of every recomputing block
  std::vector<TensorView> res_saved_;  // distributed saved inputs: this rank's rows of res_[l]
  TensorView res_pingpong_[2];        // full-width inputs of blocks whose saved input is distributed
  bool allocated_ = false;
  bool recompute_ln_ = false, recompute_gelu_ = false;  // the backward pass refills LayerNorm / GELU outputs
  bool gelu_in_fc2_ = false;  // FC2's implementation computes the GELU of FC1's pre-activation itself
  TensorView lnf_, lnf_mean_, lnf_rstd_, logits_, scratch_c_;
  TensorView local_c_, full_c_;  // SP: [Nl, C] and [N, C] scratch (both scratch_c_ without SP)
  TensorView ln_shared_, fc_shared_;  // recompute_norm / recompute_gelu: the blocks' LayerNorm and GELU outputs
  // backward scratch
  TensorView dres_, dtmp_, datty_, dln_, dqkv_, dfc_;
  bool have_forward_ = false;
};

}  // namespace kiln::model
