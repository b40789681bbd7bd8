#pragma once
// The model's last unit: the final norm, the LM head (tied to the token embedding, or its own
// weight; column-parallel by vocabulary under vocabulary parallelism) and the softmax cross-entropy,
// fused with its backward (the logits become dlogits). The logits are dead from the head's backward
// until the next forward: the blocks' backward scratch lives at their end where it fits.
#include <memory>
#include <optional>

#include "kiln/model/parts/linear.hpp"
#include "kiln/model/parts/norm.hpp"
#include "kiln/parallel/vocab_parallel.hpp"

namespace kiln::model {

struct ModelSpec;

class OutputHead {
 public:
  // `tied`: the token embedding's table, the LM head's weight; else the head has its own.
  OutputHead(LayerBuilder b, const ModelSpec& spec, std::optional<Entity> tied);

  void declare(ActivationTable& table);
  const TensorView& logits() const { return logits_; }
  // The losses of every token of x [Nl, C] (the last block's output) into `losses` [N]; the logits
  // become dlogits (dloss each).
  void forward(const TensorView& x, const TensorView& losses, const TensorView& targets, float dloss);
  // The residual stream's gradient (written into ctx.stream.dres) from the dlogits.
  void backward(const TensorView& x);
  double flops_per_token() const;

 private:
  ModelContext& ctx_;
  std::unique_ptr<Norm> norm_;
  ColumnLinear head_;
  parallel::VocabParallelCrossEntropy loss_;
  TensorView logits_;  // [N, padded vocabulary / tp (vocabulary parallelism) or all of it]
};

}  // namespace kiln::model
