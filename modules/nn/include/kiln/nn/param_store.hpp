#pragma once
// The parameters' flat buffers, a World resource the model creates. The model registers its
// parameters (add); in Phase::setup the system "params.allocate" (the model module's) lays them out
// (lay_out) and hands the store what this rank holds (allocate). The methods say who may change
// what: the model its parameters and buffers, a sharding module (fsdp) the split and where each
// unit's whole weights and gradients live; everyone else reads.
//
// The layout: the parameters unit by unit in ascending layer unit (creation order within a unit),
// each at a multiple of kParamAlign elements. Within a unit they form groups: the dense parameters,
// then the expert-parallel ones (nn::Param::expert_parallel: a mixture of experts' weights under
// expert parallelism), and in a sharded store each of those split again into the parameters whose
// compute copy is one byte (nn::ByteCompute) and the rest. Each group is padded to a multiple of
// kParamAlign * the shards of its domain. A module that shards the parameters (fsdp) calls
// shard_over (the dense domain: the data-parallel shard group) and shard_experts_over (the expert
// domain: the expert-data-parallel shard group) before "params.allocate": then this rank holds part
// `shard` of every group of its domain, the parts laid end to end in the held buffers in layout order
// (UnitGroup::held). Unsharded, the held buffers are the whole layout.
//
// Held buffers: the f32 master weights, the compute copy and the gradients (the step's reduced
// gradient), f32 or, set before allocate (set_grad_dtype: optim.grads), bf16. Unsharded, the compute copy is the model's weights in act dtype (the optimizer writes it
// with the master). Sharded, it holds only the one-byte groups' codes (their owner, the fp8 module,
// writes them), laid end to end (UnitGroup::codes): whoever gathers an act-dtype group converts its
// held master part on the way (FSDP, as PyTorch's FSDP2 casts before its all-gather), so no rank keeps
// a second copy of its part of the weights. Where each unit's whole compute weights and gradient
// accumulation live at a moment is set by whoever provides them: the held buffers themselves when
// unsharded (allocate), gathered and per-micro-batch buffers under FSDP (place_unit_compute,
// place_unit_grads). The model reads weights and accumulates gradients through compute_view /
// grad_view and so never knows which.
//
// An unsharded store may keep the one-byte parameters' compute copies apart too (keep_codes_apart:
// fp8.keep_weight_transpose = false, FP8 weights held as their rowwise codes alone): its groups are
// split as a sharded store's, and the held compute copy is every unit's compute image end to end
// (codes one byte an element, the rest act-dtype), which the model reads in place. compute_flat()
// then views that buffer as act elements (UnitGroup::at says where each group is).
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "kiln/engine/world.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/tensor/buffer.hpp"

namespace kiln::nn {

inline constexpr std::int64_t kParamAlign = 64;  // elements: 256-byte aligned f32, 128-byte bf16

// A layer unit's elements [begin, end) of the layout.
struct UnitRange {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return end - begin; }
};

// Which shard group splits a parameter in a sharded store: the data-parallel one (dense parameters)
// or the expert-data-parallel one (nn::Param::expert_parallel).
enum class ShardDomain { dense = 0, expert = 1 };

// One of a unit's parameter groups: `count` layout elements from `begin`, of one shard domain,
// compute copy one byte (bytes) or act-dtype per element. A rank holds count / shards(domain) of
// them, from held offset `held` (and, a one-byte group, its codes from byte `codes` of the held
// compute copy). The unit's compute image (ParamStore::unit_compute) holds the group from byte
// `image` on.
struct UnitGroup {
  std::int64_t begin = 0, count = 0;
  bool bytes = false;
  ShardDomain domain = ShardDomain::dense;
  std::int64_t held = 0;
  std::size_t image = 0;
  std::int64_t codes = 0;
  std::size_t at = 0;  // byte offset of this rank's part in the held compute copy (set by allocate;
                       // a sharded store's act-dtype groups have none)
};

// A run of one parameter's elements that this rank holds: `count` elements from element `first` of
// the parameter (its flattened local tensor), at element `held` of the held buffers.
struct HeldPart {
  std::int64_t first = 0, count = 0, held = 0;
};

