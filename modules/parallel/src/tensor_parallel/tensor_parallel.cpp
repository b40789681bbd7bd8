#include "kiln/parallel/tensor_parallel.hpp"

#include "kiln/core/error.hpp"
#include "kiln/parallel/comm_overlap.hpp"

namespace kiln::parallel {

TensorParallel::TensorParallel(Communicator& comm, ops::Backend& backend, TensorParallelOptions options)
    : comm_(comm),
      be_(backend),
      size_(comm.size()),
      rank_(comm.rank()),
      sequence_parallel_(options.sequence_parallel && comm.size() > 1),
      vocab_parallel_(options.vocab_parallel && comm.size() > 1) {
  if (options.comm_overlap && comm.size() > 1)
    overlap_ = std::make_shared<CommOverlap>(comm, backend, sequence_parallel_, options.comm_chunks,
                                             options.comm_sms);
}

std::vector<SplitProblem> check_splits(int tp_size, const std::vector<SplitDim>& dims) {
  std::vector<SplitProblem> out;
  for (const auto& d : dims)
    if (d.value <= 0 || d.value % tp_size != 0)
      out.push_back({d.key, cat(d.value, " ", d.what, " do not split over the ", tp_size,
                                " ranks of the tensor-parallel group (parallel.tp)")});
  return out;
}

void TensorParallel::require(const SplitDim& dim) const {
  for (const auto& p : check_splits(size_, {dim})) KILN_THROW(p.key, ": ", p.message);
}

std::pair<std::int64_t, std::int64_t> TensorParallel::split(std::int64_t total) const {
  KILN_CHECK(total % size_ == 0, total, " does not split over ", size_, " ranks");
  const std::int64_t part = total / size_;
  return {rank_ * part, (rank_ + 1) * part};
}

TensorView TensorParallel::local_part(const TensorView& full) const {
  if (!sequence_parallel_) return full;
  return row_part(full);
}

TensorView TensorParallel::row_part(const TensorView& full) const {
  const std::int64_t N = full.size(0);
  KILN_CHECK(N % size_ == 0, "the ", N, " rows of ", full.str(), " do not split over ", size_, " ranks");
  return full.rows(rank_ * (N / size_), N / size_);
}

void TensorParallel::enter(const TensorView& full, const TensorView& local) const {
  if (sequence_parallel_) {
    comm_.all_gather(full, local, be_.stream());
    return;
  }
  KILN_CHECK(full.data == local.data, "entering a TP region without sequence parallelism needs one tensor, got ",
             full.str(), " and ", local.str());
}

void TensorParallel::enter_backward(const TensorView& local, const TensorView& full) const {
  if (sequence_parallel_) {
    comm_.reduce_scatter(local, full, ReduceOp::sum, be_.stream());
    return;
  }
  KILN_CHECK(full.data == local.data, "summing over the TP group without sequence parallelism needs one tensor, got ",
             full.str(), " and ", local.str());
  all_reduce(full);
}

void TensorParallel::gather_row_parts(const TensorView& full, const TensorView& part) const {
  comm_.all_gather(full, part, be_.stream());
}

void TensorParallel::all_reduce(const TensorView& t) const {
  if (size_ > 1) comm_.all_reduce(t, ReduceOp::sum, be_.stream());
}

void TensorParallel::all_gather(const TensorView& out, const TensorView& in) const {
  comm_.all_gather(out, in, be_.stream());
}

ops::RowGather TensorParallel::row_gather(std::int64_t N) const {
  KILN_CHECK(sequence_parallel_, "a row gather outside sequence parallelism");
  ops::RowGather g{.first_row = first_local_row(N),
                   .all_gather = [this](const TensorView& full, const TensorView& local) { all_gather(full, local); },
                   .max = [this](float* v) {
                     comm_.all_reduce(TensorView(v, {1}, DType::f32, be_.device()), ReduceOp::max, be_.stream());
                   }};
  if (CommOverlap* o = overlap_.get())
    g.gather_pieces = [o](const TensorView& full, const TensorView& local,
                          const std::function<void(std::int64_t, std::int64_t)>& compute) {
      o->gather_rows(full, local, compute);
    };
  return g;
}

TensorShard row_shard(const TensorParallel& tp, std::int64_t rows, int parts) {
  KILN_CHECK(parts > 0 && rows % parts == 0, rows, " rows do not make ", parts, " equal parts");
  return row_shard(tp, std::vector<std::int64_t>(static_cast<std::size_t>(parts), rows / parts));
}

TensorShard row_shard(const TensorParallel& tp, const std::vector<std::int64_t>& parts) {
  TensorShard s;
  if (tp.size() == 1) return s;
  s.dim = 0;
  std::int64_t at = 0;
  for (const std::int64_t part : parts) {
    KILN_CHECK(part % tp.size() == 0, "a part of ", part, " rows does not split over ", tp.size(), " ranks");
    const auto [b, e] = tp.split(part);
    s.ranges.push_back({at + b, at + e});
    at += part;
  }
  return s;
}

TensorShard column_shard(const TensorParallel& tp, std::int64_t cols) {
  TensorShard s;
  if (tp.size() == 1) return s;
  const auto [b, e] = tp.split(cols);
  s.dim = 1;
  s.ranges.push_back({b, e});
  return s;
}

}  // namespace kiln::parallel
