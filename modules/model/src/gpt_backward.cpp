// GptModel::backward: the forward in reverse, one layer at a time.
#include <cmath>

#include "kiln/core/error.hpp"
#include "kiln/model/gpt.hpp"
#include "kiln/ops/linear_impl.hpp"

namespace kiln::model {

void GptModel::backward(const train::Batch& batch) {
  KILN_CHECK(have_forward_, "backward without a training forward");
  have_forward_ = false;
  const std::int64_t N = N_;
  const float p = cfg_.dropout;
  const int D = C_ / H_;
  const bool sp = tp_.sequence_parallel();
  auto& bus = world_.events();
  // The residual-stream gradient dres_ holds this rank's rows (all of them without sequence
  // parallelism). Row-parallel layers gather it into full_c_ (under SP); column-parallel layers sum
  // their partial input gradients dln_ over TP into dln_local.
  const TensorView dln_local = sp ? local_c_ : dln_;

  // LM head (tied to wte) and the final LayerNorm. The loss already left dlogits in logits_.
  bus.publish(LayerBackwardBegin{L_ + 1});
  const TensorView dlnf = lm_head_.backward(
      impl(lm_head_entity_),
      backward_args(lm_head_entity_, {dln_, tensor(head_w_, true), {}, logits_, lnf_, tensor(head_w_, false), {}}),
      dln_local);
  be_.zero(dres_);
  norm_backward(dres_, tensor(lnf_w_, true), tensor(lnf_b_, true), dlnf, res_[L_], tensor(lnf_w_, false), lnf_mean_,
                lnf_rstd_);
  bus.publish(LayerBackwardEnd{L_ + 1});

  for (int l = L_ - 1; l >= 0; --l) {
    bus.publish(LayerBackwardBegin{l + 1});
    recompute_block(l);  // activation checkpointing: refill what the forward pass did not keep
    auto w = block_weights(l, false);
    auto g = block_weights(l, true);
    auto& a = acts_[static_cast<std::size_t>(l)];
    const BlockLinears& lin = block_linears_[static_cast<std::size_t>(l)];
    // MLP branch: res[l+1] = res2 + dropout(fc_proj(gelu(fc(ln2(res2))))) (llama: swiglu, rmsnorm)
    TensorView dmlp = dres_;
    if (p > 0) {
      be_.dropout_backward({dtmp_, dres_, hidden_dropout(p, a.mlp_drop_rng)});
      dmlp = dtmp_;
    }
    // The LayerNorm outputs FC1 and QKV read for their weight gradients: recomputed (and gathered
    // over TP under SP), or computed by the layer itself as it reads them (layernorm_on_load).
    const bool ln2_on_load = layernorm_on_load(lin.mlp_in), ln1_on_load = layernorm_on_load(lin.qkv);
    if (recompute_ln_ && !ln2_on_load)
      tp_.enter(a.ln2, norm_local(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, w.ln2_w, w.ln2_b));
    if (recompute_gelu_) {
      if (llama_)
        be_.swiglu_forward({a.fc, a.fc_pre});
      else
        be_.gelu_forward({a.fc, a.fc_pre});
    }
    // FC2's input gradient through the GELU: in FC2's data-gradient GEMM, or, where FC1's
    // implementation takes it (LinearImpl::fuses_dout_gelu), in FC1's pass over its output gradient.
    const auto* fc_impl = world_.try_get<ops::LinearImpl>(lin.mlp_in);
    const bool defer_dgelu = !llama_ && fc_impl && fc_impl->fuses_dout_gelu;
    // Llama: FC2's input gradient is the SwiGLU output's (dact_), whose backward gives FC1's.
    ops::LinearBackward fc2{llama_ ? dact_ : dfc_, g.fcp_w, g.fcp_b, full_c_, a.fc, w.fcp_w,
                            defer_dgelu || llama_ ? TensorView{} : a.fc_pre};
    if (act_in_fc2_) (llama_ ? fc2.x_swiglu_pre : fc2.x_gelu_pre) = a.fc_pre;
    mlp_out_.backward(impl(lin.mlp_out), backward_args(lin.mlp_out, fc2), dmlp);
    if (llama_) be_.swiglu_backward({dfc_, dact_, a.fc_pre});
    ops::LinearBackward fc1{dln_, g.fc_w, g.fc_b, dfc_, a.ln2, w.fc_w, {}, defer_dgelu ? a.fc_pre : TensorView{}};
    if (ln2_on_load) {
      fc1.x = {};
      fc1.x_ln = {a.res2, w.ln2_w, w.ln2_b, a.ln2_mean, a.ln2_rstd};
    }
    const TensorView dln2 = mlp_in_.backward(impl(lin.mlp_in), backward_args(lin.mlp_in, fc1), dln_local);
    norm_backward(dres_, g.ln2_w, g.ln2_b, dln2, a.res2, w.ln2_w, a.ln2_mean, a.ln2_rstd);
    // Attention branch: res2 = res[l] + dropout(proj(attention(qkv(ln1(res[l])))))
    TensorView dproj = dres_;
    if (p > 0) {
      be_.dropout_backward({dtmp_, dres_, hidden_dropout(p, a.attn_drop_rng)});
      dproj = dtmp_;
    }
    attn_out_.backward(impl(lin.attn_out),
                       backward_args(lin.attn_out, {datty_, g.proj_w, g.proj_b, full_c_,
                                                    a.atty.reshape({N, attn_out_.local_in()}), w.proj_w, {}}),
                       dproj);
    const TensorView dqkv = dqkv_.reshape(a.qkv.shape);
    be_.attention_backward({attention_qkv(dqkv), datty_.reshape({B_, T_, Hl_, D}), a.atty, a.lse, attention_qkv(a.qkv),
                            1.0f / std::sqrt(static_cast<float>(D)), p, a.attn_rng, head_begin_, H_, seq_offset_,
                            attention_kv_heads()});
    if (llama_) rope(dqkv, true);  // the rotation's backward is the inverse rotation
    if (recompute_ln_ && !ln1_on_load)
      tp_.enter(a.ln1, norm_local(a.ln1, a.ln1_mean, a.ln1_rstd, res_[l], w.ln1_w, w.ln1_b));
    ops::LinearBackward qkv{dln_, g.qkv_w, g.qkv_b, dqkv_, a.ln1, w.qkv_w, {}};
    if (ln1_on_load) {
      qkv.x = {};
      qkv.x_ln = {res_[l], w.ln1_w, w.ln1_b, a.ln1_mean, a.ln1_rstd};
    }
    const TensorView dln1 = qkv_.backward(impl(lin.qkv), backward_args(lin.qkv, qkv), dln_local);
    norm_backward(dres_, g.ln1_w, g.ln1_b, dln1, res_[l], w.ln1_w, a.ln1_mean, a.ln1_rstd);
    bus.publish(LayerBackwardEnd{l + 1});
  }

  bus.publish(LayerBackwardBegin{0});
  embedding_.backward({tensor(wte_, true), tensor(wpe_, true), full_c_, tokens_, batch.inputs.data(), T_}, dres_);
  bus.publish(LayerBackwardEnd{0});
}

}  // namespace kiln::model