// The held buffers of a store: the f32 master weights and the gradients (grad_dtype()) of held()
// elements each, the compute copy of held_compute_bytes(act); made on the model's backend, master and
// gradients zeroed (padding stays zero).
struct HeldBuffers {
  Buffer master, compute, grads;
  DType act = DType::f32;
  void* stream = nullptr;  // the compute stream (cudaStream_t) that writes them; collectives use it
};

class ParamStore {
 public:
  // ---- the model, which owns the parameters ----
  // Registers a parameter as an entity named p.name (offset set later, by lay_out).
  Entity add(World& w, Param p);
  // Sets every registered parameter's offset, the units, total() and held(); allocates nothing.
  void lay_out(World& w);
  // Takes the held buffers (held() elements each) and, when unsharded, points every unit's compute
  // and gradient location at them.
  void allocate(HeldBuffers buffers);

  // ---- a module that shards the parameters (fsdp), at install, before lay_out ----
  // This rank holds part `shard` of `shards` of every dense group (and of every expert group, until
  // shard_experts_over says otherwise).
  void shard_over(int shards, int shard);
  // This rank holds part `shard` of `shards` of every expert group.
  void shard_experts_over(int shards, int shard);

  // ---- whoever materialises a unit's whole compute weights and gradient accumulation: fsdp in a
  // sharded store (its gathered and per-micro-batch buffers), allocate() in an unsharded one ----
  // The address of the unit's first layout element, or null (not on this rank now).
  void place_unit_compute(int unit, void* at);
  void place_unit_grads(int unit, void* at);

  // ---- everyone reads ----
  const std::vector<Entity>& order() const { return order_; }  // creation order (initialisation draws follow it)
  int shards() const { return shards_[0]; }  // the dense domain's
  int shard() const { return shard_[0]; }
  int shards(ShardDomain d) const { return shards_[static_cast<int>(d)]; }
  int shard(ShardDomain d) const { return shard_[static_cast<int>(d)]; }
  bool sharded() const { return shards_[0] > 1 || shards_[1] > 1; }
  static ShardDomain domain_of(const Param& p) { return p.expert_parallel ? ShardDomain::expert : ShardDomain::dense; }
  bool laid_out() const { return !units_.empty() || order_.empty(); }
  std::int64_t total() const { return total_; }  // elements of the layout, padding included
  std::int64_t held() const { return held_; }    // elements this rank holds
  const std::vector<UnitRange>& units() const { return units_; }  // by layer unit
  const UnitRange& unit(int u) const { return units_.at(static_cast<std::size_t>(u)); }
  int num_units() const { return static_cast<int>(units_.size()); }
  DType act() const { return act_; }
  void* stream() const { return stream_; }
  Device device() const { return master_.device(); }
  // Where unit u's gradient accumulation (its compute image) is now (null: not on this rank now).
  void* unit_grads(int u) const { return unit_grads_.at(static_cast<std::size_t>(u)); }
  void* unit_compute(int u) const { return unit_compute_.at(static_cast<std::size_t>(u)); }
  // Unit u's part held here: held_count elements from held_offset of the held buffers (its groups'
  // parts, one after the other).
  std::int64_t held_count(int u) const;
  std::int64_t held_offset(int u) const { return unit_held_.at(static_cast<std::size_t>(u)); }
  // Unit u's groups, in layout order (dense before expert, bytes before act); and the bytes of its
  // compute image.
  const std::vector<UnitGroup>& groups(int u) const { return groups_.at(static_cast<std::size_t>(u)); }
  // The group holding p.
  const UnitGroup& group_of(const Param& p) const;
  std::size_t image_bytes(int u) const;

