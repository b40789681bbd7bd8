#pragma once
// The pipeline-parallel group as a model sees it: the ranks holding the other stages of the model
// (pipeline_schedule.hpp), with which a stage trades activations and gradients point to point and
// agrees on what only one stage computes (the loss, on the last).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kiln/parallel/communicator.hpp"
#include "kiln/parallel/grad_buckets.hpp"
#include "kiln/parallel/pipeline_schedule.hpp"
#include "kiln/parallel/stream_event.hpp"

namespace kiln::parallel {

class PipelineParallel {
 public:
  // `comm`: the ranks that differ only in pipeline rank, in pipeline-rank order (its size is pp).
  explicit PipelineParallel(Communicator& comm) : comm_(comm) {}
  int size() const { return comm_.size(); }
  int rank() const { return comm_.rank(); }
  bool first() const { return rank() == 0; }
  bool last() const { return rank() == size() - 1; }

  // The buffer a message of a call is sent from (`send`) or received into.
  using Buffers = std::function<TensorView(const PipelineMessage& m, bool send)>;
  // One grouped call of a schedule (pipeline_transfers) on `stream`, with the buffers `buffers` names.
  void transfer(const PipelineTransfers& call, const Buffers& buffers, void* stream) const;

  // Transfers overlapped with compute. On a device the calls run on the pipeline's own stream, each
  // after the work queued on `compute` so far, and the compute stream goes on without them: a pass
  // waits only for what it receives (wait_posted), a buffer being sent is rewritten only after
  // mark_posted's event. Without a device stream (host buffers) a call runs at once, as transfer.
  // Since the calls keep their order and each only loses the compute stream's wait, no call can
  // deadlock that transfer's order did not (check_pipeline_transfers).
  void post(const PipelineTransfers& call, const Buffers& buffers, void* compute);
  // Work queued on `compute` from now on runs after every call posted so far.
  void wait_posted(void* compute);
  // Marks the calls posted so far in `done` (for the compute stream to wait on later).
  void mark_posted(StreamEvent& done) const;
  // Forward only (evaluation): the activation entering virtual stage v from the rank of v - 1, and
  // the one leaving it for the rank of v + 1.
  void receive_activation(int v, const TensorView& into, void* stream) const;
  void send_activation(int v, const TensorView& from, void* stream) const;
  // The last stage's host value on every stage (its bits); synchronous.
  double from_last(double value) const;
  // Every stage's `mine` (the same length on each), by pipeline rank; exact (bytes).
  std::vector<std::vector<std::int64_t>> gather(const std::vector<std::int64_t>& mine) const;
  // Adds the peer stage's `grad` to this one's, in place, the same sum on both (a parameter both
  // stages hold: the tied embedding of the first stage and the head of the last). `scratch` holds the
  // peer's copy on the way.
  void sum_with(int peer, const TensorView& grad, const TensorView& scratch, void* stream, const std::string& what,
                const std::function<void(const TensorView& into, const TensorView& other)>& add) const;

 private:
  int rank_of(int virtual_stage) const { return virtual_stage % size(); }
  Communicator& comm_;
  std::unique_ptr<SideStream> side_;  // the posted calls' stream (made at the first post on a device)
  bool unwaited_ = false;             // calls posted since the compute stream last waited for them
};

}  // namespace kiln::parallel
