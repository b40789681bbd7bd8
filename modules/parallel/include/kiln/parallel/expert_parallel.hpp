#pragma once
// The expert-parallel group as a mixture-of-experts layer sees it (Megatron-Core's layout): each of
// its ranks holds n_experts / size of the experts, the consecutive ones from first_expert(), and the
// tokens' grouped rows move to the rank holding their expert and back. Expert parallelism is folded
// into the data-parallel dimension: the ranks of an EP group hold the same dense parameters and
// different data, and the ranks holding the same experts (the expert-data-parallel group) sum their
// gradients.
//
// Under tensor parallelism the experts are split over the TP group as the dense MLP is (expert
// tensor parallelism = tp): every TP rank holds its 1/tp of each of its experts' hidden features.
#include <cstdint>
#include <memory>
#include <vector>

#include "kiln/ops/backend.hpp"
#include "kiln/parallel/communicator.hpp"
#include "kiln/parallel/tensor_parallel.hpp"
#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/shard.hpp"

namespace kiln::parallel {

class SideStream;

class ExpertParallel {
 public:
  // `comm` is the EP group (a group of one rank: every expert here, nothing moves). Both must outlive
  // this object. n_experts must split over the group (a config error checked before).
  ExpertParallel(Communicator& comm, ops::Backend& backend, int n_experts);

  int size() const { return size_; }
  int rank() const { return rank_; }
  int n_experts() const { return n_experts_; }
  int local_experts() const { return n_experts_ / size_; }
  int first_expert() const { return rank_ * local_experts(); }
  Communicator& communicator() const { return comm_; }
  ops::Backend& backend() const { return be_; }

  // Where one dispatch's rows go, from every rank's grouped rows (moe_permute's offsets): this rank
  // sends its rows for rank q's experts (consecutive in grouped order) to q in one piece, and receives
  // from every rank its rows for the experts held here in one piece, laid out by source rank, then
  // expert: row group q El + l is rank q's rows for local expert l (ops::GroupedLinearForward::groups,
  // expert_of), so a grouped linear runs over them as over a one-rank batch.
  struct Plan {
    std::vector<std::int32_t> local_offsets;  // [ranks x local_experts + 1]: the received rows of each group
    std::vector<std::int32_t> expert_of;      // [ranks x local_experts]: each group's local expert
    // Per peer q: where this rank's grouped rows for q's experts start and how many (sent), and where
    // the rows q sends land and how many (received).
    std::vector<std::int64_t> send_at, send_rows, recv_at, recv_rows;  // [peer]
    std::int64_t received() const { return local_offsets.back(); }
    int groups() const { return static_cast<int>(expert_of.size()); }
  };
  // Collective over the group: from `offsets` ([n_experts + 1] i32 on the backend's device, as
  // moe_permute wrote them), every rank's offsets gathered on the backend's stream and read back with
  // one copy into the backend's staging memory (pinned on CUDA: the copy is queued behind the gather,
  // where a copy into pageable memory would wait for the stream to drain before it even starts), the
  // host's only wait; this rank's own written to offsets_host.
  Plan plan(const TensorView& offsets, std::int32_t* offsets_host);
  // The grouped rows of `send` [R, C] to the ranks holding their experts, into `recv` [Rmax, C] (rows
  // laid out as the plan says; rows from plan.received() on untouched). Asynchronous on the backend's
  // stream. Names the group and the rank in errors.
  void dispatch(const TensorView& recv, const TensorView& send, const Plan& plan) const;
  // The reverse: rows `back` [Rmax, C] (laid out as dispatch received them) to the ranks they came
  // from, into `out` [R, C] at the grouped rows they were sent from.
  void combine(const TensorView& out, const TensorView& back, const Plan& plan) const;
  // dispatch and combine beside the backend's stream: queued on a stream of the group's own after the
  // work queued on the backend's stream so far, so that the work queued next runs beside the
  // exchange; join() makes the backend's stream wait for every exchange started so. Without a device
  // stream (host buffers) they run as dispatch and combine do.
  void dispatch_beside(const TensorView& recv, const TensorView& send, const Plan& plan);
  void combine_beside(const TensorView& out, const TensorView& back, const Plan& plan);
  void join();

 private:
  void exchange(const TensorView& to, const TensorView& from, const Plan& plan, bool forward, void* stream) const;
  // The plan from every rank's offsets, gathered: [ranks x (n_experts + 1)].
  Plan plan_from(const std::int32_t* gathered) const;
  void* side_stream();

  Communicator& comm_;
  ops::Backend& be_;
  int size_ = 1, rank_ = 0, n_experts_ = 0;
  Buffer offsets_all_;                // every rank's offsets, gathered (device)
  Buffer host_;                       // the same, read back (ops::Backend::alloc_host)
  std::shared_ptr<SideStream> side_;  // the exchanges beside the backend's stream (made at the first)
  bool side_pending_ = false;
};

// The rows of an experts' weight [n_experts x rows_per_expert, cols] that this rank holds: the
// experts of its EP rank, and of each its TP rank's 1/tp of every part of `parts` (an expert's rows
// in consecutive parts, e.g. SwiGLU's gate and up, each split over TP). Whole (an empty shard) on one
// rank of each.
TensorShard expert_row_shard(const TensorParallel& tp, const ExpertParallel& ep, const std::vector<std::int64_t>& parts);

}  // namespace kiln::parallel
