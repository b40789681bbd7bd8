#pragma once
// Tensor-parallel linear layers (Megatron's ColumnParallelLinear and RowParallelLinear) on kiln's
// explicit forward and backward. A layer object knows its shapes and its part of the weight; the
// caller passes the tensors of each call and the implementation that multiplies (the backend's
// linear ops or a module's ops::LinearImpl, FP8 for instance), so one object serves every block.
//
// A column-parallel layer starts a TP region: its input is whole on every rank, its weight and
// output are split by output features, so its input gradient is a partial sum. A row-parallel
// layer ends one: its input and weight are split by input features, its output is a partial sum
// (the bias added once, on rank 0), summed over the group as the region exits.
#include <cstdint>
#include <vector>

#include "kiln/ops/linear_impl.hpp"
#include "kiln/parallel/tensor_parallel.hpp"

namespace kiln::parallel {

class ColumnParallelLinear {
 public:
  // Weight [out, in] (and bias [out]) whose rows are `parts` equal blocks (a fused QKV: 3), of each
  // of which this rank holds its 1/tp. With `split` false the weight is whole on every rank and only
  // the input is gathered (an LM head outside vocabulary parallelism).
  ColumnParallelLinear(const TensorParallel& tp, std::int64_t in, std::int64_t out, int parts = 1, bool split = true);
  // Weight rows in consecutive parts of the given sizes, each split over the group (a grouped-query
  // QKV: query heads x D, then key and value heads x D); the local output is this rank's part of
  // each, in part order.
  ColumnParallelLinear(const TensorParallel& tp, std::int64_t in, const std::vector<std::int64_t>& parts);

  std::int64_t in() const { return in_; }
  std::int64_t out() const { return out_; }
  std::int64_t local_out() const { return local_out_; }
  TensorShard weight_shard() const { return shard_; }  // the bias's too (its rows)

  // a.out [N, local_out] = x [N, in] W^T (+ b). Under sequence parallelism x is a.x, first filled
  // with every rank's `x_local` rows ([N/tp, in]); without it x is `x_local` (a.x where that is
  // empty). Where a.x is a prologue (the implementation computes its input itself while loading it,
  // ops::LayerNormOnLoad) `x_local` is empty: there is nothing to gather, which sequence parallelism
  // does not allow. `input_read_after` false (nothing reads the gathered a.x after this call: the
  // backward gathers it again, or the implementation keeps its own copy): an implementation that
  // gathers its input itself (ops::LinearImpl::forward_gathered: FP8 codes) does, a.x unwritten.
  void forward(const ops::LinearImpl& impl, const ops::LinearForward& a, const TensorView& x_local,
               bool input_read_after = true) const;
  // The weight (and bias) gradients, and the input gradient: a.dx [N, in] is this rank's partial
  // sum, summed over the group into `dx_local` (this rank's rows, reduce-scatter) under sequence
  // parallelism, or in place (all-reduce; `dx_local` unused). Returns the view holding this rank's
  // rows of the input gradient (with `split` false, its rows of a.dx: no communication). a.x is the
  // whole input the forward multiplied (under sequence parallelism the gathered one).
  TensorView backward(const ops::LinearImpl& impl, const ops::LinearBackward& a, const TensorView& dx_local) const;

  // The two communication steps of forward and backward, for a caller that runs the GEMMs itself
  // (on chunks of rows, say: the LM head of model.head_chunk_rows). gather_input: the whole input
  // on this rank, as forward multiplies it (every rank's `x_local` rows gathered into `full` under
  // sequence parallelism; else `x_local`, or `full` where `x_local` is empty). sum_input_grad: the
  // input gradient's sum over the group from this rank's partial `dx` [N, in], as backward returns
  // it (this rank's rows; `dx_local` receives them under sequence parallelism).
  TensorView gather_input(const TensorView& full, const TensorView& x_local) const;
  TensorView sum_input_grad(const TensorView& dx, const TensorView& dx_local) const;

 private:
  const TensorParallel& tp_;
  std::int64_t in_, out_, local_out_;
  bool split_;
  TensorShard shard_;
};

class RowParallelLinear {
 public:
  // Weight [out, in] split by columns (this rank's 1/tp of the input features); the bias [out] whole.
  RowParallelLinear(const TensorParallel& tp, std::int64_t in, std::int64_t out);

  std::int64_t in() const { return in_; }
  std::int64_t local_in() const { return local_in_; }
  std::int64_t out() const { return out_; }
  TensorShard weight_shard() const { return shard_; }

  // out [N, out] = a.x [N, local_in] W^T, a partial sum (the bias added on rank 0 only), summed
  // over the group into `out_local`: under sequence parallelism out is a.out and `out_local` this
  // rank's rows of the sum (reduce-scatter); without it out is `out_local` (all-reduce, a.out unused).
  void forward(const ops::LinearImpl& impl, const ops::LinearForward& a, const TensorView& out_local) const;
  // The gradients from dout [N, out]: under sequence parallelism a.dout, first filled with every
  // rank's `dout_local` rows; without it `dout_local` (a.dout unused). The bias's is whole on every rank.
  void backward(const ops::LinearImpl& impl, const ops::LinearBackward& a, const TensorView& dout_local) const;

 private:
  const TensorParallel& tp_;
  std::int64_t in_, out_, local_in_;
  TensorShard shard_;
};

}  // namespace kiln::parallel
