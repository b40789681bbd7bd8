#include "held_tensors.hpp"

#include <algorithm>

#include "kiln/nn/param_store.hpp"
#include "kiln/tensor/bf16.hpp"
#include "kiln/parallel/module.hpp"

namespace kiln::checkpoint {

namespace {
std::vector<std::int64_t> dims(const Shape& s) { return std::vector<std::int64_t>(s.dims.begin(), s.dims.begin() + s.ndim); }
}  // namespace

std::vector<HeldTensor> held_tensors(World& w, const std::vector<std::string>& families) {
  const auto& store = w.resource<nn::ParamStore>();
  const auto& par = w.resource<parallel::ParallelState>();
  std::vector<HeldTensor> out;
  std::vector<bool> tp_writes;
  std::vector<nn::ShardDomain> domain;
  for (int f = 0; f < static_cast<int>(families.size()); ++f)
    for (Entity e : store.order()) {
      const auto& p = w.get<nn::Param>(e);
      // A pipeline stage's copy of another stage's parameter (the tied head's table) is read, not written.
      const auto* tied = w.try_get<nn::TiedAcrossStages>(e);
      const bool copy = tied && tied->copy;
      store.for_each_held(p, [&](const nn::HeldPart& part) {
        HeldTensor t{families[static_cast<std::size_t>(f)] + "/" + p.name, dims(p.global_shape), f, part.held,
                     part.first, pieces_of(p.shard, p.global_shape, part.first, part.count), false};
        out.push_back(std::move(t));
        tp_writes.push_back(!copy && (p.shard.sharded() || par.coords.tp == 0));
        domain.push_back(nn::ParamStore::domain_of(p));
      });
    }
  // The ranks differing from this one only in their replica index hold the same parts: each part goes
  // to the replica with the fewest bytes so far, biggest parts first; every replica computes the same
  // assignment. Dense parameters' replicas: the data-parallel ranks holding the same shard (dp /
  // shards of them); an expert parameter's (expert parallelism): the expert-data-parallel ranks
  // holding the same shard of the same experts.
  auto bytes = [&](std::size_t i) {
    std::int64_t n = 0;
    for (auto& p : out[i].pieces) n += p.piece.numel();
    return n;
  };
  for (const auto d : {nn::ShardDomain::dense, nn::ShardDomain::expert}) {
    const int ranks = d == nn::ShardDomain::dense ? par.dp_size() : par.topology.sizes().dp;
    const int index = d == nn::ShardDomain::dense ? par.dp_rank() : par.coords.dp;
    const int replicas = ranks / store.shards(d), replica = index / store.shards(d);
    std::vector<std::size_t> order;
    for (std::size_t i = 0; i < out.size(); ++i)
      if (domain[i] == d) order.push_back(i);
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return bytes(a) > bytes(b); });
    std::vector<std::int64_t> load(static_cast<std::size_t>(replicas), 0);
    for (std::size_t i : order) {
      if (!tp_writes[i]) continue;
      const auto r = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      load[r] += bytes(i);
      out[i].writes = static_cast<int>(r) == replica;
    }
  }
  return out;
}

void held_to_host(ops::Backend& be, float* slot, const TensorView& held) {
  const std::int64_t n = held.numel();
  if (held.dtype == DType::f32) {
    be.copy(TensorView(slot, {n}, DType::f32, Device::cpu), held);
    return;
  }
  KILN_CHECK(held.dtype == DType::bf16, "checkpoint: a held buffer of f32 or bf16, got ", held.str());
  auto* bits = reinterpret_cast<std::uint16_t*>(slot);
  be.copy(TensorView(bits, {n}, DType::bf16, Device::cpu), held);
  // Widened from the back: element i's four bytes cover bf16 elements 2i and 2i + 1, read before.
  for (std::int64_t i = n - 1; i >= 0; --i) {
    const std::uint16_t b = bits[i];
    slot[i] = bf16_bits_to_float(b);
  }
}

void held_from_host(ops::Backend& be, const TensorView& held, float* slot) {
  const std::int64_t n = held.numel();
  if (held.dtype == DType::f32) {
    be.copy(held, TensorView(slot, {n}, DType::f32, Device::cpu));
    return;
  }
  KILN_CHECK(held.dtype == DType::bf16, "checkpoint: a held buffer of f32 or bf16, got ", held.str());
  auto* bits = reinterpret_cast<std::uint16_t*>(slot);
  // Narrowed from the front: bf16 element i's two bytes lie in f32 element i / 2, read before.
  for (std::int64_t i = 0; i < n; ++i) {
    const float f = slot[i];
    bits[i] = float_to_bf16_bits(f);
  }
  be.copy(held, TensorView(bits, {n}, DType::bf16, Device::cpu));
}

}  // namespace kiln::checkpoint
