#include "fsdp_runner.hpp"

#include <algorithm>

#include "kiln/core/error.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/nn/components.hpp"

namespace kiln::parallel::fsdp {

Runner::Runner(World& w, const FsdpConfig& cfg, Communicator& shard, Communicator* expert_shard, Communicator* replica,
               ops::Backend& backend)
    : w_(w),
      cfg_(cfg),
      shard_(shard),
      expert_shard_(expert_shard),
      replica_(replica),
      store_(w.resource<nn::ParamStore>()),
      be_(backend) {}

Runner::~Runner() {
  // Nothing may still read or write the buffers when they go.
  if (comm_) comm_mark_.record(comm_), comm_mark_.synchronize();
}

TensorView Runner::held_grads(int unit) const {
  return store_.grads_flat().flat_slice(store_.held_offset(unit), store_.held_count(unit));
}

void Runner::setup() {
  for (const auto d : {nn::ShardDomain::dense, nn::ShardDomain::expert}) {
    const Communicator& c = group_comm(nn::UnitGroup{.domain = d});
    KILN_CHECK(store_.shards(d) == c.size() && store_.shard(d) == c.rank(), "fsdp: the parameter store splits its ",
               d == nn::ShardDomain::dense ? "dense" : "expert", " parameters in ", store_.shards(d), " parts, part ",
               store_.shard(d), " here, but the shard group '", c.name(), "' has ", c.size(), " ranks, this one ",
               c.rank());
  }
  KILN_CHECK(store_.sharded(), "fsdp: the parameter store is not sharded");
  units_ = store_.num_units();
  compute_ = be_.stream();
  side_ = SideStream::create(compute_);
  comm_ = side_ ? side_->stream() : nullptr;
  reduce_dtype_ = cfg_.reduce_dtype == FsdpDType::bf16 ? DType::bf16 : DType::f32;
  const auto U = static_cast<std::size_t>(units_);
  auto size = [&](int u) { return store_.unit(u).size(); };

  // Which unit reads which units' weights: its own, and those its linears' parameters belong to
  // (a tied LM head reads the embeddings' unit).
  uses_.assign(U, {});
  for (int u = 0; u < units_; ++u) uses_[u] = {u};
  for (Entity e : w_.view<nn::Linear>()) {
    const auto& lin = w_.get<nn::Linear>(e);
    std::vector<Entity> params = {lin.weight};
    if (lin.bias) params.push_back(*lin.bias);
    for (Entity p : params) {
      const int pu = w_.get<nn::Param>(p).unit;
      auto& list = uses_[static_cast<std::size_t>(lin.unit)];
      if (std::find(list.begin(), list.end(), pu) == list.end()) list.push_back(pu);
    }
  }
  readers_.assign(U, 0);
  for (const auto& list : uses_)
    for (int v : list) ++readers_[static_cast<std::size_t>(v)];
  // Kept gathered from first use to last: units read by others. The last unit's backward follows its
  // forward at once, so its weights are still in their pool buffer then; it takes a buffer of its own
  // only where it is larger than the others (a large LM head of a small model), so that the pool's
  // buffers need not grow to its size.
  kept_.assign(U, false);
  std::size_t largest_other = 0;
  for (int u = 0; u + 1 < units_; ++u)
    if (readers_[u] == 1) largest_other = std::max(largest_other, store_.image_bytes(u));
  for (int u = 0; u < units_; ++u)
    kept_[u] = readers_[u] > 1 || (u == units_ - 1 && store_.image_bytes(u) > largest_other);
  zero_ranges_ = store_.grad_zero_ranges(w_);

  // Gather buffers (of a unit's compute image: its one-byte group, then the act group): kept
  // units' (every unit's with shard_grad_op) own, and a pool of prefetch + 1.
  own_slot_.assign(U, -1);
  own_grad_.assign(U, -1);
  std::size_t pool_bytes = 0;
  for (int u = 0; u < units_; ++u) {
    if (size(u) == 0) continue;
    if (kept(u) || cfg_.strategy == FsdpStrategy::shard_grad_op) {
      own_slot_[u] = static_cast<int>(slots_.size());
      slots_.push_back(Slot{be_.alloc(store_.image_bytes(u))});
    } else {
      pool_bytes = std::max(pool_bytes, store_.image_bytes(u));
    }
  }
  pool_begin_ = slots_.size();
  if (pool_bytes > 0)
    for (int i = 0; i <= cfg_.prefetch; ++i) slots_.push_back(Slot{be_.alloc(pool_bytes)});
  for (const auto& s : slots_) gathered_bytes_ += s.memory.bytes();

  // Gradient buffers: units read by several units their own (their readers' backward passes span
  // other units'), and two for the rest (one accumulating, one being reduce-scattered). The last
  // unit takes its own only where it is larger than the others (as its gather buffer above). Reduced
  // once a step, every unit keeps its own over the step.
  std::int64_t grad_pool = 0;
  auto grad_slot = [&](std::int64_t elems) {
    GradSlot g{be_.alloc(static_cast<std::size_t>(elems) * 4)};
    if (reduce_dtype_ == DType::bf16) g.low = be_.alloc(static_cast<std::size_t>(elems) * 2);
    grad_buffer_bytes_ += g.memory.bytes() + g.low.bytes();
    return g;
  };
  for (int u = 0; u < units_; ++u)
    if (size(u) > 0 && readers_[static_cast<std::size_t>(u)] == 1 && u != units_ - 1) grad_pool = std::max(grad_pool, size(u));
  const int last = units_ - 1;
  const bool last_own = last >= 0 && size(last) > 0 && (readers_[static_cast<std::size_t>(last)] > 1 || size(last) > grad_pool);
  if (!last_own && last >= 0) grad_pool = std::max(grad_pool, size(last));
  for (int u = 0; u < units_; ++u) {
    if (size(u) == 0) continue;
    max_held_ = std::max(max_held_, store_.held_count(u));
    if (readers_[static_cast<std::size_t>(u)] > 1 || (u == last && last_own) || once_a_step()) {
      own_grad_[u] = static_cast<int>(grad_slots_.size());
      grad_slots_.push_back(grad_slot(size(u)));
    }
  }
  grad_pool_begin_ = grad_slots_.size();
  if (grad_pool > 0 && !once_a_step())
    for (int i = 0; i < 2; ++i) grad_slots_.push_back(grad_slot(grad_pool));
  // The partial sums are needed only after a step's first micro-batch and by a reduction in another
  // dtype than the held gradients' (optim.grads): made then (allocate_partials), so that a step of one
  // micro-batch reducing in the held dtype holds none.
  if (reduce_dtype_ != store_.grad_dtype()) allocate_partials();
  grad_slot_of_.assign(U, -1);
  readers_left_.assign(U, 0);
  readers_batch_.assign(U, -1);
}

FsdpMemory Runner::memory() const {
  const std::size_t act = size_of(store_.act());
  const auto held = static_cast<std::size_t>(store_.held()), total = static_cast<std::size_t>(store_.total());
  FsdpMemory m;
  // The f32 master part and the one-byte groups' codes (act-dtype weights are converted as they are
  // gathered, not kept).
  m.params = held * 4 + store_.held_compute_bytes(store_.act());
  m.grads = held * size_of(store_.grad_dtype()) + grad_buffer_bytes_;
  m.gathered = gathered_bytes_;
  m.params_unsharded = total * (4 + act);  // an unsharded store: the master and the act-dtype copy
  m.grads_unsharded = total * size_of(store_.grad_dtype());
  m.shards = store_.shards();
  return m;
}

Runner::Slot* Runner::slot_of(int unit) {
  if (own_slot_[unit] >= 0) return &slots_[static_cast<std::size_t>(own_slot_[unit])];
  for (std::size_t i = pool_begin_; i < slots_.size(); ++i)
    if (slots_[i].unit == unit) return &slots_[i];
  return nullptr;
}

Runner::Slot* Runner::gather(int unit, bool required) {
  Slot* s = slot_of(unit);
  if (s && s->unit == unit && s->version == version_) return s;  // gathered (or on its way), fresh
  if (!s) {
    for (std::size_t i = pool_begin_; i < slots_.size() && !s; ++i)
      if (!slots_[i].in_use) s = &slots_[i];
    if (!s) {
      KILN_CHECK(!required, "fsdp: no free gather buffer for layer unit ", unit, " (", cfg_.prefetch + 1,
                 " buffers, all gathered for units in use)");
      return nullptr;
    }
  }
  if (s->unit >= 0 && s->unit != unit) store_.place_unit_compute(s->unit, nullptr);
  s->unit = unit;
  s->version = version_;
  s->in_use = true;
  // After everything the compute stream has queued: the optimizer's write of the held master (and
  // of the FP8 codes), and the last reads of the slot's previous unit.
  compute_mark_.record(compute_);
  compute_mark_.wait(comm_);
  // Each group's parts from every rank: one-byte codes (nn::ByteCompute) from the held compute copy,
  // or act-dtype elements converted from the held master into this rank's place of the buffer and
  // gathered there in place (no rank keeps an act-dtype copy of its part).
  const Device dev = s->memory.device();
  for (const nn::UnitGroup& g : store_.groups(unit)) {
    auto* image = static_cast<char*>(s->memory.data()) + g.image;
    if (g.bytes) {
      group_comm(g).all_gather(TensorView(image, {g.count}, DType::u8, dev), store_.held_compute(g), comm_);
      continue;
    }
    const TensorView whole(image, {g.count}, store_.act(), dev);
    const TensorView mine = whole.flat_slice(store_.shard(g.domain) * (g.count / store_.shards(g.domain)),
                                             g.count / store_.shards(g.domain));
    be_.convert_on(comm_, mine, store_.held_master(g));
    group_comm(g).all_gather(whole, mine, comm_);
  }
  s->gathered.record(comm_);
  return s;
}

void Runner::use(int unit) {
  if (store_.unit(unit).size() == 0) return;
  Slot* s = gather(unit, true);
  s->in_use = true;
  s->gathered.wait(compute_);
  store_.place_unit_compute(unit, s->memory.data());
}

void Runner::release(int unit) {
  if (Slot* s = slot_of(unit); s && s->unit == unit) s->in_use = false;  // its data stays until taken
}

void Runner::prefetch(int from, int step) {
  for (int k = 1; k <= cfg_.prefetch; ++k) {
    const int v = from + k * step;
    if (v < 0 || v >= units_) return;
    if (store_.unit(v).size() == 0) continue;
    if (!gather(v, false)) return;
  }
}

void Runner::forward_begin(int unit) {
  for (int v : uses_[static_cast<std::size_t>(unit)]) use(v);
  prefetch(unit, +1);
}

void Runner::forward_end(int unit) {
  if (cfg_.strategy != FsdpStrategy::shard_grad_op && !kept(unit)) release(unit);
}

void Runner::allocate_partials() {
  if (partials_[0].memory.bytes() > 0) return;
  for (auto& p : partials_) {
    p.memory = be_.alloc(static_cast<std::size_t>(max_held_) * size_of(reduce_dtype_));
    grad_buffer_bytes_ += p.memory.bytes();
  }
  if (reduce_dtype_ != store_.grad_dtype()) {  // a partial or the held part widened, to add in f32
    partial_f32_ = be_.alloc(static_cast<std::size_t>(max_held_) * 4);
    grad_buffer_bytes_ += partial_f32_.bytes();
  }
}

void Runner::assign_grads(int unit) {
  if (store_.unit(unit).size() == 0) return;
  const int micro_batch = w_.resource<RunControl>().micro_batch;
  if (grad_slot_of_[unit] >= 0) {
    // Accumulating already: for another reader this micro-batch, or (once a step) since an earlier
    // micro-batch, whose buffer the linears add to.
    if (readers_batch_[unit] != micro_batch) readers_left_[unit] = readers_[unit];
    readers_batch_[unit] = micro_batch;
    return;
  }
  // Of the free pool buffers the one whose reduce-scatter was queued first: the unit just reduced
  // is still being reduce-scattered, and writing into its buffer would make the compute stream wait
  // for that (a whole reduce-scatter per unit, exposed).
  int g = own_grad_[unit];
  for (std::size_t i = grad_pool_begin_; i < grad_slots_.size() && own_grad_[unit] < 0; ++i)
    if (grad_slots_[i].unit < 0 && (g < 0 || grad_slots_[i].freed < grad_slots_[static_cast<std::size_t>(g)].freed))
      g = static_cast<int>(i);
  KILN_CHECK(g >= 0, "fsdp: no free gradient buffer for layer unit ", unit);
  GradSlot& slot = grad_slots_[static_cast<std::size_t>(g)];
  slot.reduced.wait(compute_);  // its last reduce-scatter has read it
  slot.unit = unit;
  grad_slot_of_[unit] = g;
  readers_left_[unit] = readers_[unit];
  readers_batch_[unit] = micro_batch;
  // A fresh micro-batch's buffer: the first micro-batch writes the gradients their linears write
  // first (nn::GradWrittenFirst), the others add to them.
  const std::int64_t n = store_.unit(unit).size();
  auto* base = static_cast<float*>(slot.memory.data());
  const Device dev = slot.memory.device();
  if (micro_batch == 0) {
    for (const auto& r : zero_ranges_[static_cast<std::size_t>(unit)])
      be_.zero(TensorView(base + r.begin, {r.size()}, DType::f32, dev));
  } else {
    be_.zero(TensorView(base, {n}, DType::f32, dev));
  }
  store_.place_unit_grads(unit, base);
}

void Runner::backward_begin(int unit) {
  for (int v : uses_[static_cast<std::size_t>(unit)]) {
    use(v);
    assign_grads(v);
  }
  prefetch(unit, -1);
}

void Runner::backward_end(int unit) {
  for (int v : uses_[static_cast<std::size_t>(unit)]) {
    if (store_.unit(v).size() == 0) continue;
    KILN_CHECK(readers_left_[v] > 0, "fsdp: layer unit ", v, "'s gradients reduced twice in one micro-batch");
    if (--readers_left_[v] > 0) continue;
    const auto& run = w_.resource<RunControl>();
    if (!once_a_step() || run.micro_batch == run.micro_batches - 1) reduce(v);
    release(v);  // the last reader is done with its weights too
  }
  release(unit);
}

void Runner::reduce(int unit) {
  GradSlot& g = grad_slots_[static_cast<std::size_t>(grad_slot_of_[unit])];
  const std::int64_t n = store_.unit(unit).size();
  const bool first = once_a_step() || w_.resource<RunControl>().micro_batch == 0;  // the step's only or first
  TensorView in = g.memory.view(DType::f32, {n});
  if (reduce_dtype_ == DType::bf16) {
    const TensorView low = g.low.view(DType::bf16, {n});
    be_.convert(low, in);
    in = low;
  }
  // The step's first micro-batch writes this rank's part of the gradients; the others (and a reduction
  // in another dtype than the held gradients') go through a partial sum, added on the compute stream
  // later (add_pending).
  TensorView out;
  Partial* partial = nullptr;
  if (first && reduce_dtype_ == store_.grad_dtype()) {
    out = held_grads(unit);
  } else {
    allocate_partials();
    add_pending();
    partial = &partials_[next_partial_];
    next_partial_ ^= 1;
    partial->unit = unit;
    partial->overwrite = first;
    out = partial->memory.view(reduce_dtype_, {store_.held_count(unit)});
  }
  compute_mark_.record(compute_);
  compute_mark_.wait(comm_);
  // Group by group, each over its domain's shard group: a rank's part of the unit is its part of
  // each group, one after the other.
  const std::int64_t first_element = store_.unit(unit).begin, first_held = store_.held_offset(unit);
  for (const nn::UnitGroup& grp : store_.groups(unit)) {
    const std::int64_t at = grp.begin - first_element, S = store_.shards(grp.domain);
    group_comm(grp).reduce_scatter(out.flat_slice(grp.held - first_held, grp.count / S), in.flat_slice(at, grp.count),
                                   ReduceOp::sum, comm_);
  }
  g.reduced.record(comm_);
  if (partial) partial->ready.record(comm_);
  store_.place_unit_grads(unit, nullptr);
  grad_slot_of_[unit] = -1;
  g.unit = -1;
  g.freed = ++reduces_;
}

// Each partial sum into the held gradients: written (the step's first micro-batch) or added, an f32
// partial into bf16 gradients added in f32 and rounded once, a bf16 partial into f32 ones widened first.
void Runner::add_pending() {
  for (auto& p : partials_) {
    if (p.unit < 0) continue;
    p.ready.wait(compute_);
    const std::int64_t n = store_.held_count(p.unit);
    const TensorView dst = held_grads(p.unit);
    const TensorView src = p.memory.view(reduce_dtype_, {n});
    if (p.overwrite) {
      if (src.dtype == dst.dtype)
        be_.copy(dst, src);
      else
        be_.convert(dst, src);
    } else if (src.dtype == dst.dtype) {
      be_.add(dst, src);
    } else {
      const TensorView wide = partial_f32_.view(DType::f32, {n});
      if (dst.dtype == DType::f32) {  // a bf16 partial
        be_.convert(wide, src);
        be_.add(dst, wide);
      } else {  // an f32 partial into bf16 gradients
        be_.convert(wide, dst);
        be_.add(wide, src);
        be_.convert(dst, wide);
      }
    }
    p.unit = -1;
  }
}

void Runner::finish_gradients() {
  for (int u = 0; u < units_; ++u)
    KILN_CHECK(grad_slot_of_[u] < 0, "fsdp: layer unit ", u, "'s gradients were never reduced this step (",
               readers_left_[u], " of its readers did not end their backward pass)");
  add_pending();
  comm_mark_.record(comm_);
  comm_mark_.wait(compute_);
  if (replica_ && replica_->size() > 1) replica_->all_reduce(store_.grads_flat(), ReduceOp::sum, compute_);
}

void Runner::graph_begin(int) {
  comm_mark_.record(comm_);
  comm_mark_.wait(compute_);
  for (Slot& sl : slots_) sl.gathered.forget();
  for (GradSlot& g : grad_slots_) g.reduced.forget();
  for (Partial& p : partials_) p.ready.forget();
}

void Runner::capture_end(int micro_batch) {
  if (side_ && side_->capturing()) {
    comm_mark_.record(comm_);
    comm_mark_.wait(compute_);
  }
  if (after_passes_.size() <= static_cast<std::size_t>(micro_batch))
    after_passes_.resize(static_cast<std::size_t>(micro_batch) + 1);
  AfterPasses& a = after_passes_[static_cast<std::size_t>(micro_batch)];
  a.slots.clear();
  for (const Slot& sl : slots_) a.slots.push_back({sl.unit, sl.version == version_, sl.in_use});
  a.grads.clear();
  for (const GradSlot& g : grad_slots_) a.grads.push_back({g.unit, g.freed});
  for (int i = 0; i < 2; ++i) {
    a.partial_unit[i] = partials_[i].unit;
    a.partial_overwrite[i] = partials_[i].overwrite;
  }
  a.next_partial = next_partial_;
  a.reduces = reduces_;
  a.grad_slot_of = grad_slot_of_;
  a.readers_left = readers_left_;
  a.readers_batch = readers_batch_;
  a.unit_compute.clear();
  a.unit_grads.clear();
  for (int u = 0; u < units_; ++u) {
    a.unit_compute.push_back(store_.unit_compute(u));
    a.unit_grads.push_back(store_.unit_grads(u));
  }
}

void Runner::replayed(int micro_batch) {
  KILN_CHECK(static_cast<std::size_t>(micro_batch) < after_passes_.size() &&
                 after_passes_[static_cast<std::size_t>(micro_batch)].slots.size() == slots_.size(),
             "fsdp: micro-batch ", micro_batch, "'s passes replayed without a capture");
  const AfterPasses& a = after_passes_[static_cast<std::size_t>(micro_batch)];
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    Slot& sl = slots_[i];
    sl.unit = a.slots[i].unit;
    sl.version = a.slots[i].fresh ? version_ : -1;
    sl.in_use = a.slots[i].in_use;
    sl.gathered.record(compute_);
  }
  for (std::size_t i = 0; i < grad_slots_.size(); ++i) {
    grad_slots_[i].unit = a.grads[i].unit;
    grad_slots_[i].freed = a.grads[i].freed;
    grad_slots_[i].reduced.record(compute_);
  }
  for (int i = 0; i < 2; ++i) {
    partials_[i].unit = a.partial_unit[i];
    partials_[i].overwrite = a.partial_overwrite[i];
    partials_[i].ready.record(compute_);
  }
  next_partial_ = a.next_partial;
  reduces_ = a.reduces;
  grad_slot_of_ = a.grad_slot_of;
  readers_left_ = a.readers_left;
  readers_batch_ = a.readers_batch;
  for (int u = 0; u < units_; ++u) {
    store_.place_unit_compute(u, a.unit_compute[static_cast<std::size_t>(u)]);
    store_.place_unit_grads(u, a.unit_grads[static_cast<std::size_t>(u)]);
  }
}

}  // namespace kiln::parallel::fsdp
