#include "kiln/nn/param_store.hpp"

#include <map>

#include "kiln/core/error.hpp"

namespace kiln::nn {

Entity ParamStore::add(World& w, Param p) {
  KILN_CHECK(units_.empty(), "parameter '", p.name, "' added after the store was laid out");
  KILN_CHECK(p.unit >= 0, "parameter '", p.name, "' has no layer unit");
  p.numel = p.shape.numel();
  Entity e = w.create(p.name);
  w.emplace<Param>(e, std::move(p));
  order_.push_back(e);
  return e;
}

void ParamStore::shard_over(int shards, int shard) {
  KILN_CHECK(units_.empty(), "the parameter store is sharded before it is laid out");
  KILN_CHECK(shards >= 1 && shard >= 0 && shard < shards, "parameter shard ", shard, " of ", shards);
  shards_[0] = shards;
  shard_[0] = shard;
  if (!experts_set_) shards_[1] = shards, shard_[1] = shard;
}

void ParamStore::shard_experts_over(int shards, int shard) {
  KILN_CHECK(units_.empty(), "the parameter store is sharded before it is laid out");
  KILN_CHECK(shards >= 1 && shard >= 0 && shard < shards, "expert parameter shard ", shard, " of ", shards);
  shards_[1] = shards;
  shard_[1] = shard;
  experts_set_ = true;
}

void ParamStore::keep_codes_apart() {
  KILN_CHECK(units_.empty(), "the parameter store keeps its one-byte compute copies apart before it is laid out");
  codes_apart_ = true;
}

void ParamStore::set_grad_dtype(DType d) {
  KILN_CHECK(d == DType::f32 || d == DType::bf16, "the held gradients are f32 or bf16, not ", name_of(d));
  KILN_CHECK(grads_.bytes() == 0, "the parameter store's gradient dtype is set before it is allocated");
  grad_dtype_ = d;
}

void ParamStore::lay_out(World& w) {
  KILN_CHECK(units_.empty(), "the parameter store is laid out once");
  std::map<int, std::vector<std::pair<Entity, Param*>>> by_unit;  // ascending units, creation order within each
  for (Entity e : order_) {
    auto& p = w.get<Param>(e);
    by_unit[p.unit].push_back({e, &p});
  }
  const int n = by_unit.empty() ? 0 : by_unit.rbegin()->first + 1;
  units_.assign(static_cast<std::size_t>(n), UnitRange{});
  groups_.assign(static_cast<std::size_t>(n), {});
  unit_held_.assign(static_cast<std::size_t>(n), 0);
  auto align = [](std::int64_t x, std::int64_t a) { return (x + a - 1) / a * a; };
  std::int64_t at = 0, held = 0, codes = 0;
  for (int u = 0; u < n; ++u) {
    units_[u].begin = at;
    unit_held_[u] = held;
    auto it = by_unit.find(u);
    // A parameter two pipeline stages hold (TiedAcrossStages) comes first, in groups of its own, so
    // that both stages hold the same part of it (their gradients are summed part by part).
    bool has_tied = false;
    if (it != by_unit.end())
      for (auto [e, p] : it->second) has_tied = has_tied || w.has<TiedAcrossStages>(e);
    // Dense before expert; in a sharded domain the one-byte compute copies are gathered apart, first.
    for (int tied_pass = has_tied ? 0 : 1; tied_pass < 2; ++tied_pass)
    for (ShardDomain domain : {ShardDomain::dense, ShardDomain::expert})
      for (bool bytes : {true, false}) {
        const int S = shards_[static_cast<int>(domain)];
        UnitGroup g{at, 0, bytes, domain, held, 0};
        if (it != by_unit.end())
          for (auto [e, p] : it->second) {
            const bool is_bytes = (S > 1 || codes_apart_) && w.has<ByteCompute>(e);
            if (domain_of(*p) != domain || is_bytes != bytes) continue;
            if (has_tied && w.has<TiedAcrossStages>(e) != (tied_pass == 0)) continue;
            p->offset = at;
            at += align(p->numel, kParamAlign);
          }
        at = align(at, kParamAlign * S);  // every rank's part of each group equal and aligned
        g.count = at - g.begin;
        if (g.count == 0) continue;
        held += g.count / S;
        if (bytes) {
          g.codes = codes;
          codes += g.count / S;
        }
        groups_[u].push_back(g);
      }
    units_[u].end = at;
  }
  total_ = at;
  held_ = held;
  held_codes_ = codes;
}

void ParamStore::allocate(HeldBuffers buffers) {
  KILN_CHECK(laid_out(), "the parameter store is allocated after lay_out()");
  const auto n = static_cast<std::size_t>(held_);
  KILN_CHECK(buffers.master.bytes() >= n * 4 && buffers.grads.bytes() >= n * size_of(grad_dtype_) &&
                 buffers.compute.bytes() >= held_compute_bytes(buffers.act),
             "the parameter store's held buffers must hold ", held_, " elements each (the compute copy ",
             held_compute_bytes(buffers.act), " bytes)");
  master_ = std::move(buffers.master);
  compute_ = std::move(buffers.compute);
  grads_ = std::move(buffers.grads);
  act_ = buffers.act;
  stream_ = buffers.stream;
  // The units' compute images: each group's elements, one byte or act-dtype each, in group order.
  // Where the held compute copy holds them: sharded, the codes end to end; with the codes apart, the
  // units' images end to end; else every element at its held index.
  std::vector<std::size_t> unit_at(units_.size(), 0);
  std::size_t images = 0;
  for (std::size_t u = 0; u < groups_.size(); ++u) {
    std::size_t image = 0;
    unit_at[u] = codes_apart_ ? images : static_cast<std::size_t>(units_[u].begin) * size_of(act_);
    for (auto& g : groups_[u]) {
      g.image = image;
      g.at = sharded() ? static_cast<std::size_t>(g.codes)
             : codes_apart_ ? images + image
                            : static_cast<std::size_t>(g.held) * size_of(act_);
      image += static_cast<std::size_t>(g.count) * (g.bytes ? 1 : size_of(act_));
    }
    images += image;
  }
  unit_compute_.assign(units_.size(), nullptr);
  unit_grads_.assign(units_.size(), nullptr);
  if (sharded()) return;  // the units are gathered, not held
  for (std::size_t u = 0; u < units_.size(); ++u) {
    unit_compute_[u] = static_cast<char*>(compute_.data()) + unit_at[u];
    unit_grads_[u] = static_cast<char*>(grads_.data()) + static_cast<std::size_t>(units_[u].begin) * size_of(grad_dtype_);
  }
}

std::int64_t ParamStore::act_at(const Param& p, const HeldPart& part) const {
  const UnitGroup& g = group_of(p);
  if (sharded() || g.bytes) return -1;
  return static_cast<std::int64_t>(g.at / size_of(act_)) + (part.held - g.held);
}

std::vector<std::pair<TensorView, TensorView>> ParamStore::act_copies() const {
  if (sharded()) return {};
  if (!codes_apart_) return {{compute_flat(), master_flat()}};
  std::vector<std::pair<TensorView, TensorView>> out;
  for (const auto& groups : groups_)
    for (const UnitGroup& g : groups)
      if (!g.bytes) out.push_back({held_compute(g), held_master(g)});
  return out;
}

void ParamStore::check_unit(int unit) const {
  KILN_CHECK(unit >= 0 && static_cast<std::size_t>(unit) < unit_compute_.size(), "layer unit ", unit,
             " of a parameter store of ", unit_compute_.size(), " allocated units");
}

void ParamStore::place_unit_compute(int unit, void* at) {
  check_unit(unit);
  unit_compute_[static_cast<std::size_t>(unit)] = at;
}

void ParamStore::place_unit_grads(int unit, void* at) {
  check_unit(unit);
  unit_grads_[static_cast<std::size_t>(unit)] = at;
}

std::vector<std::vector<UnitRange>> ParamStore::grad_zero_ranges(const World& w) const {
  std::vector<std::vector<UnitRange>> out(units_.size());
  std::vector<std::int64_t> at(units_.size(), 0);  // per unit: where the current gap starts
  auto add = [&](int u, std::int64_t begin, std::int64_t end) {
    auto& r = out[static_cast<std::size_t>(u)];
    if (end <= begin) return;
    if (!r.empty() && r.back().end == begin)
      r.back().end = end;
    else
      r.push_back({begin, end});
  };
  for (Entity e : order_) {
    if (!w.has<GradWrittenFirst>(e)) continue;
    const auto& p = w.get<Param>(e);
    const std::int64_t first = p.offset - units_[p.unit].begin;
    add(p.unit, at[p.unit], first);
    at[p.unit] = first + p.numel;
  }
  for (std::size_t u = 0; u < units_.size(); ++u) add(static_cast<int>(u), at[u], units_[u].size());
  return out;
}

std::int64_t ParamStore::held_count(int u) const {
  std::int64_t n = 0;
  for (const UnitGroup& g : groups(u)) n += g.count / shards_[static_cast<int>(g.domain)];
  return n;
}

const UnitGroup& ParamStore::group_of(const Param& p) const {
  for (const UnitGroup& g : groups(p.unit))
    if (p.offset >= g.begin && p.offset < g.begin + g.count) return g;
  KILN_THROW("parameter '", p.name, "' at ", p.offset, " lies in no group of layer unit ", p.unit);
}

std::size_t ParamStore::image_bytes(int u) const {
  std::size_t n = 0;
  for (const UnitGroup& g : groups(u)) n += static_cast<std::size_t>(g.count) * (g.bytes ? 1 : size_of(act_));
  return n;
}

TensorView ParamStore::master_view(const Param& p) const {
  KILN_CHECK(!sharded(), "parameter '", p.name, "': the master weights are sharded over ", shards_[0],
             " ranks; use its held parts (for_each_held)");
  return master_.view(DType::f32, p.shape, static_cast<std::size_t>(p.offset) * sizeof(float));
}

void* ParamStore::at_unit(const std::vector<void*>& where, const Param& p, std::size_t bytes, const char* what) const {
  KILN_CHECK(static_cast<std::size_t>(p.unit) < where.size() && where[p.unit] != nullptr, "parameter '", p.name,
             "': the ", what, " of layer unit ", p.unit, " are not on this rank now");
  const UnitRange& u = units_[p.unit];
  KILN_CHECK(p.offset >= u.begin && p.offset + p.numel <= u.end, "parameter '", p.name, "' at [", p.offset, ", ",
             p.offset + p.numel, ") exceeds its layer unit ", p.unit, " [", u.begin, ", ", u.end, ")");
  return static_cast<char*>(where[p.unit]) + bytes;
}

TensorView ParamStore::compute_view(const Param& p) const {
  const UnitGroup& g = group_of(p);
  // One-byte codes or act-dtype elements, at the element's place in its group's image.
  const std::size_t bytes = g.image + static_cast<std::size_t>(p.offset - g.begin) * (g.bytes ? 1 : size_of(act_));
  return TensorView(at_unit(unit_compute_, p, bytes, "compute weights"), p.shape, g.bytes ? DType::u8 : act_,
                    master_.device());
}

TensorView ParamStore::held_compute(const UnitGroup& g) const {
  const std::int64_t n = g.count / shards_[static_cast<int>(g.domain)];
  if (g.bytes) return TensorView(static_cast<char*>(compute_.data()) + g.at, {n}, DType::u8, compute_.device());
  KILN_CHECK(holds_act_copy(), "a sharded parameter store holds no act-dtype compute copy (group at ", g.begin,
             "): convert its held master part (held_master)");
  return TensorView(static_cast<char*>(compute_.data()) + g.at, {n}, act_, compute_.device());
}

TensorView ParamStore::held_master(const UnitGroup& g) const {
  return master_flat().flat_slice(g.held, g.count / shards_[static_cast<int>(g.domain)]);
}

std::uint8_t* ParamStore::held_codes(const Param& p, const HeldPart& part) const {
  const UnitGroup& g = group_of(p);
  KILN_CHECK(g.bytes, "parameter '", p.name, "' has no one-byte compute copy");
  return held_compute(g).as<std::uint8_t>() + (part.held - g.held);
}

TensorView ParamStore::grad_view(const Param& p) const {
  const DType d = unit_grad_dtype();
  const std::size_t bytes = static_cast<std::size_t>(p.offset - unit(p.unit).begin) * size_of(d);
  return TensorView(at_unit(unit_grads_, p, bytes, "gradients"), p.shape, d, master_.device());
}

}  // namespace kiln::nn
