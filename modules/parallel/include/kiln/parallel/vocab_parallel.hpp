#pragma once
// Vocabulary parallelism (Megatron's VocabParallelEmbedding and vocab-parallel cross-entropy): the
// embedding table [V, C] split by rows over the TP group, and the logits [N, V] of a tied (or
// column-parallel) LM head split by columns, so that no rank holds the whole [N, V] logits. Without
// vocabulary parallelism (or on one rank) the same objects run the plain embedding and loss, and
// under sequence parallelism still hand each rank its own token rows.
#include <cstdint>

#include "kiln/ops/backend.hpp"
#include "kiln/parallel/tensor_parallel.hpp"
#include "kiln/tensor/buffer.hpp"

namespace kiln::parallel {

class VocabParallelEmbedding {
 public:
  // A table of `vocab` rows (padded; split over the group when tp.vocab_parallel()) and `channels`.
  VocabParallelEmbedding(const TensorParallel& tp, std::int64_t vocab, std::int64_t channels);

  std::int64_t vocab() const { return vocab_; }
  std::int64_t local_vocab() const { return local_vocab_; }
  std::int64_t vocab_begin() const { return vocab_begin_; }  // this rank's first row
  TensorShard weight_shard() const { return shard_; }

  // out_local [N/tp or N, C] = wte[tokens] + wpe[position] (with a.positions). Under sequence
  // parallelism the whole lookup goes to a.out [N, C] first (unused otherwise). With vocabulary
  // parallelism every rank looks up the tokens of its rows (zeros for the others; the positions on
  // rank 0) and the sum over the group is the lookup. The vocabulary fields of `a` are this object's.
  void forward(const ops::EmbeddingForward& a, const TensorView& out_local) const;
  // The table gradients from the output gradient: under sequence parallelism every rank's
  // `dout_local` rows gathered into a.dout [N, C] first; without it `dout_local` (a.dout unused).
  void backward(const ops::EmbeddingBackward& a, const TensorView& dout_local) const;

 private:
  const TensorParallel& tp_;
  std::int64_t vocab_, local_vocab_, vocab_begin_ = 0;
  TensorShard shard_;
};

class VocabParallelCrossEntropy {
 public:
  // Logits of `vocab` (padded) columns, of which the first `vocab_real` count, split over the group
  // with tp.vocab_parallel(), for calls of at most `rows` tokens (the statistics' buffers).
  VocabParallelCrossEntropy(const TensorParallel& tp, std::int64_t vocab, int vocab_real, std::int64_t rows);

  // losses [rows] (identical on every rank) and the logits [rows, local vocab] overwritten with
  // dlogits (dloss each), as ops::CrossEntropy. Split: each rank's statistics of its columns, one
  // all-gather of them ([tp, rows, 3]), then every rank combines them in rank order.
  void forward(const TensorView& losses, const TensorView& logits, const TensorView& targets, float dloss) const;
  // The same losses from the statistics, the logits left as they are and each row's logsumexp into
  // `lse` [rows] f32: for an LM head that makes the gradient as it loads the logits
  // (xent_on_load(): ops::XentOnLoad). Without vocabulary parallelism too (no all-gather then).
  void forward_lse(const TensorView& losses, const TensorView& logits, const TensorView& targets,
                   const TensorView& lse) const;
  // The output gradient of forward_lse's logits, made as the head loads them.
  ops::XentOnLoad xent_on_load(const TensorView& logits, const TensorView& lse, const TensorView& targets,
                               float dloss) const {
    return {logits, lse, targets, vocab_begin_, vocab_real_, dloss};
  }

 private:
  // Each rank's statistics of the logits' rows ([tp or 1, rows, 3]: all-gathered under vocabulary parallelism).
  TensorView gathered_stats(const TensorView& logits, const TensorView& targets) const;

  const TensorParallel& tp_;
  std::int64_t vocab_begin_ = 0;
  int vocab_real_;
  std::int64_t rows_ = 0;
  Buffer stats_, all_stats_;  // [rows, 3] and, with vocabulary parallelism, [tp, rows, 3] f32
  TensorView stats_view_;
};

}  // namespace kiln::parallel
