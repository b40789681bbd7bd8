// GptModel::backward: the forward in reverse, one layer at a time.
#include <cmath>

#include "kiln/core/error.hpp"
#include "kiln/model/gpt.hpp"
#include "kiln/ops/linear_impl.hpp"

namespace kiln::model {

void GptModel::backward(const train::Batch& batch) {
  KILN_CHECK(have_forward_, "backward without a training forward");
  have_forward_ = false;
  const std::int64_t N = static_cast<std::int64_t>(B_) * T_;
  const float p = cfg_.dropout;
  const int D = C_ / H_;
  auto& bus = world_.events();
  // Under sequence parallelism the residual-stream gradient dres_ holds this rank's rows: it is
  // gathered before each row-parallel layer, and the column-parallel layers' input gradients are
  // reduce-scattered back (without SP: used as is, and all-reduced).
  const TensorView dln_local = sp_ ? local_c_ : dln_;

  // LM head (tied to wte) and the final LayerNorm. cross_entropy already left dlogits in logits_.
  bus.publish(LayerBackwardBegin{L_ + 1});
  linear_backward(lm_head_, {dln_, tensor(wte_, true), {}, logits_, lnf_, tensor(wte_, false), {}});
  if (vp_) reduce_rows(dln_local, dln_);  // each rank's vocabulary rows gave part of the input gradient
  be_.zero(dres_);
  be_.layernorm_backward({dres_, tensor(lnf_w_, true), tensor(lnf_b_, true), vp_ ? dln_local : my_rows(dln_),
                          res_[L_], tensor(lnf_w_, false), lnf_mean_, lnf_rstd_});
  bus.publish(LayerBackwardEnd{L_ + 1});

  for (int l = L_ - 1; l >= 0; --l) {
    bus.publish(LayerBackwardBegin{l + 1});
    recompute_block(l);  // activation checkpointing: refill what the forward pass did not keep
    auto w = block_weights(l, false);
    auto g = block_weights(l, true);
    auto& a = acts_[static_cast<std::size_t>(l)];
    const auto& lin = block_linears_[static_cast<std::size_t>(l)];
    // MLP branch: res[l+1] = res2 + dropout(fc_proj(gelu(fc(ln2(res2)))))
    TensorView dmlp = dres_;
    if (p > 0) {
      be_.dropout_backward({dtmp_, dres_, hidden_dropout(p, a.mlp_drop_rng)});
      dmlp = dtmp_;
    }
    if (sp_) {
      gather_rows(full_c_, dmlp);
      dmlp = full_c_;
    }
    // The LayerNorm outputs FC1 and QKV read for their weight gradients: recomputed, or computed by
    // the layer itself as it reads them (layernorm_on_load).
    const bool ln2_on_load = layernorm_on_load(lin[2]), ln1_on_load = layernorm_on_load(lin[0]);
    if (recompute_ln_ && !ln2_on_load) {
      be_.layernorm_forward({sp_ ? local_c_ : a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, w.ln2_w, w.ln2_b, cfg_.ln_eps});
      gather_rows(a.ln2, sp_ ? local_c_ : a.ln2);
    }
    if (recompute_gelu_) be_.gelu_forward({a.fc, a.fc_pre});
    // FC2's input gradient through the GELU: in FC2's data-gradient GEMM, or, where FC1's
    // implementation takes it (LinearImpl::fuses_dout_gelu), in FC1's pass over its output gradient.
    const auto* fc_impl = world_.try_get<ops::LinearImpl>(lin[2]);
    const bool defer_dgelu = fc_impl && fc_impl->fuses_dout_gelu;
    ops::LinearBackward fc2{dfc_, g.fcp_w, g.fcp_b, dmlp, a.fc, w.fcp_w, defer_dgelu ? TensorView{} : a.fc_pre};
    if (gelu_in_fc2_) fc2.x_gelu_pre = a.fc_pre;
    linear_backward(lin[3], fc2);
    ops::LinearBackward fc1{dln_, g.fc_w, g.fc_b, dfc_, a.ln2, w.fc_w, {}, defer_dgelu ? a.fc_pre : TensorView{}};
    if (ln2_on_load) {
      fc1.x = {};
      fc1.x_ln = {a.res2, w.ln2_w, w.ln2_b, a.ln2_mean, a.ln2_rstd};
    }
    linear_backward(lin[2], fc1);
    reduce_rows(dln_local, dln_);  // column-parallel FC1: each rank holds part of the input gradient
    be_.layernorm_backward({dres_, g.ln2_w, g.ln2_b, dln_local, a.res2, w.ln2_w, a.ln2_mean, a.ln2_rstd});
    // Attention branch: res2 = res[l] + dropout(proj(attention(qkv(ln1(res[l])))))
    TensorView dproj = dres_;
    if (p > 0) {
      be_.dropout_backward({dtmp_, dres_, hidden_dropout(p, a.attn_drop_rng)});
      dproj = dtmp_;
    }
    if (sp_) {
      gather_rows(full_c_, dproj);
      dproj = full_c_;
    }
    linear_backward(lin[1], {datty_, g.proj_w, g.proj_b, dproj, a.atty.reshape({N, C_ / tp_}), w.proj_w, {}});
    be_.attention_backward({dqkv_.reshape({B_, T_, 3, Hl_, D}), datty_.reshape({B_, T_, Hl_, D}), a.atty, a.lse, a.qkv,
                            1.0f / std::sqrt(static_cast<float>(D)), p, a.attn_rng, tp_rank_ * Hl_, H_});
    if (recompute_ln_ && !ln1_on_load) {
      be_.layernorm_forward({sp_ ? local_c_ : a.ln1, a.ln1_mean, a.ln1_rstd, res_[l], w.ln1_w, w.ln1_b, cfg_.ln_eps});
      gather_rows(a.ln1, sp_ ? local_c_ : a.ln1);
    }
    ops::LinearBackward qkv{dln_, g.qkv_w, g.qkv_b, dqkv_, a.ln1, w.qkv_w, {}};
    if (ln1_on_load) {
      qkv.x = {};
      qkv.x_ln = {res_[l], w.ln1_w, w.ln1_b, a.ln1_mean, a.ln1_rstd};
    }
    linear_backward(lin[0], qkv);
    reduce_rows(dln_local, dln_);  // column-parallel QKV likewise
    be_.layernorm_backward({dres_, g.ln1_w, g.ln1_b, dln_local, res_[l], w.ln1_w, a.ln1_mean, a.ln1_rstd});
    bus.publish(LayerBackwardEnd{l + 1});
  }

  bus.publish(LayerBackwardBegin{0});
  TensorView demb = dres_;
  if (sp_) {
    gather_rows(full_c_, dres_);
    demb = full_c_;
  }
  be_.embedding_backward({tensor(wte_, true), tensor(wpe_, true), demb, tokens_, batch.inputs.data(), T_, vocab_begin_,
                          Vp_});
  bus.publish(LayerBackwardEnd{0});
}

}  // namespace kiln::model
