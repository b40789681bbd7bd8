#pragma once
// The fsdp module's machinery on one rank (see kiln/parallel/fsdp.hpp): gather buffers of compute
// weights, per-micro-batch gradient buffers, their reduce-scatter, and the order of it all on a
// communication stream beside the compute stream.
#include <cstdint>
#include <memory>
#include <vector>

#include "kiln/engine/world.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/parallel/communicator.hpp"
#include "kiln/parallel/fsdp.hpp"
#include "kiln/parallel/grad_buckets.hpp"
#include "kiln/parallel/stream_event.hpp"

namespace kiln::parallel::fsdp {

class Runner {
 public:
  // `shard`: the ranks the dense parameters are split over (this rank's index in it is the store's
  // shard); `expert_shard`: the ranks the expert-parallel parameters are split over (null: the
  // same); `replica` (hybrid_shard): the ranks holding the same part, or null.
  Runner(World& w, const FsdpConfig& cfg, Communicator& shard, Communicator* expert_shard, Communicator* replica,
         ops::Backend& backend);
  ~Runner();

  // After the store is allocated: which unit reads which, the buffers.
  void setup();
  FsdpMemory memory() const;

  void forward_begin(int unit);
  void forward_end(int unit);
  void backward_begin(int unit);
  void backward_end(int unit);
  // The step's gradients are reduced: the compute stream waits for every reduce-scatter and the
  // partial sums are added; with hybrid_shard summed over the replicas too.
  void finish_gradients();
  // The held weights changed (the optimizer stepped): gathered copies are stale.
  void weights_changed() { ++version_; }
  // backend.cuda_graph: a graph of micro-batch `micro_batch`'s passes is about to be captured or
  // launched. The compute stream waits for the communication stream's eager work (the graph's
  // branches are not ordered after it), and the events recorded outside the graph are forgotten.
  void graph_begin(int micro_batch);
  // The capture of micro-batch `micro_batch`'s passes ends. The communication
  // stream's gathers and reduce-scatters join the compute stream inside the graph, and the host state
  // the passes left (which unit is in which buffer, what is pending) is kept.
  void capture_end(int micro_batch);
  // Those passes were replayed instead of run: the host state is set as they left it (gathered
  // buffers fresh if they were then), and every event the graph recorded is recorded again after
  // it (an event last recorded inside a capture cannot be waited for outside it).
  void replayed(int micro_batch);

 private:
  struct Slot {  // a buffer of one unit's gathered compute weights
    Buffer memory;
    int unit = -1;              // whose weights it holds (-1: none)
    std::int64_t version = -1;  // of which weights
    bool in_use = false;        // gathered for a forward or backward that has not ended
    StreamEvent gathered;       // the all-gather into it (communication stream)
  };
  struct GradSlot {  // a buffer one micro-batch's unit gradients accumulate in
    Buffer memory;      // f32
    Buffer low;         // reduce_dtype bf16: the gradients converted for the reduce-scatter
    int unit = -1;      // accumulating for this unit (-1: free)
    StreamEvent reduced;  // its last reduce-scatter (communication stream)
    std::uint64_t freed = 0;  // when its last reduce-scatter was queued (Runner::reduces_)
  };
  struct Partial {  // a reduce-scatter's output waiting to be added into the held gradients
    Buffer memory;
    int unit = -1;  // -1: nothing pending
    bool overwrite = false;
    StreamEvent ready;
  };

  bool kept(int unit) const { return kept_[static_cast<std::size_t>(unit)]; }
  bool once_a_step() const { return cfg_.reduce == FsdpReduce::step; }
  Slot* slot_of(int unit);
  // Makes `unit`'s weights gathered in a slot (all-gather on the communication stream if not
  // there and fresh); `required`: fail if no slot is free, else give up quietly (a prefetch).
  Slot* gather(int unit, bool required);
  void use(int unit);       // gathered, marked in use, the compute stream waits for it
  void release(int unit);   // no longer in use (its data stays until the slot is taken)
  void prefetch(int from, int step);
  void allocate_partials();
  void assign_grads(int unit);
  void reduce(int unit);
  void add_pending();       // the pending partial sum into the held gradients (compute stream)
  Communicator& group_comm(const nn::UnitGroup& g) const {  // the shard group of g's domain
    return g.domain == nn::ShardDomain::expert && expert_shard_ ? *expert_shard_ : shard_;
  }
  TensorView held_grads(int unit) const;  // the unit's part of the held gradients

  // The host state a micro-batch's passes leave (capture_end, replayed).
  struct AfterPasses {
    struct SlotState { int unit; bool fresh, in_use; };
    struct GradState { int unit; std::uint64_t freed; };
    std::vector<SlotState> slots;
    std::vector<GradState> grads;
    int partial_unit[2] = {-1, -1};
    bool partial_overwrite[2] = {false, false};
    int next_partial = 0;
    std::uint64_t reduces = 0;
    std::vector<int> grad_slot_of, readers_left, readers_batch;
    std::vector<void*> unit_compute, unit_grads;  // the store's placements
  };
  std::vector<AfterPasses> after_passes_;  // by micro-batch

  World& w_;
  FsdpConfig cfg_;
  Communicator& shard_;
  Communicator* expert_shard_;
  Communicator* replica_;
  nn::ParamStore& store_;
  ops::Backend& be_;
  void* compute_ = nullptr;
  std::unique_ptr<SideStream> side_;
  void* comm_ = nullptr;  // the communication stream (null: host order)
  StreamEvent compute_mark_, comm_mark_;
  DType reduce_dtype_ = DType::f32;

  int units_ = 0;
  std::vector<std::vector<int>> uses_;   // per unit: the units whose weights it reads (itself first)
  std::vector<int> readers_;             // per unit: how many units read its weights
  std::vector<bool> kept_;
  std::vector<std::vector<nn::UnitRange>> zero_ranges_;
  std::vector<Slot> slots_;              // units' own first, the pool from pool_begin_
  std::vector<int> own_slot_, own_grad_;  // per unit: its own slot / grad slot, or -1 (pool)
  std::vector<GradSlot> grad_slots_;     // likewise, the pool from grad_pool_begin_
  std::size_t pool_begin_ = 0, grad_pool_begin_ = 0;
  std::vector<int> grad_slot_of_;        // per unit: the grad slot it accumulates in now, or -1
  std::vector<int> readers_left_;        // per unit: readers whose backward has not ended this micro-batch
  std::vector<int> readers_batch_;       // per unit: the micro-batch readers_left_ counts for
  Partial partials_[2];                  // allocated when first needed (micro-batches, bf16 reduction)
  Buffer partial_f32_;                   // bf16 partial sums converted before the add
  int next_partial_ = 0;
  std::int64_t max_held_ = 0;            // the largest unit part held here (a partial's elements)
  std::uint64_t reduces_ = 0;            // reduce-scatters queued so far
  std::int64_t version_ = 0;
  std::size_t gathered_bytes_ = 0, grad_buffer_bytes_ = 0;
};

}  // namespace kiln::parallel::fsdp
