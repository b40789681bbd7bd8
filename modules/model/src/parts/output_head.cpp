#include "kiln/model/parts/output_head.hpp"

#include "kiln/model/spec.hpp"

namespace kiln::model {

OutputHead::OutputHead(LayerBuilder b, const ModelSpec& spec, std::optional<Entity> tied)
    : ctx_(b.ctx()),
      norm_(spec.make_norm(b, "f", Norm::Output::always_kept)),
      // Tied: wte's rows (split by vocabulary under vocabulary parallelism); untied, its own weight
      // split the same way.
      head_(b, "lm_head", nn::LinearRole::lm_head,
            parallel::ColumnParallelLinear(ctx_.tp, ctx_.cfg.n_embd, ctx_.cfg.padded_vocab(), 1, ctx_.tp.vocab_parallel()),
            false, ctx_.cfg.init_std, tied),
      loss_(ctx_.tp, ctx_.cfg.padded_vocab(), ctx_.cfg.vocab_size, ctx_.N) {
  norm_->feed(head_.entity());
}

void OutputHead::declare(ActivationTable& table) {
  auto rows = table.model();
  norm_->declare(rows, "head.norm", 0);
  rows.own(logits_, ctx_.act(), {ctx_.N, head_.local_out()});
}

void OutputHead::forward(const TensorView& x, const TensorView& losses, const TensorView& targets, float dloss) {
  const NormOutput normed = norm_->forward(x);
  head_.forward({logits_, {}, normed.input}, normed.local);
  loss_.forward(losses, logits_, targets, dloss);
}

void OutputHead::backward(const TensorView& x) {
  // The loss left dlogits in the logits.
  const StreamTensors& s = ctx_.stream;
  const TensorView dnorm =
      head_.backward({.dx = s.col_dx, .dout = logits_, .x = norm_->backward_input(x)}, s.col_dx_local(ctx_.tp.sequence_parallel()));
  ctx_.be.zero(s.dres);
  norm_->backward(s.dres, dnorm, x);
}

double OutputHead::flops_per_token() const {
  const auto& h = head_.layer();
  return 6.0 * double(h.out()) * double(h.in());
}

}  // namespace kiln::model
