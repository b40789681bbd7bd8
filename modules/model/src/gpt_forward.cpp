// GptModel::forward and evaluation.
#include <cmath>

#include "kiln/core/error.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/model/gpt.hpp"

namespace kiln::model {

void GptModel::forward(const train::Batch& batch, int slot, bool training, rng::RngStatesTracker* tracker) {
  const float p = begin_forward(batch, slot, training, tracker);
  auto& bus = world_.events();

  // The embeddings: every rank looks up all rows and keeps its own (sequence parallelism), or its
  // vocabulary rows' part of all, summed over TP (vocabulary parallelism).
  bus.publish(LayerForwardBegin{0});
  ops::EmbeddingForward emb{full_c_, tokens_, tensor(wte_, false), tensor(wpe_, false), T_};
  emb.positions = !llama_;  // Llama's positions are rotary, in every block's attention
  embedding_.forward(emb, res_[0]);
  bus.publish(LayerForwardEnd{0});

  for (int l = 0; l < L_; ++l) {
    bus.publish(LayerForwardBegin{l + 1});
    block_forward(l, p, tracker, kAllStages);
    const auto& plan = plan_[static_cast<std::size_t>(l)];
    if (training && plan.distribute)  // keep this rank's rows of the input only (see recompute_block)
      be_.copy(res_saved_[static_cast<std::size_t>(l)], tp_.row_part(res_[static_cast<std::size_t>(l)]));
    bus.publish(LayerForwardEnd{l + 1});
  }

  bus.publish(LayerForwardBegin{L_ + 1});
  const TensorView lnf_local = norm_local(lnf_, lnf_mean_, lnf_rstd_, res_[L_], tensor(lnf_w_, false),
                                          tensor(lnf_b_, false));
  lm_head_.forward(impl(lm_head_entity_), {logits_, {}, lnf_, tensor(head_w_, false), {}}, lnf_local);
  loss_.forward(losses_.rows(slot, 1).reshape({N_}), logits_, targets_, dloss_);
  bus.publish(LayerForwardEnd{L_ + 1});
  have_forward_ = training;
}

void GptModel::block_forward(int l, float p, rng::RngStatesTracker* tracker, unsigned stages) {
  const std::int64_t N = static_cast<std::int64_t>(B_) * T_;
  const int D = C_ / H_;
  auto w = block_weights(l, false);
  auto& a = acts_[static_cast<std::size_t>(l)];
  const BlockLinears& lin = block_linears_[static_cast<std::size_t>(l)];
  // Dropout draws, always all three, so a recompute that replays the tracker's states gets the
  // original masks: attention probabilities are sharded by heads under tensor parallelism, so they
  // come from the model-parallel state; the hidden outputs are replicated and use the default one.
  a.attn_rng = a.attn_drop_rng = a.mlp_drop_rng = rng::PhiloxArgs{};
  if (p > 0) {
    KILN_CHECK(tracker, "dropout needs the RNG tracker");
    {
      auto scope = tracker->fork(rng::kModelParallelRng);
      a.attn_rng = tracker->draw(static_cast<std::uint64_t>(batch_sequences_) * H_ * T_ * T_);
    }
    a.attn_drop_rng = tracker->draw(static_cast<std::uint64_t>(batch_sequences_) * T_ * C_);
    a.mlp_drop_rng = tracker->draw(static_cast<std::uint64_t>(batch_sequences_) * T_ * C_);
  }
  if (stages & kAttention) {
    // LayerNorm on this rank's rows, the column-parallel QKV on all rows; attention on this rank's
    // heads (global head index for dropout).
    ops::LinearForward qkv{a.qkv.reshape({N, qkv_.local_out()}), {}, a.ln1, w.qkv_w, w.qkv_b};
    TensorView ln1_local;
    if (layernorm_on_load(lin.qkv)) {
      qkv.x = {};
      qkv.x_ln = {res_[l], w.ln1_w, w.ln1_b, a.ln1_mean, a.ln1_rstd, cfg_.norm_eps};
    } else {
      ln1_local = norm_local(a.ln1, a.ln1_mean, a.ln1_rstd, res_[l], w.ln1_w, w.ln1_b);
    }
    qkv_.forward(impl(lin.qkv), qkv, ln1_local);
    if (llama_) rope(a.qkv, false);
    be_.attention_forward({a.atty, a.lse, attention_qkv(a.qkv), 1.0f / std::sqrt(static_cast<float>(D)), p, a.attn_rng,
                           head_begin_, H_, seq_offset_, attention_kv_heads()});
  }
  if (stages & kAttnOut) {
    // The row-parallel projection, summed over TP into this rank's rows, then dropout + residual.
    attn_out_.forward(impl(lin.attn_out), {scratch_c_, {}, a.atty.reshape({N, attn_out_.local_in()}), w.proj_w, w.proj_b},
                      local_c_);
    be_.residual_forward({a.res2, res_[l], local_c_, hidden_dropout(p, a.attn_drop_rng)});
  }
  if (stages & kMlpIn) {
    // FC1 writes the pre-activation where FC2 applies the GELU as it reads it; SwiGLU (llama) runs
    // on FC1's [gate | up] output after it.
    ops::LinearForward fc1 = act_in_fc2_ || llama_ ? ops::LinearForward{a.fc_pre, {}, a.ln2, w.fc_w, w.fc_b}
                                                    : ops::LinearForward{a.fc, a.fc_pre, a.ln2, w.fc_w, w.fc_b};
    TensorView ln2_local;
    if (layernorm_on_load(lin.mlp_in)) {
      fc1.x = {};
      fc1.x_ln = {a.res2, w.ln2_w, w.ln2_b, a.ln2_mean, a.ln2_rstd, cfg_.norm_eps};
    } else {
      ln2_local = norm_local(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, w.ln2_w, w.ln2_b);
    }
    mlp_in_.forward(impl(lin.mlp_in), fc1, ln2_local);
    if (llama_ && !act_in_fc2_) be_.swiglu_forward({a.fc, a.fc_pre});
  }
  if (stages & kMlpOut) {
    ops::LinearForward fc2{scratch_c_, {}, a.fc, w.fcp_w, w.fcp_b};
    if (act_in_fc2_) (llama_ ? fc2.x_swiglu_pre : fc2.x_gelu_pre) = a.fc_pre;
    mlp_out_.forward(impl(lin.mlp_out), fc2, local_c_);
    be_.residual_forward({res_[l + 1], a.res2, local_c_, hidden_dropout(p, a.mlp_drop_rng)});
  }
}

TensorView GptModel::norm_local(const TensorView& out, const TensorView& mean, const TensorView& rstd,
                                const TensorView& x, const TensorView& w, const TensorView& b) {
  const TensorView local = tp_.sequence_parallel() ? local_c_ : out;
  if (llama_)
    be_.rmsnorm_forward({local, rstd, x, w, cfg_.norm_eps});
  else
    be_.layernorm_forward({local, mean, rstd, x, w, b, cfg_.norm_eps});
  return local;
}

void GptModel::norm_backward(const TensorView& dx, const TensorView& dw, const TensorView& db, const TensorView& dout,
                             const TensorView& x, const TensorView& w, const TensorView& mean,
                             const TensorView& rstd) {
  if (llama_)
    be_.rmsnorm_backward({dx, dw, dout, x, w, rstd});
  else
    be_.layernorm_backward({dx, dw, db, dout, x, w, mean, rstd});
}

void GptModel::rope(const TensorView& qkv, bool inverse) {
  // Positions count from each sequence's start (the micro-batch holds whole sequences).
  be_.rope({qkv, Hl_ + Kl_, cfg_.rope_theta, 0, inverse});
}

TensorView GptModel::attention_qkv(const TensorView& qkv) const {
  if (!llama_ || attention_kv_heads() != 0) return qkv;
  return qkv.reshape({B_, T_, 3, Hl_, C_ / H_});
}

void GptModel::recompute_block(int l) {
  const auto& plan = plan_[static_cast<std::size_t>(l)];
  if (plan.scope == nn::RecomputeScope::none) return;
  auto& bus = world_.events();
  // Listeners set the RNG tracker back to the states this block's forward started from, and FP8
  // layers reuse their forward scales.
  bus.publish(LayerRecomputeBegin{l + 1});
  if (plan.distribute) tp_.gather_row_parts(res_[static_cast<std::size_t>(l)], res_saved_[static_cast<std::size_t>(l)]);
  // The block's output (FC2 and the second residual) is never needed again: the next block's saved
  // input is that output, and the backward pass reads only the block's inner activations.
  const unsigned stages = plan.scope == nn::RecomputeScope::attention ? kAttention
                          : plan.scope == nn::RecomputeScope::mlp     ? kMlpIn
                                                                      : kAttention | kAttnOut | kMlpIn;
  block_forward(l, cfg_.dropout, world_.try_resource<rng::RngStatesTracker>(), stages);
  bus.publish(LayerRecomputeEnd{l + 1});
}

}  // namespace kiln::model
