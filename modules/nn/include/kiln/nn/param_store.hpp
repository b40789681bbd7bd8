#pragma once
// The parameters' flat buffers. A model registers its parameters (add); in Phase::setup the system
// "params.allocate" (the model module's) lays them out (lay_out) and allocates what this rank holds.
//
// The layout: the parameters unit by unit in ascending layer unit (creation order within a unit),
// each at a multiple of kParamAlign elements; each unit's range padded to a multiple of
// kParamAlign * shards. A module that shards the parameters (fsdp) sets `shards` and `shard`
// before "params.allocate": then this rank holds part `shard` of every unit's range, the parts laid
// end to end in the held buffers (unit u's part at held offset units[u].begin / shards). Unsharded,
// the held buffers are the whole layout.
//
// Held buffers: the f32 master weights, the compute copy (act dtype; the optimizer writes it with
// the master) and the f32 gradients (the step's reduced gradient). Where each unit's whole compute
// weights and gradient accumulation live at a moment (unit_compute, unit_grads) is set by whoever
// provides them: the held buffers themselves when unsharded (point_units_at_held), gathered and
// per-micro-batch buffers under FSDP. The model reads weights and accumulates gradients through
// compute_view / grad_view and so never knows which.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kiln/engine/world.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/tensor/buffer.hpp"

namespace kiln::nn {

inline constexpr std::int64_t kParamAlign = 64;  // elements: 256-byte aligned f32, 128-byte bf16

// A layer unit's elements [begin, end) of the layout. In a sharded store the parameters whose
// compute copy is one byte per element (ByteCompute) come first, in [begin, split), each group
// padded to a multiple of kParamAlign * shards; unsharded, split == begin.
struct UnitRange {
  std::int64_t begin = 0, end = 0;
  std::int64_t split = 0;
  std::int64_t size() const { return end - begin; }
};

// One of a unit's parameter groups, as a sharded store splits it: `count` layout elements from
// `begin`, compute copy one byte (bytes) or act-dtype per element. A rank holds count / shards of
// them, at held offset begin / shards. The unit's compute image (ParamStore::unit_compute) holds
// the group from byte `image` on.
struct UnitGroup {
  std::int64_t begin = 0, count = 0;
  bool bytes = false;
  std::size_t image = 0;
};

// A run of one parameter's elements that this rank holds: `count` elements from element `first` of
// the parameter (its flattened local tensor), at element `held` of the held buffers.
struct HeldPart {
  std::int64_t first = 0, count = 0, held = 0;
};

struct ParamStore {
  std::vector<Entity> order;  // parameters in creation order (initialisation draws follow it)
  int shards = 1, shard = 0;  // this rank holds part `shard` of `shards` of every unit
  // ---- set by lay_out() ----
  std::int64_t total = 0;       // elements of the layout, padding included
  std::int64_t held = 0;        // elements this rank holds: total / shards
  std::vector<UnitRange> units;  // by layer unit
  // ---- the held buffers (`held` elements each) ----
  Buffer master;   // f32
  Buffer compute;  // act dtype
  Buffer grads;    // f32
  DType act = DType::f32;
  void* stream = nullptr;  // the compute stream (cudaStream_t) that writes them; collectives use it
  // Where each unit's whole compute weights / gradient accumulation are now: the address of the
  // unit's first layout element (null: not materialised on this rank now).
  std::vector<void*> unit_compute, unit_grads;

  // Registers a parameter as an entity named p.name (offset set later, by lay_out).
  Entity add(World& w, Param p);
  // Sets every registered parameter's offset, `units`, `total` and `held`; allocates nothing.
  void lay_out(World& w);
  bool laid_out() const { return !units.empty() || order.empty(); }
  bool sharded() const { return shards > 1; }
  int num_units() const { return static_cast<int>(units.size()); }
  // Unit u's part held here: held_count elements from held_offset of the held buffers (its groups'
  // parts, one after the other).
  std::int64_t held_count(int u) const { return units[u].size() / shards; }
  std::int64_t held_offset(int u) const { return units[u].begin / shards; }
  // Unit u's groups (none, one or two), bytes first; and the bytes of its compute image.
  std::vector<UnitGroup> groups(int u) const;
  std::size_t image_bytes(int u) const;
  // Allocates the held buffers on `be` (master and gradients zeroed: padding stays zero) and, when
  // unsharded, points every unit's compute and gradient location at them.
  void allocate(ops::Backend& be);
  // Points every unit's compute and gradient location at the held buffers (unsharded stores).
  void point_units_at_held();

  TensorView master_flat() const { return master.view(DType::f32, {held}); }
  TensorView compute_flat() const { return compute.view(act, {held}); }
  TensorView grads_flat() const { return grads.view(DType::f32, {held}); }
  // f(HeldPart) for each run of p's elements held here, in element order (one run at most per
  // parameter: its group's part is one range of the layout).
  template <class F>
  void for_each_held(const Param& p, F&& f) const {
    const UnitRange& u = units[static_cast<std::size_t>(p.unit)];
    const bool first = p.offset < u.split;
    const std::int64_t gb = first ? u.begin : u.split, ge = first ? u.split : u.end, part = (ge - gb) / shards;
    const std::int64_t b = gb + shard * part;
    const std::int64_t lo = std::max(b, p.offset), hi = std::min(b + part, p.offset + p.numel);
    if (lo < hi) f(HeldPart{lo - p.offset, hi - lo, gb / shards + (lo - b)});
  }
  // The held elements `part` of a flat buffer laid out like the held ones (master, grads, moments).
  static TensorView held_view(const TensorView& flat, const HeldPart& part) { return flat.flat_slice(part.held, part.count); }

  // Per unit, the element ranges [begin, end) relative to the unit's first element that a step's
  // (or a fresh buffer's) zeroing covers: all but the parameters marked GradWrittenFirst (their
  // first micro-batch writes them), padding included; adjacent ranges merged.
  std::vector<std::vector<UnitRange>> grad_zero_ranges(const World& w) const;

  // p's whole f32 master weight (only where the store is not sharded).
  TensorView master_view(const Param& p) const;
  // p in its unit's compute weights / gradient accumulation, wherever they are now.
  // (A ByteCompute parameter of a sharded store: its one-byte codes, u8, p's shape.)
  TensorView compute_view(const Param& p) const;
  TensorView grad_view(const Param& p) const;
  // A group's part of the held compute copy, as the gathers move it: act-dtype elements, or (a
  // one-byte group) codes from the start of the group's held memory.
  TensorView held_compute(const UnitGroup& g) const;
  // The held codes of a ByteCompute parameter's held part.
  std::uint8_t* held_codes(const Param& p, const HeldPart& part) const;
  // p's view in any flat buffer laid out like the whole layout (e.g. the optimizer's moments of an
  // unsharded store).
  static TensorView view_in(const TensorView& flat, const Param& p) {
    return TensorView(static_cast<char*>(flat.data) + static_cast<std::size_t>(p.offset) * size_of(flat.dtype), p.shape,
                      flat.dtype, flat.device);
  }

 private:
  // p's unit's location in `where`, plus byte offset `bytes`, checked.
  void* at_unit(const std::vector<void*>& where, const Param& p, std::size_t bytes, const char* what) const;
};

}  // namespace kiln::nn
