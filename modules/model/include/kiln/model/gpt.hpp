#pragma once
// The decoder-only transformer of both architectures (model.arch), as Megatron's GPTModel takes
// Llama by configuration. gpt2: token + learned position embeddings, L pre-LayerNorm blocks (causal
// multi-head attention, 4x GELU MLP, all linears with bias), final LayerNorm, LM head tied to the
// token embedding. llama: token embedding, L pre-RMSNorm blocks (rotary embeddings on the queries
// and keys, grouped-query attention, SwiGLU MLP, no biases), final RMSNorm, LM head tied or not.
// Softmax cross-entropy. Explicit forward and backward per layer. The model says which linears,
// norms and residuals there are; every tensor op goes through the backend (so the same code runs on
// CUDA and on the CPU) and every split over ranks through kiln::tensor_parallel's layers (the
// model calls no collective).
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "kiln/engine/world.hpp"
#include "kiln/model/config.hpp"
#include "kiln/model/model_base.hpp"
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

class GptModel : public ModelBase {
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
  void allocate_activations() override;
  // The logits buffer, unused while the blocks run (see nn::BlockScratch), less the blocks' backward
  // scratch where that lives in it.
  nn::BlockScratch block_scratch() const override { return lent_; }
  std::size_t activation_bytes() const override {
    return arena_.bytes() + (grads_in_logits_ ? 0 : block_grads_.bytes());
  }
  // One micro-batch forward; the per-token losses go to loss slot `slot`. With `training`, draws
  // dropout masks from the tracker and prepares the backward (the logits become dlogits). Dropout
  // masks are functions of the step and of the token's place in the step's global batch
  // (train::Batch::global_index): every micro-batch draws from the states the step's first one
  // started from, each element at its global index, so any split of the batch over data-parallel
  // ranks and micro-batches draws what one rank with the whole batch would.
  void forward(const train::Batch& batch, int slot, bool training, rng::RngStatesTracker* tracker) override;
  // Backward of the last training forward; accumulates into the gradient buffer.
  void backward(const train::Batch& batch) override;
  // Model FLOPs per trained token (see docs/PERF.md for the formula).
  double flops_per_token() const override;

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
  // The block's norm (LayerNorm, or RMSNorm for llama: no mean, no bias) of this rank's rows of x
  // into `out`, the input of a column-parallel linear: under sequence parallelism written to the
  // local scratch, which the linear gathers into `out`. Returns what the linear gathers from.
  TensorView norm_local(const TensorView& out, const TensorView& mean, const TensorView& rstd, const TensorView& x,
                        const TensorView& w, const TensorView& b);
  // The norm's backward: dx accumulated into the residual stream's gradient.
  void norm_backward(const TensorView& dx, const TensorView& dw, const TensorView& db, const TensorView& dout,
                     const TensorView& x, const TensorView& w, const TensorView& mean, const TensorView& rstd);
  // Rotary embeddings on a block's fused QKV ([B, T, Hl + 2 Kl, D]): its query and key heads.
  void rope(const TensorView& qkv, bool inverse);
  // The attention ops' view of the fused QKV: [B, T, 3, Hl, D] for multi-head attention (GPT-2, and
  // Llama with as many key/value heads as query heads, the same memory), else [B, T, Hl + 2 Kl, D].
  TensorView attention_qkv(const TensorView& qkv) const;
  int attention_kv_heads() const { return Kl_ == Hl_ ? 0 : Kl_; }
  // The linear computes its LayerNorm input itself (LinearImpl::takes_layernorm_input), forward and
  // backward, so the model neither writes nor recomputes that output: where the output is not
  // stored anyway (recompute_norm) and not gathered over the TP group (sequence parallelism).
  bool layernorm_on_load(Entity linear) const;
  BlockWeights block_weights(int l, bool grads) const;

  int C_, H_, K_, F_, Vp_, L_;  // width, query heads, key/value heads, MLP hidden width, padded vocabulary, blocks
  bool llama_;                  // model.arch = "llama" (see ModelConfig)
  int Hl_ = 0, Kl_ = 0;         // this rank's query and key/value heads
  int head_begin_ = 0;
  // The layers: shapes and splits (the weights come with each call), one of each kind for every block.
  parallel::VocabParallelEmbedding embedding_;
  parallel::ColumnParallelLinear qkv_, mlp_in_, lm_head_;
  parallel::RowParallelLinear attn_out_, mlp_out_;
  parallel::VocabParallelCrossEntropy loss_;
  Entity wte_ = kNoParam, wpe_ = kNoParam, lnf_w_ = kNoParam, lnf_b_ = kNoParam, head_w_ = kNoParam;
  std::vector<std::array<Entity, 12>> block_params_;
  std::vector<BlockLinears> block_linears_;
  Entity lm_head_entity_{};

  std::vector<TensorView> res_;  // L+1 residual streams: res_[l] is block l's input
  std::vector<BlockActs> acts_;
  std::vector<BlockPlan> plan_;
  BlockActs shared_acts_;             // the recomputed activations of every recomputing block
  std::vector<TensorView> res_saved_;  // distributed saved inputs: this rank's rows of res_[l]
  TensorView res_pingpong_[2];        // full-width inputs of blocks whose saved input is distributed
  bool recompute_ln_ = false, recompute_gelu_ = false;  // the backward pass refills LayerNorm / GELU outputs
  // FC2's implementation computes the GELU (SwiGLU) of FC1's output itself: no GELU (SwiGLU) output
  // is stored, recomputed or even written.
  bool act_in_fc2_ = false;
  TensorView lnf_, lnf_mean_, lnf_rstd_, logits_, scratch_c_;
  TensorView local_c_, full_c_;  // SP: [Nl, C] and [N, C] scratch (both scratch_c_ without SP)
  TensorView ln_shared_, fc_shared_;  // recompute_norm / recompute_gelu: the blocks' LayerNorm and GELU outputs
  // backward scratch
  TensorView dres_, dtmp_, datty_, dln_, dqkv_, dfc_;
  TensorView dact_;  // llama: FC2's input gradient (the SwiGLU output's), [N, F / tp]
  // The blocks' backward scratch (dtmp_, datty_, dqkv_, dfc_, dact_): placed at the end of the
  // logits buffer when it fits there beside what the blocks' linears may borrow, else its own.
  Arena block_grads_;
  nn::BlockScratch lent_;
  bool grads_in_logits_ = false;
  void place_block_grads(std::int64_t N, std::int64_t fc_pre_cols, std::int64_t fc_cols);
};

}  // namespace kiln::model
