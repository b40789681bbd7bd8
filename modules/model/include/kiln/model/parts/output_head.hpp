#pragma once
// The model's last unit: the final norm, the LM head (tied to the token embedding, or its own
// weight; column-parallel by vocabulary under vocabulary parallelism) and the softmax cross-entropy,
// fused with its backward (the logits become dlogits). Two types, which a model's spec picks
// (model.head_chunk_rows):
//  - LogitsHead: the logits of a whole micro-batch [N, vocabulary] are computed in the forward pass
//    and kept, as dlogits, until the backward pass.
//  - ChunkedLossHead: a chunk of rows at a time, logits, loss, dlogits and the head's gradients, all
//    in the backward pass (the training forward only notes its arguments: the head's forward and
//    backward of a micro-batch run back to back, the model checks it), so no more than a chunk's
//    logits exist at once. Evaluation runs the chunks' logits and losses in the forward.
// The logits are dead from the head's backward until the next forward: the blocks' backward scratch
// (and what their linears borrow) lives in their memory where it fits. Where the head's
// implementation makes the cross-entropy's gradient as it loads the logits (ops::XentOnLoad: an FP8
// head), a training step's loss leaves the logits as they are and keeps each row's logsumexp instead
// of writing dlogits over them: one write and one read of the logits fewer.
#include <cstdint>
#include <memory>
#include <optional>

#include "kiln/model/parts/linear.hpp"
#include "kiln/model/parts/norm.hpp"
#include "kiln/parallel/vocab_parallel.hpp"

namespace kiln::model {

struct ModelSpec;

class OutputHead {
 public:
  virtual ~OutputHead() = default;
  OutputHead(const OutputHead&) = delete;
  OutputHead& operator=(const OutputHead&) = delete;

  // Declares the head's rows; its logits memory holds at least `lend` bytes (what the blocks'
  // backward lends out).
  virtual void declare(ActivationTable& table, std::size_t lend) = 0;
  // The logits' memory, which the blocks' backward scratch reuses.
  const TensorView& logits() const { return logits_; }
  // The losses of every token of x [Nl, C] (the last block's output) into `losses` [N], each
  // token's loss gradient `dloss`.
  virtual void forward(const TensorView& x, const TensorView& losses, const TensorView& targets, float dloss) = 0;
  // The residual stream's gradient (written into ctx.stream.dres) for the x of the last forward.
  virtual void backward(const TensorView& x) = 0;
  // A training forward's losses wait for its backward (ChunkedLossHead).
  virtual bool losses_pending() const { return false; }
  double flops_per_token() const;

 protected:
  // Whether this training forward's loss leaves the gradient to the head (ops::XentOnLoad).
  bool xent_on_load() const;
  // The loss of `logits` (rows of a training or evaluation forward), and the head's output gradient
  // for its backward: the dlogits the loss wrote over the logits, or the gradient made on load.
  ops::OutputGrad loss(const TensorView& losses, const TensorView& logits, const TensorView& targets, float dloss);

  // `tied`: the token embedding's table, the LM head's weight; else the head has its own. The loss
  // takes calls of up to `loss_rows` tokens.
  OutputHead(LayerBuilder& b, const ModelSpec& spec, std::optional<Entity> tied, std::int64_t loss_rows);
  // The logits' rows: `rows` of them, or more where `lend` bytes need more.
  void declare_logits(ActivationTable& table, std::int64_t rows, std::size_t lend);

  ModelContext& ctx_;
  std::unique_ptr<Norm> norm_;
  ColumnLinear head_;
  parallel::VocabParallelCrossEntropy loss_;
  TensorView logits_;  // [rows, padded vocabulary / tp (vocabulary parallelism) or all of it]
  Buffer lse_;         // [loss rows] f32: each row's logsumexp, for a gradient made on load
};

// The whole micro-batch's logits, kept from the forward to the backward pass.
class LogitsHead final : public OutputHead {
 public:
  LogitsHead(LayerBuilder b, const ModelSpec& spec, std::optional<Entity> tied);
  void declare(ActivationTable& table, std::size_t lend) override;
  void forward(const TensorView& x, const TensorView& losses, const TensorView& targets, float dloss) override;
  void backward(const TensorView& x) override;

 private:
  ops::OutputGrad dout_;  // the last training forward's output gradient
};

// `chunk_rows` tokens' logits at a time, computed in the backward pass (see above). The head's
// implementation must take a forward and a backward on a chunk's rows, pair after pair
// (ops::takes_row_pairs: the backend's does, and an FP8 head, fp8.lm_head, whose chunks each
// quantise by their own amax, their own blocks or delayed scaling's scale), which the model checks
// once modules have attached theirs.
class ChunkedLossHead final : public OutputHead {
 public:
  ChunkedLossHead(LayerBuilder b, const ModelSpec& spec, std::optional<Entity> tied, std::int64_t chunk_rows);
  void declare(ActivationTable& table, std::size_t lend) override;
  void forward(const TensorView& x, const TensorView& losses, const TensorView& targets, float dloss) override;
  void backward(const TensorView& x) override;
  bool losses_pending() const override { return pending_.has_value(); }

 private:
  struct Pending {
    TensorView losses, targets;
    float dloss;
  };
  // The chunks: logits and losses, and with `grads` the dlogits' input and weight gradients, then
  // the norm's backward into ctx.stream.dres.
  void run(const TensorView& x, const Pending& p, bool grads);

  std::int64_t chunk_;
  std::optional<Pending> pending_;  // the training forward's arguments, for the backward
};

}  // namespace kiln::model
