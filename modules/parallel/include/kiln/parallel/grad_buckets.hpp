#pragma once
// Data-parallel gradient reduction in buckets, overlapped with the backward pass (the reducer of
// PyTorch DDP, in kiln's terms). The flat gradient buffer is laid out by layer unit in ascending
// order and the backward pass finishes units in descending order, so consecutive units form
// contiguous buckets. When the last micro-batch's backward pass completes every unit of a bucket,
// the bucket's all-reduce starts on a communication stream that first waits for the compute
// stream (an event); before the optimizer, the compute stream waits for the communication stream.
// Without a device stream (the CPU backend) each bucket is reduced synchronously when it is ready.
#include <cstdint>
#include <memory>
#include <vector>

#include "kiln/parallel/communicator.hpp"

namespace kiln::parallel {

// The elements [begin, end) of the flat gradient buffer that belong to layer unit `unit`.
struct UnitSpan {
  int unit = 0;
  std::int64_t begin = 0, end = 0;
};

struct GradBucket {
  std::int64_t begin = 0, end = 0;  // elements of the flat buffer
  std::vector<int> units;           // in the order the backward pass completes them
  // Where the gaps between the units' spans are not padding (other gradients reduced elsewhere):
  // the bucket's runs of adjacent spans, each reduced apart; empty: the whole [begin, end).
  std::vector<std::pair<std::int64_t, std::int64_t>> runs;
};

// Groups the units, in backward order (descending unit), into contiguous buckets of at least
// `bucket_elems` elements each (the last may be smaller); bucket_elems <= 0 gives one bucket.
// The spans must be disjoint, contiguous per unit and laid out in ascending unit order. With
// `bridge_gaps` the gaps between spans are padding, reduced along; without, a bucket reduces its
// spans' elements only (GradBucket::runs).
std::vector<GradBucket> plan_buckets(std::vector<UnitSpan> spans, std::int64_t bucket_elems, bool bridge_gaps = true);

// A second device stream with the two waits the overlap needs. Null where there is no device.
class SideStream {
 public:
  // nullptr when `compute_stream` is null (host buffers) or kiln was built without CUDA. With
  // `high_priority` the stream has the device's greatest priority: its kernels' blocks are
  // dispatched before the compute stream's waiting ones (a collective beside a many-block GEMM).
  static std::unique_ptr<SideStream> create(void* compute_stream, bool high_priority = false);
  virtual ~SideStream() = default;
  virtual void* stream() const = 0;
  virtual void wait_for_compute() = 0;  // work queued on stream() from now on runs after the compute stream's
  virtual void compute_waits() = 0;     // compute work queued from now on runs after stream()'s
  virtual bool capturing() const = 0;   // stream() is part of a CUDA graph being captured
};

class DpGradSync {
 public:
  // Sums `grads` (f32 or bf16, flat) over `comm`, bucket by bucket. `compute_stream` is where the gradients
  // are written (nullptr for host memory).
  DpGradSync(Communicator& comm, const TensorView& grads, std::vector<GradBucket> buckets, void* compute_stream);

  // The unit's gradients are final for this step (its last micro-batch's backward pass is done).
  void unit_ready(int unit);
  // Starts what is not started yet and makes the compute stream wait for every reduction; the
  // next step starts from no bucket launched.
  void finish();
  // backend.cuda_graph: the capture of the passes that called unit_ready ends. The reductions they
  // started join the compute stream inside the graph; which buckets they were is kept.
  void capture_end();
  // The captured passes were replayed: the graph started (and joined) those buckets' reductions,
  // so finish() starts only the others, as after the captured passes.
  void replayed();

  const std::vector<GradBucket>& buckets() const { return buckets_; }
  int launched_early() const { return launched_early_; }  // buckets of the last step started before finish()

 private:
  void launch(std::size_t b);
  Communicator& comm_;
  TensorView grads_;
  std::vector<GradBucket> buckets_;
  std::vector<int> bucket_of_unit_;  // unit -> bucket (-1: none)
  std::vector<int> pending_;         // per bucket: units not ready yet
  std::vector<bool> launched_;
  std::vector<bool> captured_;       // per bucket: started inside the captured passes
  std::vector<bool> unit_done_;      // per unit: ready this step
  std::unique_ptr<SideStream> side_;
  void* compute_stream_;
  int launched_now_ = 0, launched_early_ = 0;
};

}  // namespace kiln::parallel
