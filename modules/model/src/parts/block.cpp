// Sublayer and TransformerBlock.
#include "kiln/model/parts/block.hpp"

#include <algorithm>

#include "kiln/core/error.hpp"
#include "kiln/model/spec.hpp"
#include "kiln/nn/events.hpp"

namespace kiln::model {

Sublayer::Sublayer(ModelContext& ctx, std::unique_ptr<Norm> norm, std::unique_ptr<Mixer> mixer, std::string key,
                   StageSet in, StageSet out)
    : ctx_(ctx), norm_(std::move(norm)), mixer_(std::move(mixer)), key_(std::move(key)), in_(in), out_(out) {
  norm_->feed(mixer_->input_linear());
}

void Sublayer::declare(ActivationTable::Rows& rows) {
  norm_->declare(rows, key_ + ".norm", in_);
  mixer_->declare(rows, key_, in_);
}

void Sublayer::draw(rng::RngStatesTracker* tracker, float p) {
  dropout_rng_ = {};
  KILN_CHECK(p <= 0 || tracker, "dropout needs the RNG tracker");
  mixer_->draw(tracker, p);
  // The hidden output is replicated over TP: the default state.
  if (p > 0) dropout_rng_ = tracker->draw(static_cast<std::uint64_t>(ctx_.batch_sequences) * ctx_.T * ctx_.cfg.n_embd);
}

void Sublayer::forward(StageSet stages, const TensorView& x, const TensorView& out, float p) {
  if (stages & in_) mixer_->forward_in(norm_->forward(x), p);
  if (stages & out_) {
    const TensorView& y = ctx_.stream.local;  // the mixer's output, summed over TP into this rank's rows
    mixer_->forward_out(y);
    ctx_.be.residual_forward({out, x, y, ctx_.hidden_dropout(p, dropout_rng_)});
  }
}

void Sublayer::backward(const TensorView& x, float p) {
  const StreamTensors& s = ctx_.stream;
  TensorView dy = s.dres;
  if (p > 0) {
    ctx_.be.dropout_backward({s.ddrop, s.dres, ctx_.hidden_dropout(p, dropout_rng_)});
    dy = s.ddrop;
  }
  const ops::LinearInput input = norm_->backward_input(x);
  const TensorView dnorm = mixer_->backward(dy, input, s.col_dx_local(ctx_.tp.sequence_parallel()), p);
  norm_->backward(s.dres, dnorm, x);
}

namespace {
Sublayer attention_sublayer(LayerBuilder& b, const ModelSpec& spec) {
  auto norm = spec.make_norm(b, "1", Norm::Output::per_config);  // made first: the parameters' order
  return Sublayer(b.ctx(), std::move(norm), spec.make_attention(b), "attention", kAttentionIn, kAttentionOut);
}
Sublayer mlp_sublayer(LayerBuilder& b, int block, const ModelSpec& spec) {
  auto norm = spec.make_norm(b, "2", Norm::Output::per_config);
  return Sublayer(b.ctx(), std::move(norm), spec.make_mlp(b, block), "mlp", kMlpIn, kMlpOut);
}

// What a block's backward pass recomputes for each recompute scope.
StageSet recomputed_stages(nn::RecomputeScope scope) {
  switch (scope) {
    case nn::RecomputeScope::none: return 0;
    case nn::RecomputeScope::attention: return kAttentionIn;
    case nn::RecomputeScope::mlp: return kMlpIn;
    case nn::RecomputeScope::full: return kAttentionIn | kAttentionOut | kMlpIn;
  }
  return 0;
}
}  // namespace

TransformerBlock::TransformerBlock(LayerBuilder b, int index, const ModelSpec& spec)
    : ctx_(b.ctx()),
      index_(index),
      layer_(b.layer()),
      attention_(attention_sublayer(b, spec)),
      mlp_(mlp_sublayer(b, index, spec)) {}

void TransformerBlock::declare(ActivationTable& table) {
  if (const auto* r = ctx_.world.try_get<nn::ActivationRecompute>(layer_)) {
    recomputed_ = recomputed_stages(r->scope);
    distribute_ = recomputed_ != 0 && r->distribute_input;  // the recompute module decided it applies (tp > 1)
  }
  KILN_CHECK(!distribute_ || !ctx_.tp.sequence_parallel(), "block ", index_,
             ": distributed saved inputs need sequence parallelism off");
  if (distribute_) ctx_.tp.require({ctx_.N, cat("block ", index_, "'s saved input"), "token rows"});
  int offload_slot = -1;
  if (const auto* o = ctx_.world.try_get<nn::ActivationOffload>(layer_)) {
    KILN_CHECK(recomputed_ == 0, "block ", index_, " is both recomputed and offloaded (the activation_offload module "
               "takes its blocks out of activation checkpointing)");
    offload_slot = o->slot;
  }
  auto rows = table.block(recomputed_, offload_slot);
  if (distribute_) rows.kept(input_part_, ctx_.act(), {ctx_.N / ctx_.tp.size(), ctx_.cfg.n_embd});
  attention_.declare(rows);
  rows.saved(mid_, "block.mid", ctx_.act(), {ctx_.Nl, ctx_.cfg.n_embd}, kAttentionOut);
  mlp_.declare(rows);
}

void TransformerBlock::placed(const ActivationTable& table) {
  if (auto* o = ctx_.world.try_get<nn::ActivationOffload>(layer_)) o->region = table.offload_region(o->slot);
}

void TransformerBlock::run(StageSet stages, const TensorView& x, const TensorView& out, float p,
                           rng::RngStatesTracker* tracker) {
  // The dropout draws, always all of them, so that a recompute replaying the tracker's states gets
  // the original masks.
  draw(tracker, p);
  attention_.forward(stages, x, mid_, p);
  mlp_.forward(stages, mid_, out, p);
}

void TransformerBlock::draw(rng::RngStatesTracker* tracker, float p) {
  attention_.draw(tracker, p);
  mlp_.draw(tracker, p);
}

void TransformerBlock::forward(const TensorView& x, const TensorView& out, float p, rng::RngStatesTracker* tracker,
                               bool training) {
  run(kAllStages, x, out, p, tracker);
  if (training && distribute_) ctx_.be.copy(input_part_, ctx_.tp.row_part(x));  // kept for the recompute
}

void TransformerBlock::recompute(const TensorView& x) {
  auto& bus = ctx_.world.events();
  // Listeners set the RNG tracker back to the states this block's forward started from, and FP8
  // layers reuse their forward scales.
  bus.publish(nn::LayerRecomputeBegin{unit()});
  if (distribute_) ctx_.tp.gather_row_parts(x, input_part_);
  run(recomputed_, x, {}, ctx_.cfg.dropout, ctx_.world.try_resource<rng::RngStatesTracker>());
  bus.publish(nn::LayerRecomputeEnd{unit()});
}

void TransformerBlock::backward(const TensorView& x) {
  if (recomputed_) recompute(x);
  mlp_.backward(mid_, ctx_.cfg.dropout);
  attention_.backward(x, ctx_.cfg.dropout);
}

std::size_t TransformerBlock::scratch_bytes() const {
  return std::max(attention_.mixer().scratch_bytes(), mlp_.mixer().scratch_bytes());
}

std::vector<std::pair<std::string, Mixer*>> TransformerBlock::mixers() {
  const std::string at = cat("blocks.", index_, ".");
  return {{at + "attn", &attention_.mixer()}, {at + "mlp", &mlp_.mixer()}};
}

std::vector<std::pair<std::string, const Mixer*>> TransformerBlock::mixers() const {
  const std::string at = cat("blocks.", index_, ".");
  return {{at + "attn", &attention_.mixer()}, {at + "mlp", &mlp_.mixer()}};
}

double TransformerBlock::flops_per_token() const {
  return attention_.mixer().flops_per_token() + mlp_.mixer().flops_per_token();
}

}  // namespace kiln::model
