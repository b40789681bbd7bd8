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
  shards_ = shards;
  shard_ = shard;
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
  auto align = [](std::int64_t x, std::int64_t a) { return (x + a - 1) / a * a; };
  std::int64_t at = 0;
  for (int u = 0; u < n; ++u) {
    units_[u].begin = at;
    auto it = by_unit.find(u);
    // A sharded store gathers the one-byte compute copies apart: their parameters first.
    for (bool bytes : {true, false}) {
      if (it != by_unit.end())
        for (auto [e, p] : it->second) {
          const bool is_bytes = sharded() && w.has<ByteCompute>(e);
          if (is_bytes != bytes) continue;
          p->offset = at;
          at += align(p->numel, kParamAlign);
        }
      at = align(at, kParamAlign * shards_);  // every rank's part of each group equal and aligned
      if (bytes) units_[u].split = at;
    }
    units_[u].end = at;
  }
  total_ = at;
  held_ = total_ / shards_;
}

void ParamStore::allocate(HeldBuffers buffers) {
  KILN_CHECK(laid_out(), "the parameter store is allocated after lay_out()");
  const auto n = static_cast<std::size_t>(held_);
  KILN_CHECK(buffers.master.bytes() >= n * 4 && buffers.grads.bytes() >= n * 4 &&
                 buffers.compute.bytes() >= n * size_of(buffers.act),
             "the parameter store's held buffers must hold ", held_, " elements each");
  master_ = std::move(buffers.master);
  compute_ = std::move(buffers.compute);
  grads_ = std::move(buffers.grads);
  act_ = buffers.act;
  stream_ = buffers.stream;
  unit_compute_.assign(units_.size(), nullptr);
  unit_grads_.assign(units_.size(), nullptr);
  if (sharded()) return;  // the units are gathered, not held
  for (std::size_t u = 0; u < units_.size(); ++u) {
    unit_compute_[u] = static_cast<char*>(compute_.data()) + static_cast<std::size_t>(units_[u].begin) * size_of(act_);
    unit_grads_[u] = static_cast<char*>(grads_.data()) + static_cast<std::size_t>(units_[u].begin) * sizeof(float);
  }
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

std::vector<UnitGroup> ParamStore::groups(int u) const {
  const UnitRange& r = unit(u);
  std::vector<UnitGroup> out;
  if (r.split > r.begin) out.push_back({r.begin, r.split - r.begin, true, 0});
  if (r.end > r.split)
    out.push_back({r.split, r.end - r.split, false, static_cast<std::size_t>(r.split - r.begin)});
  return out;
}

std::size_t ParamStore::image_bytes(int u) const {
  const UnitRange& r = unit(u);
  return static_cast<std::size_t>(r.split - r.begin) + static_cast<std::size_t>(r.end - r.split) * size_of(act_);
}

TensorView ParamStore::master_view(const Param& p) const {
  KILN_CHECK(!sharded(), "parameter '", p.name, "': the master weights are sharded over ", shards_,
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
  const UnitRange& u = unit(p.unit);
  if (p.offset < u.split)  // one-byte codes, at their element's place in the group
    return TensorView(at_unit(unit_compute_, p, static_cast<std::size_t>(p.offset - u.begin), "compute weights"),
                      p.shape, DType::u8, master_.device());
  const std::size_t bytes =
      static_cast<std::size_t>(u.split - u.begin) + static_cast<std::size_t>(p.offset - u.split) * size_of(act_);
  return TensorView(at_unit(unit_compute_, p, bytes, "compute weights"), p.shape, act_, master_.device());
}

TensorView ParamStore::held_compute(const UnitGroup& g) const {
  auto* at = static_cast<char*>(compute_.data()) + static_cast<std::size_t>(g.begin / shards_) * size_of(act_);
  return TensorView(at, {g.count / shards_}, g.bytes ? DType::u8 : act_, compute_.device());
}

std::uint8_t* ParamStore::held_codes(const Param& p, const HeldPart& part) const {
  const UnitRange& u = unit(p.unit);
  KILN_CHECK(p.offset < u.split, "parameter '", p.name, "' has no one-byte compute copy");
  const UnitGroup g{u.begin, u.split - u.begin, true, 0};
  return held_compute(g).as<std::uint8_t>() + (part.held - u.begin / shards_);
}

TensorView ParamStore::grad_view(const Param& p) const {
  const std::size_t bytes = static_cast<std::size_t>(p.offset - unit(p.unit).begin) * 4;
  return TensorView(at_unit(unit_grads_, p, bytes, "gradients"), p.shape, DType::f32, master_.device());
}

}  // namespace kiln::nn
