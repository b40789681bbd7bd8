#pragma once
// The tensor-parallel group as layers see it (Megatron's layout): the group's communicator and
// backend, where activations live between the TP regions, and the checks that a model's dimensions
// split over the group. A model composes the layers of parallel_linear.hpp and vocab_parallel.hpp
// and never calls a collective itself.
//
// Inside a TP region (from a column-parallel linear's input to the row-parallel linear's output)
// every rank sees all N token rows. Outside it, with sequence parallelism, each rank keeps its N/tp
// consecutive rows (LayerNorms, dropout and residuals run on them); without it every rank keeps all
// N. The region's entry gathers the rows (all-gather, or nothing without SP); its exit sums the
// ranks' partial results (reduce-scatter to this rank's rows, or an all-reduce).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kiln/ops/backend.hpp"
#include "kiln/ops/linear_impl.hpp"
#include "kiln/parallel/communicator.hpp"
#include "kiln/tensor/shard.hpp"

namespace kiln::parallel {

struct TensorParallelOptions {
  bool sequence_parallel = false;  // outside the TP regions each rank keeps 1/tp of the token rows
  bool vocab_parallel = false;     // the embedding table and the LM head's logits split by vocabulary rows
  bool comm_overlap = false;       // the linear layers' collectives overlapped with their GEMMs (comm_overlap.hpp)
  int comm_chunks = 1;             // pieces per rank's share of the token rows, with comm_overlap
  int comm_sms = 0;                // SMs the overlapped GEMMs leave to the collectives
};

// A dimension a model splits over the TP group, with the config key that sets it (for messages).
struct SplitDim {
  std::int64_t value = 0;
  std::string key;    // e.g. "model.n_head"
  std::string what;   // e.g. "attention heads"
};

// What a dimension that does not split says, and which key to change.
struct SplitProblem {
  std::string key;
  std::string message;
};

// The one place a dimension is checked against the tensor-parallel group: empty when every
// dimension divides over `tp_size` ranks, else one problem per dimension that does not, naming its
// key. Modules check theirs at install, as config errors (before any rank allocates anything).
std::vector<SplitProblem> check_splits(int tp_size, const std::vector<SplitDim>& dims);

class CommOverlap;

class TensorParallel {
 public:
  // `comm` is the TP group (a group of one rank: no communication). Both must outlive this object.
  TensorParallel(Communicator& comm, ops::Backend& backend, TensorParallelOptions options);

  int size() const { return size_; }
  int rank() const { return rank_; }
  // Only with more than one rank: on one rank nothing is split.
  bool sequence_parallel() const { return sequence_parallel_; }
  bool vocab_parallel() const { return vocab_parallel_; }
  ops::Backend& backend() const { return be_; }
  // The collectives' overlap with the GEMMs (with comm_overlap and more than one rank; else null).
  // Copies of this object share it.
  CommOverlap* comm_overlap() const { return overlap_.get(); }

  // The layers' constructors (and a model's) require their dimensions to split (check_splits).
  void require(const SplitDim& dim) const;  // throws kiln::Error with the problem
  // This rank's [begin, end) of `total` split in size() equal parts (total divisible by size()).
  std::pair<std::int64_t, std::int64_t> split(std::int64_t total) const;

  // ---- activations outside the TP regions ----
  // This rank's token rows of a micro-batch of N rows: N/tp from rank * N/tp under SP, else all N.
  std::int64_t local_rows(std::int64_t N) const { return sequence_parallel_ ? N / size_ : N; }
  std::int64_t first_local_row(std::int64_t N) const { return sequence_parallel_ ? rank_ * (N / size_) : 0; }
  // This rank's rows of a full [N, ...] tensor (the tensor itself without SP).
  TensorView local_part(const TensorView& full) const;

  // ---- the sequence-parallel region ----
  // Entry (forward): `full` [N, C] gets every rank's `local` rows (all-gather). Without SP the two
  // must be one tensor and nothing happens.
  void enter(const TensorView& full, const TensorView& local) const;
  // Entry (backward): the gradients of `full` from every rank, partial sums, summed over the group:
  // this rank's rows into `local` (reduce-scatter), or in place without SP (`local` must be `full`).
  void enter_backward(const TensorView& local, const TensorView& full) const;
  // Exit (forward): the partial results in `full` summed over the group, as enter_backward.
  void exit(const TensorView& local, const TensorView& full) const { enter_backward(local, full); }
  // Exit (backward): the gradient of `local` rows gathered into `full`, as enter.
  void exit_backward(const TensorView& full, const TensorView& local) const { enter(full, local); }

  // ---- rows split over the group whatever the SP setting (saved activations kept in parts) ----
  // This rank's 1/tp of the rows of `full` (a view).
  TensorView row_part(const TensorView& full) const;
  // `full` = every rank's `part` (all-gather).
  void gather_row_parts(const TensorView& full, const TensorView& part) const;

  // The group's collectives an implementation that gathers its own input uses (ops::RowGather),
  // for a micro-batch of N rows under sequence parallelism.
  ops::RowGather row_gather(std::int64_t N) const;

  // Sum of `t` over the group, in place (identical bits on every rank).
  void all_reduce(const TensorView& t) const;
  // out [size, ...] = every rank's `in`, in rank order.
  void all_gather(const TensorView& out, const TensorView& in) const;

 private:
  Communicator& comm_;
  ops::Backend& be_;
  int size_ = 1, rank_ = 0;
  bool sequence_parallel_ = false, vocab_parallel_ = false;
  std::shared_ptr<CommOverlap> overlap_;
};

// The shard of a weight whose rows are `parts` equal blocks (q, k, v of a fused QKV: 3), of each of
// which this rank holds its 1/tp (column-parallel layers), or of one whose columns it splits
// (row-parallel layers). Whole tensors (an empty shard) on one rank.
TensorShard row_shard(const TensorParallel& tp, std::int64_t rows, int parts = 1);
// Rows made of consecutive parts of the given sizes (a grouped-query QKV: query, key and value
// rows), each split over the group: this rank holds its 1/tp of every part, in part order.
TensorShard row_shard(const TensorParallel& tp, const std::vector<std::int64_t>& parts);
TensorShard column_shard(const TensorParallel& tp, std::int64_t cols);

}  // namespace kiln::parallel
