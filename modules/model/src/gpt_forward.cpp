// GptModel::forward and evaluation.
#include <cmath>

#include "kiln/core/error.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/model/gpt.hpp"

namespace kiln::model {

void GptModel::forward(const train::Batch& batch, int slot, bool training, rng::RngStatesTracker* tracker) {
  KILN_CHECK(batch.B == B_ && batch.T == T_, "batch of ", batch.B, "x", batch.T, " but the model was built for ", B_,
             "x", T_);
  KILN_CHECK(allocated_, "forward before allocate_activations()");
  KILN_CHECK(slot >= 0 && slot < slots_, "loss slot ", slot, " of ", slots_);
  const std::int64_t N = static_cast<std::int64_t>(B_) * T_;
  for (std::int64_t n = 0; n < N; ++n) {
    if (batch.inputs[n] < 0 || batch.inputs[n] >= cfg_.vocab_size)
      KILN_THROW("input token ", batch.inputs[n], " at position ", n, " is outside model.vocab_size = ", cfg_.vocab_size);
    if (batch.targets[n] < -1 || batch.targets[n] >= cfg_.vocab_size)
      KILN_THROW("target token ", batch.targets[n], " at position ", n, " is outside model.vocab_size = ",
                 cfg_.vocab_size);
  }
  be_.copy(tokens_, TensorView(const_cast<std::int32_t*>(batch.inputs.data()), {N}, DType::i32, Device::cpu));
  be_.copy(targets_, TensorView(const_cast<std::int32_t*>(batch.targets.data()), {N}, DType::i32, Device::cpu));

  auto& bus = world_.events();
  const float p = training ? cfg_.dropout : 0.0f;

  // The embeddings: every rank computes all rows and keeps its own (SP). With vocabulary
  // parallelism each rank looks up the tokens of its rows (zeros for the others; the positions on
  // TP rank 0 only) and the sum over TP (all-reduce, or reduce-scatter under SP) is the lookup.
  bus.publish(LayerForwardBegin{0});
  const TensorView emb = sp_ ? full_c_ : res_[0];
  be_.embedding_forward({emb, tokens_, tensor(wte_, false), tensor(wpe_, false), T_, vocab_begin_, Vp_,
                         !vp_ || tp_rank_ == 0});
  if (vp_)
    reduce_rows(res_[0], emb);
  else if (sp_)
    be_.copy(res_[0], my_rows(full_c_));
  bus.publish(LayerForwardEnd{0});

  for (int l = 0; l < L_; ++l) {
    bus.publish(LayerForwardBegin{l + 1});
    block_forward(l, p, tracker, kAllStages);
    const auto& plan = plan_[static_cast<std::size_t>(l)];
    if (training && plan.distribute)  // keep this rank's rows of the input only (see recompute_block)
      be_.copy(res_saved_[static_cast<std::size_t>(l)], res_[static_cast<std::size_t>(l)].rows(tp_rank_ * (N / tp_), N / tp_));
    bus.publish(LayerForwardEnd{l + 1});
  }

  bus.publish(LayerForwardBegin{L_ + 1});
  be_.layernorm_forward({sp_ ? local_c_ : lnf_, lnf_mean_, lnf_rstd_, res_[L_], tensor(lnf_w_, false),
                         tensor(lnf_b_, false), cfg_.ln_eps});
  gather_rows(lnf_, sp_ ? local_c_ : lnf_);
  linear_forward(lm_head_, {logits_, {}, lnf_, tensor(wte_, false), {}});
  const TensorView losses = losses_.rows(slot, 1).reshape({N});
  if (vp_) {  // this rank's columns: statistics, one all-gather of them, then loss and dlogits
    be_.cross_entropy_stats({ce_stats_, logits_, targets_, vocab_begin_, cfg_.vocab_size});
    tp_comm_->all_gather(ce_all_stats_.reshape({tp_ * N * 3}), ce_stats_.reshape({N * 3}), be_.stream());
    be_.cross_entropy_finish({losses, logits_, targets_, ce_all_stats_, vocab_begin_, cfg_.vocab_size, dloss_});
  } else {
    be_.cross_entropy({losses, logits_, targets_, cfg_.vocab_size, dloss_});
  }
  bus.publish(LayerForwardEnd{L_ + 1});
  have_forward_ = training;
}

void GptModel::block_forward(int l, float p, rng::RngStatesTracker* tracker, unsigned stages) {
  const std::int64_t N = static_cast<std::int64_t>(B_) * T_;
  const int D = C_ / H_;
  auto w = block_weights(l, false);
  auto& a = acts_[static_cast<std::size_t>(l)];
  const auto& lin = block_linears_[static_cast<std::size_t>(l)];
  // Dropout draws, always all three, so a recompute that replays the tracker's states gets the
  // original masks: attention probabilities are sharded by heads under tensor parallelism, so they
  // come from the model-parallel state; the hidden outputs are replicated and use the default one.
  a.attn_rng = a.attn_drop_rng = a.mlp_drop_rng = rng::PhiloxArgs{};
  if (p > 0) {
    KILN_CHECK(tracker, "dropout needs the RNG tracker");
    {
      auto scope = tracker->fork(rng::kModelParallelRng);
      a.attn_rng = tracker->draw(static_cast<std::uint64_t>(B_) * H_ * T_ * T_);
    }
    a.attn_drop_rng = tracker->draw(static_cast<std::uint64_t>(N) * C_);
    a.mlp_drop_rng = tracker->draw(static_cast<std::uint64_t>(N) * C_);
  }
  if (stages & kAttention) {
    // LayerNorm on this rank's rows, gathered for the column-parallel QKV; attention on this rank's
    // heads (global head index for dropout).
    ops::LinearForward qkv{a.qkv.reshape({N, 3 * C_ / tp_}), {}, a.ln1, w.qkv_w, w.qkv_b};
    if (layernorm_on_load(lin[0])) {
      qkv.x = {};
      qkv.x_ln = {res_[l], w.ln1_w, w.ln1_b, a.ln1_mean, a.ln1_rstd, cfg_.ln_eps};
    } else {
      be_.layernorm_forward({sp_ ? local_c_ : a.ln1, a.ln1_mean, a.ln1_rstd, res_[l], w.ln1_w, w.ln1_b, cfg_.ln_eps});
      gather_rows(a.ln1, sp_ ? local_c_ : a.ln1);
    }
    linear_forward(lin[0], qkv);
    be_.attention_forward({a.atty, a.lse, a.qkv, 1.0f / std::sqrt(static_cast<float>(D)), p, a.attn_rng,
                           tp_rank_ * Hl_, H_});
  }
  if (stages & kAttnOut) {
    // Row-parallel projection: partial sums, the bias added once (on TP rank 0), then summed over
    // TP (all-reduce, or reduce-scatter to this rank's rows under SP).
    linear_forward(lin[1], {scratch_c_, {}, a.atty.reshape({N, C_ / tp_}), w.proj_w, row_parallel_bias(w.proj_b)});
    reduce_rows(local_c_, scratch_c_);
    be_.residual_forward({a.res2, res_[l], local_c_, hidden_dropout(p, a.attn_drop_rng)});
  }
  if (stages & kMlpIn) {
    // FC1 writes the pre-activation where FC2 applies the GELU as it reads it.
    ops::LinearForward fc1 = gelu_in_fc2_ ? ops::LinearForward{a.fc_pre, {}, a.ln2, w.fc_w, w.fc_b}
                                          : ops::LinearForward{a.fc, a.fc_pre, a.ln2, w.fc_w, w.fc_b};
    if (layernorm_on_load(lin[2])) {
      fc1.x = {};
      fc1.x_ln = {a.res2, w.ln2_w, w.ln2_b, a.ln2_mean, a.ln2_rstd, cfg_.ln_eps};
    } else {
      be_.layernorm_forward({sp_ ? local_c_ : a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, w.ln2_w, w.ln2_b, cfg_.ln_eps});
      gather_rows(a.ln2, sp_ ? local_c_ : a.ln2);
    }
    linear_forward(lin[2], fc1);
  }
  if (stages & kMlpOut) {
    ops::LinearForward fc2{scratch_c_, {}, a.fc, w.fcp_w, row_parallel_bias(w.fcp_b)};
    if (gelu_in_fc2_) fc2.x_gelu_pre = a.fc_pre;
    linear_forward(lin[3], fc2);
    reduce_rows(local_c_, scratch_c_);
    be_.residual_forward({res_[l + 1], a.res2, local_c_, hidden_dropout(p, a.mlp_drop_rng)});
  }
}

void GptModel::recompute_block(int l) {
  const auto& plan = plan_[static_cast<std::size_t>(l)];
  if (plan.scope == nn::RecomputeScope::none) return;
  auto& bus = world_.events();
  // Listeners set the RNG tracker back to the states this block's forward started from, and FP8
  // layers reuse their forward scales.
  bus.publish(LayerRecomputeBegin{l + 1});
  if (plan.distribute) tp_comm_->all_gather(res_[static_cast<std::size_t>(l)], res_saved_[static_cast<std::size_t>(l)], be_.stream());
  // The block's output (FC2 and the second residual) is never needed again: the next block's saved
  // input is that output, and the backward pass reads only the block's inner activations.
  const unsigned stages = plan.scope == nn::RecomputeScope::attention ? kAttention
                          : plan.scope == nn::RecomputeScope::mlp     ? kMlpIn
                                                                      : kAttention | kAttnOut | kMlpIn;
  block_forward(l, cfg_.dropout, world_.try_resource<rng::RngStatesTracker>(), stages);
  bus.publish(LayerRecomputeEnd{l + 1});
}

TensorView GptModel::row_parallel_bias(const TensorView& bias) const { return tp_rank_ == 0 ? bias : TensorView{}; }

void GptModel::tp_all_reduce(const TensorView& t) {
  if (tp_ > 1) tp_comm_->all_reduce(t, parallel::ReduceOp::sum, be_.stream());
}

void GptModel::gather_rows(const TensorView& full, const TensorView& local) {
  if (sp_)
    tp_comm_->all_gather(full, local, be_.stream());
  else
    KILN_CHECK(full.data == local.data, "gather_rows without sequence parallelism needs one tensor");
}

void GptModel::reduce_rows(const TensorView& local, const TensorView& full) {
  if (sp_) {
    tp_comm_->reduce_scatter(local, full, parallel::ReduceOp::sum, be_.stream());
    return;
  }
  KILN_CHECK(full.data == local.data, "reduce_rows without sequence parallelism needs one tensor");
  tp_all_reduce(full);
}

TensorView GptModel::my_rows(const TensorView& full) const {
  return sp_ ? full.rows(static_cast<std::int64_t>(tp_rank_) * Nl_, Nl_) : full;
}

double GptModel::mean_loss(int slots) {
  KILN_CHECK(slots > 0 && slots <= slots_, "mean over ", slots, " loss slots of ", slots_);
  const std::int64_t N = static_cast<std::int64_t>(B_) * T_;
  std::vector<float> host(static_cast<std::size_t>(slots * N));
  be_.copy(TensorView(host.data(), {slots * N}, DType::f32, Device::cpu), losses_.rows(0, slots).reshape({slots * N}));
  be_.synchronize();
  double sum = 0;
  for (float v : host) sum += v;
  double mean = sum / static_cast<double>(host.size());
  if (dp_comm_->size() > 1) {  // every DP rank saw a different slice of the global batch
    float m = static_cast<float>(mean);
    dp_comm_->all_reduce(TensorView(&m, {1}, DType::f32, Device::cpu), parallel::ReduceOp::avg, nullptr);
    mean = m;
  }
  return mean;
}

double GptModel::evaluate(const std::vector<train::Batch>& batches) {
  KILN_CHECK(!batches.empty(), "no validation batches");
  double total = 0;
  for (auto& b : batches) {
    forward(b, 0, false, nullptr);
    total += mean_loss(1);
  }
  return total / static_cast<double>(batches.size());
}

}  // namespace kiln::model
