#pragma once
// The GPT-2 model: token + learned position embeddings, L pre-LayerNorm blocks (causal multi-head
// attention, 4x GELU MLP, all linears with bias), final LayerNorm, LM head tied to the token
// embedding, softmax cross-entropy. Explicit forward and backward per layer; every tensor op goes
// through the backend interface, so the same code runs on CUDA and on the CPU.
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "kiln/engine/world.hpp"
#include "kiln/model/arena.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/model/config.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/ops/linear_impl.hpp"
#include "kiln/parallel/module.hpp"
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

  // Allocates the activation memory, after every module has been installed: a block whose Layer
  // entity carries an nn::ActivationRecompute component keeps only what its scope leaves out (the
  // rest lives in scratch shared by all such blocks and is recomputed in the backward pass).
  void allocate_activations();
  // Bytes of activation memory (the arena: saved activations, scratch and backward buffers).
  std::size_t activation_bytes() const { return arena_.bytes(); }
  // The logits buffer, unused while the blocks run (see nn::BlockScratch).
  nn::BlockScratch block_scratch() const { return {logits_.data, logits_.bytes()}; }
  // Fills the master weights from the tracker's default state (layout-invariant draws) and refreshes
  // the compute copy.
  void initialise(rng::RngStatesTracker& tracker);
  // One micro-batch forward; the per-token losses go to loss slot `slot`. With `training`, draws
  // dropout masks from the tracker and prepares the backward (the logits become dlogits).
  void forward(const train::Batch& batch, int slot, bool training, rng::RngStatesTracker* tracker);
  // Backward of the last training forward; accumulates into the gradient buffer.
  void backward(const train::Batch& batch);
  // Mean loss over the first `slots` loss slots (synchronises).
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
  // The parts of a block's forward pass, as run by forward() (all) and by a recompute (some).
  enum Stage : unsigned {
    kAttention = 1,   // LayerNorm 1, QKV, attention core
    kAttnOut = 2,     // projection, TP reduction, dropout + residual (res2)
    kMlpIn = 4,       // LayerNorm 2, FC1 + GELU
    kMlpOut = 8,      // FC2, TP reduction, dropout + residual (the block's output)
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
  Entity add_param(const std::string& name, Shape global_shape, const TensorShard& shard, int unit, bool decay,
                   float std, float value, std::vector<Entity>& layer_params);
  // Draws this rank's part of a parameter: each element from its index in the logical tensor.
  void init_shard(const TensorView& local, const Param& p, const rng::PhiloxArgs& r);
  Entity add_linear(const std::string& name, const std::string& role, int unit, Entity w, std::optional<Entity> b,
                    int in, int out);
  // The backend's linear ops, or the ops::LinearImpl a module attached to that linear entity.
  // The linear computes its LayerNorm input itself (LinearImpl::takes_layernorm_input), forward and
  // backward, so the model neither writes nor recomputes that output: where the output is not
  // stored anyway (recompute_norm) and not gathered over the TP group (sequence parallelism).
  bool layernorm_on_load(Entity linear) const;
  void linear_forward(Entity linear, const ops::LinearForward& a);
  void linear_backward(Entity linear, const ops::LinearBackward& a);
  BlockWeights block_weights(int l, bool grads) const;
  TensorView tensor(Entity e, bool grad) const;
  ops::DropoutArgs hidden_dropout(float p, const rng::PhiloxArgs& r) const;
  // Row-parallel layers add their (replicated) bias on TP rank 0 only, before the all-reduce.
  TensorView row_parallel_bias(const TensorView& bias) const;
  void tp_all_reduce(const TensorView& t);
  // Entering a TP region: `full` [N, C] = the rows of every rank (all-gather), or a copy-free no-op
  // without sequence parallelism (then local is full).
  void gather_rows(const TensorView& full, const TensorView& local);
  // Leaving a TP region: the partial sums in `full` [N, C] summed over TP, this rank's rows into
  // `local` (reduce-scatter), or an all-reduce in place without sequence parallelism.
  void reduce_rows(const TensorView& local, const TensorView& full);
  // This rank's rows of a full [N, C] tensor.
  TensorView my_rows(const TensorView& full) const;

  World& world_;
  ModelConfig cfg_;
  ops::Backend& be_;
  int B_, T_, slots_;
  int C_, H_, Vp_, L_;
  int tp_ = 1, tp_rank_ = 0, Hl_ = 0;  // tensor parallelism: group size, rank, local heads
  bool sp_ = false;                    // sequence parallelism
  bool vp_ = false;                    // vocabulary parallelism: wte rows and logits split over TP
  int Vl_ = 0;                         // this rank's vocabulary rows (Vp_ without vocabulary parallelism)
  std::int64_t vocab_begin_ = 0;       // its first row
  std::int64_t Nl_ = 0;                // this rank's tokens outside the TP regions (N without SP)
  parallel::Communicator* tp_comm_ = nullptr;
  parallel::Communicator* dp_comm_ = nullptr;
  float dloss_ = 1.0f;
  std::vector<Entity> layers_;  // unit -> layer entity
  Entity wte_{}, wpe_{}, lnf_w_{}, lnf_b_{};
  std::vector<std::array<Entity, 12>> block_params_;
  std::vector<std::array<Entity, 4>> block_linears_;  // qkv, attn_proj, fc, fc_proj
  Entity lm_head_{};

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
  TensorView ce_stats_, ce_all_stats_;  // vocabulary-parallel cross-entropy: [N, 3] and [tp, N, 3]
  TensorView local_c_, full_c_;  // SP: [Nl, C] and [N, C] scratch (both scratch_c_ without SP)
  TensorView ln_shared_, fc_shared_;  // recompute_norm / recompute_gelu: the blocks' LayerNorm and GELU outputs
  // backward scratch
  TensorView dres_, dtmp_, datty_, dln_, dqkv_, dfc_;
  bool have_forward_ = false;
};

}  // namespace kiln::model