  // Bytes of the held compute copy for compute dtype `act`: every held element in act dtype unsharded,
  // the one-byte groups' codes alone sharded, codes and act-dtype elements with the codes apart.
  std::size_t held_compute_bytes(DType act) const {
    if (sharded()) return static_cast<std::size_t>(held_codes_);
    return static_cast<std::size_t>(held_codes_) + static_cast<std::size_t>(held_ - held_codes_) * size_of(act);
  }
  // Before lay_out: the one-byte parameters' compute copies apart in an unsharded store too.
  void keep_codes_apart();
  // Before allocate: the held gradients' dtype, f32 (the default) or bf16 (optim.grads: Megatron's
  // bf16 gradients, 2 bytes an element less; every op adds its f32 contribution to them).
  void set_grad_dtype(DType d);
  DType grad_dtype() const { return grad_dtype_; }
  // The dtype of a unit's gradient accumulation (unit_grads, grad_view), which the ops write: the held
  // gradients' own where they are the accumulation (unsharded); f32 where a sharding module's
  // per-micro-batch buffers are (sharded: it reduces them into the held ones, in grad_dtype()).
  DType unit_grad_dtype() const { return sharded() ? DType::f32 : grad_dtype_; }
  // Whether the one-byte parameters' compute copies are codes alone (sharded, or kept apart).
  bool codes_apart() const { return sharded() || codes_apart_; }
  // Whether the held compute copy holds the act-dtype weights (an unsharded store): then whoever
  // writes the master writes them too (act_at, act_copies).
  bool holds_act_copy() const { return !sharded(); }
  TensorView master_flat() const { return master_.view(DType::f32, {held_}); }
  // The held compute copy as act elements: every held element at its own index where the codes are
  // not apart; with them apart, the units' images (an act-dtype element at act_at). Empty sharded.
  TensorView compute_flat() const {
    return holds_act_copy() ? compute_.view(act_, {static_cast<std::int64_t>(held_compute_bytes(act_) / size_of(act_))})
                            : TensorView{};
  }
  // The element of compute_flat() holding the act copy of held element `part.held` of p; -1 where
  // there is none (a one-byte parameter, a sharded store).
  std::int64_t act_at(const Param& p, const HeldPart& part) const;
  // The act-dtype compute copies and the masters they are made from, group by group (one pair, the
  // whole held buffers, where the codes are not apart; none sharded): what a new master converts.
  std::vector<std::pair<TensorView, TensorView>> act_copies() const;
  TensorView grads_flat() const { return grads_.view(grad_dtype_, {held_}); }
  // f(HeldPart) for each run of p's elements held here, in element order (one run at most per
  // parameter: its group's part is one range of the layout).
  template <class F>
  void for_each_held(const Param& p, F&& f) const {
    const UnitGroup& g = group_of(p);
    const int d = static_cast<int>(g.domain);
    const std::int64_t part = g.count / shards_[d], b = g.begin + shard_[d] * part;
    const std::int64_t lo = std::max(b, p.offset), hi = std::min(b + part, p.offset + p.numel);
    if (lo < hi) f(HeldPart{lo - p.offset, hi - lo, g.held + (lo - b)});
  }
  // The held elements `part` of a flat buffer laid out like the held ones (master, grads, moments).
  static TensorView held_view(const TensorView& flat, const HeldPart& part) { return flat.flat_slice(part.held, part.count); }

  // Per unit, the element ranges [begin, end) relative to the unit's first element that a step's
  // (or a fresh buffer's) zeroing covers: all but the parameters marked GradWrittenFirst (their
  // first micro-batch writes them), padding included; adjacent ranges merged.
  std::vector<std::vector<UnitRange>> grad_zero_ranges(const World& w) const;

  // p's whole f32 master weight (only where the store is not sharded).
  TensorView master_view(const Param& p) const;
  // p in its unit's compute weights / gradient accumulation (unit_grad_dtype()), wherever they are now.
  // (A ByteCompute parameter of a sharded store: its one-byte codes, u8, p's shape.)
  TensorView compute_view(const Param& p) const;
  TensorView grad_view(const Param& p) const;
  // A group's part of the held compute copy, as the gathers move it: act-dtype elements (unsharded),
  // or (a one-byte group) its codes. A sharded store's act-dtype groups have none: gather
  // held_master(g), converted.
  TensorView held_compute(const UnitGroup& g) const;
  // A group's part of the held master weights (f32).
  TensorView held_master(const UnitGroup& g) const;
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
  void check_unit(int unit) const;

  std::vector<Entity> order_;
  int shards_[2] = {1, 1}, shard_[2] = {0, 0};  // by ShardDomain
  bool experts_set_ = false;                     // shard_experts_over was called
  bool codes_apart_ = false;                     // keep_codes_apart was called
  std::int64_t total_ = 0, held_ = 0, held_codes_ = 0;
  std::vector<UnitRange> units_;
  std::vector<std::vector<UnitGroup>> groups_;
  std::vector<std::int64_t> unit_held_;
  Buffer master_, compute_, grads_;
  DType act_ = DType::f32;
  DType grad_dtype_ = DType::f32;
  void* stream_ = nullptr;
  std::vector<void*> unit_compute_, unit_grads_;
};

}  // namespace kiln::nn
