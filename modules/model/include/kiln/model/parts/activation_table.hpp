#pragma once
// The model's activation memory, llm.c's one buffer carved into views: every part declares the
// tensors it needs as rows of this table, and the table decides where each lives.
//   saved             written by a block's forward, read by its backward: the block's own copy, or,
//                     where the block's backward recomputes the stage that writes it (activation
//                     checkpointing), one copy shared by every block that does, or, where the block's
//                     saved activations are offloaded to host memory (nn::ActivationOffload), the
//                     offload slot's copy, one contiguous region per slot shared by the blocks that
//                     take that slot.
//   kept              written by the forward, read by the backward, never recomputed (the residual
//                     streams, a block's saved input part): the block's or the model's own.
//   scratch           used within one pass, or refilled by the backward pass before it is read: one
//                     copy shared by every block (rows of the same key are one tensor).
//   backward scratch  used only by the blocks' backward passes: one copy per key, placed at the end
//                     of a tensor that is dead meanwhile (the logits) where it fits.
//   own               the model's own tensors (working tensors, logits, a part's state, ...).
// A pipeline rank runs several micro-batches' forwards before their backwards (pipeline_schedule.hpp):
// the saved and kept rows (those not shared) then exist once per micro-batch in flight, and
// select_copy() points them at one micro-batch's copy before its pass.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kiln/model/arena.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/ops/backend.hpp"

namespace kiln::model {

// The stages of a block's forward pass, as bits (see block.hpp).
using StageSet = unsigned;

class ActivationTable {
 public:
  // The rows one block (or the model) declares; `recomputed`: the stages its backward recomputes.
  class Rows {
   public:
    void saved(TensorView& slot, const std::string& key, DType dtype, Shape shape, StageSet stage);
    void scratch(TensorView& slot, const std::string& key, DType dtype, Shape shape);
    void backward_scratch(TensorView& slot, const std::string& key, DType dtype, Shape shape);
    void kept(TensorView& slot, DType dtype, Shape shape);
    void own(TensorView& slot, DType dtype, Shape shape);
    // Whether the block's backward pass recomputes `stage` (its saved rows then live in the copy the
    // recomputing blocks share, written again just before the block's backward reads them).
    bool recomputes(StageSet stage) const { return (recomputed_ & stage) != 0; }

   private:
    friend class ActivationTable;
    Rows(ActivationTable& table, StageSet recomputed, int block, int offload_slot)
        : table_(table), recomputed_(recomputed), block_(block), offload_slot_(offload_slot) {}
    ActivationTable& table_;
    StageSet recomputed_;
    int block_;
    int offload_slot_;
  };

  // A block's rows; `offload_slot` >= 0: its saved rows (those it does not recompute) live in that
  // offload slot's region.
  Rows block(StageSet recomputed, int offload_slot = -1) { return Rows(*this, recomputed, blocks_++, offload_slot); }
  Rows model() { return Rows(*this, 0, -1, -1); }

  // Every saved row as declared, for reports: the block that declared it (in declaration order), and
  // whether it lives in the one copy the recomputing blocks share.
  struct SavedRow {
    int block = 0;
    std::string key;
    DType dtype = DType::f32;
    Shape shape;
    bool shared = false;
    int offload_slot = -1;  // >= 0: in that offload slot's region (its contents kept in host memory)
    std::size_t bytes() const { return static_cast<std::size_t>(shape.numel()) * size_of(dtype); }
  };
  const std::vector<SavedRow>& saved_rows() const { return saved_rows_; }

  // Allocates every row but the backward scratch (slots must stay where they are until then), the
  // saved and kept rows `copies` times (copy 0 selected).
  void allocate(ops::Backend& be, int copies = 1);
  // Points the saved and kept rows at copy `copy`.
  void select_copy(int copy);
  int copies() const { return kept_.copies(); }
  // Offload slot `slot`'s region, all of its rows in one contiguous u8 tensor (after allocate).
  TensorView offload_region(int slot) const;
  // Places the backward scratch at the end of `host` (allocated by this table, and dead while the
  // blocks run their backward passes) when it fits there beside `borrow` bytes that the blocks'
  // linears may use as scratch of their own, else allocates it apart. Returns the memory lent to the
  // blocks: what `host` holds before the backward scratch (nn::BlockScratch).
  nn::BlockScratch place_backward_scratch(ops::Backend& be, const TensorView& host, std::size_t borrow);
  // Bytes a `host` needs beyond `borrow` to hold the backward scratch declared so far.
  std::size_t backward_scratch_bytes() const;
  // Bytes of activation memory: the table's buffer, and the backward scratch where it has its own.
  std::size_t bytes() const {
    std::size_t offloaded = 0;
    for (const auto& r : offload_arenas_) offloaded += r.bytes();
    return arena_.bytes() + kept_.bytes() * static_cast<std::size_t>(kept_.copies()) +
           (backward_apart_ ? backward_.bytes() : 0) + offloaded;
  }

 private:
  struct Slot {
    TensorView* view;
    DType dtype;
    Shape shape;
  };
  // Rows of one key sharing one tensor of the largest row's bytes.
  struct Shared {
    std::vector<Slot> slots;
    std::size_t bytes = 0;
    TensorView memory;
  };
  static void add(std::map<std::string, Shared>& to, const std::string& key, const Slot& s);
  static void request(Arena& arena, std::map<std::string, Shared>& rows);
  static void point(std::map<std::string, Shared>& rows);

  Arena arena_, kept_, backward_;
  std::map<std::string, Shared> recomputed_, scratch_, backward_rows_;
  // Per offload slot: its rows (by key, shared by the blocks that take the slot) and their memory.
  std::vector<std::map<std::string, Shared>> offloaded_;
  std::vector<Arena> offload_arenas_;
  std::vector<SavedRow> saved_rows_;
  int blocks_ = 0;
  bool backward_apart_ = false;
};

}  // namespace kiln::model
