#include "kiln/model/parts/output_head.hpp"

#include <algorithm>

#include "kiln/model/spec.hpp"

namespace kiln::model {

OutputHead::OutputHead(LayerBuilder& b, const ModelSpec& spec, std::optional<Entity> tied, std::int64_t loss_rows)
    : ctx_(b.ctx()),
      norm_(spec.make_norm(b, "f", Norm::Output::always_kept)),
      // Tied: wte's rows (split by vocabulary under vocabulary parallelism); untied, its own weight
      // split the same way.
      head_(b, "lm_head", nn::LinearRole::lm_head,
            parallel::ColumnParallelLinear(ctx_.tp, ctx_.cfg.n_embd, ctx_.cfg.padded_vocab(), 1, ctx_.tp.vocab_parallel()),
            false, ctx_.cfg.init_std, tied),
      loss_(ctx_.tp, ctx_.cfg.padded_vocab(), ctx_.cfg.vocab_size, loss_rows),
      lse_(ctx_.be.alloc(static_cast<std::size_t>(loss_rows) * sizeof(float))) {
  norm_->feed(head_.entity());
}

bool OutputHead::xent_on_load() const {
  return ctx_.training && head_.impl().prologues.has(ops::Prologue::xent);
}

ops::OutputGrad OutputHead::loss(const TensorView& losses, const TensorView& logits, const TensorView& targets,
                                 float dloss) {
  if (!xent_on_load()) {
    loss_.forward(losses, logits, targets, dloss);
    return logits;
  }
  const TensorView lse = lse_.view(DType::f32, {logits.size(0)});
  loss_.forward_lse(losses, logits, targets, lse);
  return loss_.xent_on_load(logits, lse, targets, dloss);
}

void OutputHead::declare_logits(ActivationTable& table, std::int64_t rows, std::size_t lend) {
  const std::int64_t row_bytes = head_.local_out() * static_cast<std::int64_t>(size_of(ctx_.act()));
  const auto lend_rows = static_cast<std::int64_t>((lend + static_cast<std::size_t>(row_bytes) - 1) /
                                                   static_cast<std::size_t>(row_bytes));
  auto model_rows = table.model();
  model_rows.own(logits_, ctx_.act(), {std::max(rows, lend_rows), head_.local_out()});
}

double OutputHead::flops_per_token() const {
  const auto& h = head_.layer();
  return 6.0 * double(h.out()) * double(h.in());
}

LogitsHead::LogitsHead(LayerBuilder b, const ModelSpec& spec, std::optional<Entity> tied)
    : OutputHead(b, spec, tied, b.ctx().N) {}

void LogitsHead::declare(ActivationTable& table, std::size_t lend) {
  auto rows = table.model();
  norm_->declare(rows, "head.norm", 0);
  declare_logits(table, ctx_.N, lend);
}

void LogitsHead::forward(const TensorView& x, const TensorView& losses, const TensorView& targets, float dloss) {
  const NormOutput normed = norm_->forward(x);
  const TensorView logits = logits_.rows(0, ctx_.N);
  head_.forward({logits, {}, normed.input}, normed.local);
  dout_ = loss(losses, logits, targets, dloss);
}

void LogitsHead::backward(const TensorView& x) {
  // The loss left dlogits in the logits, or the head makes them on load.
  const StreamTensors& s = ctx_.stream;
  const TensorView dnorm = head_.backward({.dx = s.col_dx, .dout = dout_, .x = norm_->backward_input(x)},
                                          s.col_dx_local(ctx_.tp.sequence_parallel()));
  ctx_.be.zero(s.dres);
  norm_->backward(s.dres, dnorm, x);
}

ChunkedLossHead::ChunkedLossHead(LayerBuilder b, const ModelSpec& spec, std::optional<Entity> tied,
                                 std::int64_t chunk_rows)
    : OutputHead(b, spec, tied, std::clamp<std::int64_t>(chunk_rows, 1, b.ctx().N)),
      chunk_(std::clamp<std::int64_t>(chunk_rows, 1, b.ctx().N)) {  // at most the micro-batch's rows
  KILN_CHECK(chunk_rows > 0, "an LM head of ", chunk_rows, " rows a chunk");
}

void ChunkedLossHead::declare(ActivationTable& table, std::size_t lend) {
  // The chunks multiply rows of the norm's output: a tensor of its own, never a prologue.
  if (!ops::takes_row_pairs(head_.impl()))
    throw ConfigError("model.head_chunk_rows: the LM head's linear implementation (a module's) cannot be called on "
                      "chunks of rows; set model.head_chunk_rows = 0 or keep the head in the backend's precision");
  const std::int64_t multiple = head_.impl().pair_rows_multiple;
  if (chunk_ % multiple != 0)
    throw ConfigError(cat("model.head_chunk_rows = ", chunk_, ": the LM head's linear implementation (a module's: ",
                          "fp8.lm_head, say) takes chunks of a multiple of ", multiple, " rows"));
  auto rows = table.model();
  norm_->declare(rows, "head.norm", 0);
  declare_logits(table, chunk_, lend);
}

void ChunkedLossHead::forward(const TensorView& x, const TensorView& losses, const TensorView& targets, float dloss) {
  if (ctx_.training) {
    pending_ = Pending{losses, targets, dloss};
    return;
  }
  run(x, {losses, targets, dloss}, false);
}

void ChunkedLossHead::backward(const TensorView& x) {
  KILN_CHECK(pending_, "the LM head's backward without a training forward");
  const Pending p = *pending_;
  pending_.reset();
  run(x, p, true);
}

void ChunkedLossHead::run(const TensorView& x, const Pending& p, bool grads) {
  const StreamTensors& s = ctx_.stream;
  const NormOutput normed = norm_->forward(x);
  const TensorView in = head_.layer().gather_input(ops::plain_tensor(normed.input), normed.local);
  const std::int64_t N = ctx_.N;
  for (std::int64_t r = 0; r < N; r += chunk_) {
    const std::int64_t n = std::min(chunk_, N - r);
    const TensorView logits = logits_.rows(0, n), rows = in.rows(r, n);
    head_.forward_whole({logits, {}, rows});
    const ops::OutputGrad dout = loss(p.losses.rows(r, n), logits, p.targets.rows(r, n), p.dloss);
    // This chunk's dlogits (left in its logits by the loss, or made on load): its rows of the input
    // gradient (a partial sum over the group under vocabulary parallelism), and its part of the
    // weight gradient, added to the earlier chunks'.
    if (grads) head_.backward_whole({.dx = s.col_dx.rows(r, n), .dout = dout, .x = rows}, r > 0);
  }
  if (!grads) return;
  const TensorView dnorm = head_.layer().sum_input_grad(s.col_dx, s.col_dx_local(ctx_.tp.sequence_parallel()));
  ctx_.be.zero(s.dres);
  norm_->backward(s.dres, dnorm, x);
}

}  // namespace kiln::model
