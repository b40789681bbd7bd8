// Norm (what LayerNorm and RMSNorm share: where the output lives and how the consumer gets it),
// LayerNorm and RmsNorm.
#include "kiln/model/parts/norm.hpp"

#include "kiln/core/error.hpp"
#include "kiln/ops/linear_impl.hpp"

namespace kiln::model {

Norm::Norm(LayerBuilder& b, Output output) : ctx_(b.ctx()), output_kind_(output) {}

TensorView Norm::w(bool grad) const { return ctx_.param(weight_, grad); }
TensorView Norm::b(bool grad) const { return bias_ ? ctx_.param(*bias_, grad) : TensorView{}; }

void Norm::feed(Entity consumer) {
  consumer_ = consumer;
  // The consumer's input is stored for its backward alone where it is not recomputed: an
  // implementation keeping its own copy instead (LinearImpl::keeps_input) then saves that memory.
  if (output_kind_ == Output::per_config)
    ctx_.world.get<nn::Linear>(consumer).input_stored_for_backward = !ctx_.cfg.recompute_norm;
}

void Norm::declare(ActivationTable::Rows& rows, const std::string& key, StageSet stage) {
  declare_stats(rows, key, stage);
  const Shape shape{ctx_.N, ctx_.cfg.n_embd};  // the consumer's whole input
  saved_ = true;
  if (output_kind_ == Output::always_kept) {
    rows.saved(output_, key + ".output", ctx_.act(), shape, stage);
    return;
  }
  const auto* impl = ctx_.world.try_get<ops::LinearImpl>(consumer_);
  const bool kept_by_consumer = impl && impl->keeps_input;
  const std::optional<ops::Prologue> kind = prologue_kind();
  // The consumer computes the norm itself where it can: where the output would be recomputed anyway,
  // or where the consumer keeps its own copy of it (its forward then computes the norm on load once
  // and nothing is recomputed), and where it is not gathered over TP (the prologue reads this rank's
  // rows, which are all of them).
  on_load_ = (ctx_.cfg.recompute_norm || kept_by_consumer) && !ctx_.tp.sequence_parallel() && impl && kind &&
             impl->prologues.has(*kind);
  // Where the block's backward recomputes this stage anyway (activation checkpointing), the
  // recompute's output is kept until the consumer's backward instead of computed a third time.
  refill_ = ctx_.cfg.recompute_norm && !rows.recomputes(stage) && !kept_by_consumer && !on_load_;
  saved_ = !kept_by_consumer && !on_load_ && !refill_;
  if (saved_)
    rows.saved(output_, key + ".output", ctx_.act(), shape, stage);
  else  // recomputed for the backward, or read by the forward alone: one tensor for every norm
    rows.scratch(output_, "norm.output", ctx_.act(), shape);
}

ops::LinearInput Norm::prologue(const TensorView& x) const {
  KILN_THROW("this norm has no prologue (an ops::LinearImpl computing it on load); its input was ", x.str());
}

// Under sequence parallelism this rank's rows of the output (TensorParallel::local_part) are written
// where the gather puts them, so the gather moves the other ranks' rows only.
NormOutput Norm::forward(const TensorView& x) {
  if (on_load_) return {prologue(x), {}};
  const TensorView local = ctx_.tp.local_part(output_);
  run(local, x);
  return {output_, local, saved_};
}

ops::LinearInput Norm::backward_input(const TensorView& x) {
  if (on_load_) return prologue(x);
  if (refill_) {
    const TensorView local = ctx_.tp.local_part(output_);
    run(local, x);
    ctx_.tp.enter(output_, local);
  }
  return output_;
}

LayerNorm::LayerNorm(LayerBuilder& b, const std::string& name, Output output) : Norm(b, output) {
  weight_ = b.norm_param(b.prefix() + kStem + name + ".weight", 1.0f);
  bias_ = b.norm_param(b.prefix() + kStem + name + ".bias", 0.0f);
}

void LayerNorm::declare_stats(ActivationTable::Rows& rows, const std::string& key, StageSet stage) {
  rows.saved(mean_, key + ".mean", DType::f32, {ctx_.Nl}, stage);
  rows.saved(rstd_, key + ".rstd", DType::f32, {ctx_.Nl}, stage);
}

void LayerNorm::run(const TensorView& out, const TensorView& x) {
  ctx_.be.layernorm_forward({out, mean_, rstd_, x, w(false), b(false), ctx_.cfg.norm_eps});
}

ops::LinearInput LayerNorm::prologue(const TensorView& x) const {
  return ops::LayerNormOnLoad{x, w(false), b(false), mean_, rstd_, ctx_.cfg.norm_eps};
}

void LayerNorm::backward(const TensorView& dx, const TensorView& dout, const TensorView& x) {
  ctx_.be.layernorm_backward({dx, w(true), b(true), dout, x, w(false), mean_, rstd_});
}

RmsNorm::RmsNorm(LayerBuilder& b, const std::string& name, Output output) : Norm(b, output) {
  weight_ = b.norm_param(b.prefix() + kStem + name + ".weight", 1.0f);
}

void RmsNorm::declare_stats(ActivationTable::Rows& rows, const std::string& key, StageSet stage) {
  rows.saved(rstd_, key + ".rstd", DType::f32, {ctx_.Nl}, stage);
}

void RmsNorm::run(const TensorView& out, const TensorView& x) {
  ctx_.be.rmsnorm_forward({out, rstd_, x, w(false), ctx_.cfg.norm_eps});
}

void RmsNorm::backward(const TensorView& dx, const TensorView& dout, const TensorView& x) {
  ctx_.be.rmsnorm_backward({dx, w(true), dout, x, w(false), rstd_});
}

}  // namespace kiln::model
