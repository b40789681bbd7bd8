#include "kiln/parallel/vocab_parallel.hpp"

#include "kiln/core/error.hpp"

namespace kiln::parallel {

VocabParallelEmbedding::VocabParallelEmbedding(const TensorParallel& tp, std::int64_t vocab, std::int64_t channels)
    : tp_(tp), vocab_(vocab), local_vocab_(vocab) {
  KILN_CHECK(vocab > 0 && channels > 0, "embedding of ", vocab, " x ", channels);
  if (!tp.vocab_parallel()) return;
  tp.require({vocab, "vocabulary-parallel embedding", "vocabulary rows (padded)"});
  local_vocab_ = vocab / tp.size();
  vocab_begin_ = tp.split(vocab).first;
  shard_ = row_shard(tp, vocab);
}

void VocabParallelEmbedding::forward(const ops::EmbeddingForward& a, const TensorView& out_local) const {
  ops::EmbeddingForward f = a;
  if (!tp_.sequence_parallel()) f.out = out_local;
  f.vocab_begin = vocab_begin_;
  f.vocab_total = vocab_;
  f.positions = a.positions && (!tp_.vocab_parallel() || tp_.rank() == 0);  // added once before the sum
  tp_.backend().embedding_forward(f);
  if (tp_.vocab_parallel())
    tp_.exit(out_local, f.out);
  else if (tp_.sequence_parallel())
    tp_.backend().copy(out_local, tp_.local_part(f.out));
}

void VocabParallelEmbedding::backward(const ops::EmbeddingBackward& a, const TensorView& dout_local) const {
  ops::EmbeddingBackward b = a;
  if (tp_.sequence_parallel())
    tp_.exit_backward(a.dout, dout_local);
  else
    b.dout = dout_local;
  b.vocab_begin = vocab_begin_;
  b.vocab_total = vocab_;
  tp_.backend().embedding_backward(b);
}

VocabParallelCrossEntropy::VocabParallelCrossEntropy(const TensorParallel& tp, std::int64_t vocab, int vocab_real,
                                                     std::int64_t rows)
    : tp_(tp), vocab_real_(vocab_real) {
  KILN_CHECK(vocab_real > 0 && vocab_real <= vocab && rows > 0, "cross-entropy over ", vocab_real, " of ", vocab,
             " columns, ", rows, " rows");
  rows_ = rows;
  auto& be = tp.backend();
  stats_ = be.alloc(static_cast<std::size_t>(rows) * 3 * sizeof(float));
  stats_view_ = stats_.view(DType::f32, {rows, 3});
  if (!tp.vocab_parallel()) return;
  tp.require({vocab, "vocabulary-parallel cross-entropy", "vocabulary columns (padded)"});
  vocab_begin_ = tp.split(vocab).first;
  all_stats_ = be.alloc(static_cast<std::size_t>(tp.size()) * rows * 3 * sizeof(float));
}

void VocabParallelCrossEntropy::forward(const TensorView& losses, const TensorView& logits, const TensorView& targets,
                                        float dloss) const {
  auto& be = tp_.backend();
  if (!tp_.vocab_parallel()) {
    be.cross_entropy({losses, logits, targets, vocab_real_, dloss});
    return;
  }
  be.cross_entropy_finish({losses, logits, targets, gathered_stats(logits, targets), vocab_begin_, vocab_real_, dloss});
}

TensorView VocabParallelCrossEntropy::gathered_stats(const TensorView& logits, const TensorView& targets) const {
  const std::int64_t n = logits.size(0);
  KILN_CHECK(n > 0 && n <= rows_, "cross-entropy built for up to ", rows_, " rows, got ", logits.str());
  const TensorView stats = stats_view_.rows(0, n);
  tp_.backend().cross_entropy_stats({stats, logits, targets, vocab_begin_, vocab_real_});
  if (!tp_.vocab_parallel()) return stats.reshape({1, n, 3});
  const TensorView all_stats = all_stats_.view(DType::f32, {tp_.size(), n, 3});
  tp_.all_gather(all_stats.reshape({all_stats.numel()}), stats.reshape({stats.numel()}));
  return all_stats;
}

void VocabParallelCrossEntropy::forward_lse(const TensorView& losses, const TensorView& logits,
                                            const TensorView& targets, const TensorView& lse) const {
  tp_.backend().cross_entropy_finish({.losses = losses,
                                      .logits = logits,
                                      .targets = targets,
                                      .all_stats = gathered_stats(logits, targets),
                                      .vocab_begin = vocab_begin_,
                                      .vocab_real = vocab_real_,
                                      .lse = lse,
                                      .write_dlogits = false});
}

}  // namespace kiln::parallel
