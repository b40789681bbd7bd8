#pragma once
// Causal self-attention: the fused QKV projection (column-parallel, each of q, k and v split by
// heads), rotary position embeddings on the queries and keys where the spec has them, the attention
// core on this rank's heads (grouped-query where there are fewer key/value heads than query heads),
// and the output projection (row-parallel). Dropout on the attention probabilities draws from the
// model-parallel RNG state by global head index, so a TP shard draws what one rank would.
#include <optional>

#include "kiln/model/parts/linear.hpp"
#include "kiln/model/parts/mixer.hpp"

namespace kiln::model {

// Rotary position embeddings (Llama's rotate_half layout) on the query and key heads of the fused
// QKV, in place; the backward pass is the inverse rotation of their gradient.
struct RotaryEmbedding {
  float theta = 10000.0f;
  ops::RopeScaling scaling = {};
};

struct AttentionOptions {
  int heads = 0;     // query heads (all ranks)
  int kv_heads = 0;  // key/value heads (all ranks), dividing `heads`
  bool bias = true;  // QKV and output projection biases
  std::optional<RotaryEmbedding> rope;
  float init_std = 0.02f, proj_init_std = 0.02f;
};

class CausalSelfAttention final : public Mixer {
 public:
  CausalSelfAttention(LayerBuilder& b, const AttentionOptions& o);

  Entity input_linear() const override { return qkv_.entity(); }
  void declare(ActivationTable::Rows& rows, const std::string& key, StageSet stage) override;
  void draw(rng::RngStatesTracker* tracker, float p) override;
  void forward_in(const NormOutput& x, float p) override;
  void forward_out(const TensorView& out_local) override;
  TensorView backward(const TensorView& dout_local, const ops::LinearInput& x, const TensorView& dx_local,
                      float p) override;
  std::size_t scratch_bytes() const override;
  double flops_per_token() const override;

 private:
  // The attention ops' view of the fused QKV [B, T, Hl + 2 Kl, D]: [B, T, 3, Hl, D] with as many
  // key/value heads as query heads (multi-head attention, where cuDNN's kernels apply), else as it is.
  TensorView heads_view(const TensorView& qkv) const;
  int kv_heads_arg() const { return Kl_ == Hl_ ? 0 : Kl_; }
  float scale() const;
  void rotate(const TensorView& qkv, bool inverse) const;

  ModelContext& ctx_;
  AttentionOptions o_;
  int D_, Hl_, Kl_, head_begin_;  // head dimension, this rank's query and key/value heads, its first head
  ColumnLinear qkv_;
  RowLinear proj_;
  // Saved: the fused projection's output [B, T, Hl + 2 Kl, D] (this rank's query heads, then its
  // key and value heads), the attention's output before the projection [B, T, Hl, D] (Megatron's
  // context layer), the softmax statistic [B, Hl, T] f32.
  TensorView qkv_out_, context_, lse_;
  TensorView dqkv_, dcontext_;  // backward scratch: their gradients, [N, (Hl + 2 Kl) D] and [N, Hl D]
  rng::PhiloxArgs probs_rng_;       // this forward's attention-probability dropout
};

}  // namespace kiln::model
