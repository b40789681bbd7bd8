#pragma once
// What the activation_offload module does in a step: the offloaded blocks' saved activations copied to
// host memory after each one's forward pass and back into a device slot before its backward pass.
//
// Ordinal k (the k-th offloaded block, by index) writes slot k % S (S slots). Forward: block k waits
// for the copy out of its slot's previous block (k - S), runs, and its slot is copied out, except for
// the last S blocks, whose slots still hold their rows when their backward passes come (they never
// leave the device). Backward, in the reverse order: when block k's backward pass is done its slot is
// free, and block k - S's rows are copied into it at once, so that copy has the backward passes of
// the blocks between them to hide behind; block k - S's backward waits for it. Every copy a pass queues
// is waited for by the compute stream within the same pass.
//
// Under backend.cuda_graph the copies are captured with the passes (memcpy nodes on the two copy
// streams' branches of the graph) and replayed with them. The host's bookkeeping (which block each
// slot holds) ends every training pass the same way, so a replay leaves it as the capture did; what
// changes is the events: before a capture or launch the compute stream waits for the copy streams'
// eager work and the events recorded outside the graph are forgotten (a capture cannot wait for
// them; the compute stream follows them already), and after a launch they mark the compute stream
// (the graph joined every copy into it).
#include <memory>
#include <vector>

#include "kiln/ops/backend.hpp"
#include "kiln/parallel/grad_buckets.hpp"
#include "kiln/parallel/stream_event.hpp"

namespace kiln::recompute {

class OffloadRunner {
 public:
  // `units`: the offloaded layer units, ascending; `slots`: the device slots they take in turn.
  OffloadRunner(ops::Backend& be, std::vector<int> units, int slots);

  // Once the model placed the blocks' rows: each block's region (the slot's memory), and its host copy.
  void setup(std::vector<TensorView> regions);
  std::size_t host_bytes() const;
  int slots() const { return slots_; }

  // A forward pass without a backward pass (`training` false: validation) copies nothing and waits
  // for nothing: every copy a training pass queues has been waited for by the time it ends.
  void forward_begin(int unit, bool training);
  void forward_end(int unit, bool training);
  void backward_begin(int unit);
  void backward_end(int unit);
  // backend.cuda_graph (nn::PassesGraphBegin, nn::PassesCaptureEnd, nn::PassesReplayed).
  void graph_begin();
  void capture_end();
  void replayed();

  // Copies the host queued so far (both ways, all steps; a captured pass's once): for tests and reports.
  std::int64_t copies_out() const { return copies_out_; }
  std::int64_t copies_in() const { return copies_in_; }

 private:
  int ordinal(int unit) const;  // -1: the unit is not offloaded
  int slot(int k) const { return k % slots_; }
  void load(int k);  // queues block k's rows into its slot

  ops::Backend& be_;
  void* compute_;
  std::vector<int> units_;
  int slots_;
  std::vector<TensorView> regions_;  // per ordinal: its slot's memory
  std::vector<Buffer> host_;         // per ordinal, but the last `slots_` (they stay on the device)
  // Device to host, host to device; after host_, so they are synchronised before it is freed.
  std::unique_ptr<parallel::SideStream> out_, in_;
  std::vector<int> resident_;        // per slot: the ordinal whose rows it holds or receives (-1: none)
  std::vector<parallel::StreamEvent> saved_, loaded_;  // per slot: its last copy out, its last copy in
  parallel::StreamEvent fork_, join_;
  std::int64_t copies_out_ = 0, copies_in_ = 0;
};

}  // namespace kiln::recompute
