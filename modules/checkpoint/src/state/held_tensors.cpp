#include "held_tensors.hpp"

#include <algorithm>
#include <numeric>

#include "kiln/nn/param_store.hpp"
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
  for (int f = 0; f < static_cast<int>(families.size()); ++f)
    for (Entity e : store.order()) {
      const auto& p = w.get<nn::Param>(e);
      store.for_each_held(p, [&](const nn::HeldPart& part) {
        HeldTensor t{families[static_cast<std::size_t>(f)] + "/" + p.name, dims(p.global_shape), f, part.held,
                     part.first, pieces_of(p.shard, p.global_shape, part.first, part.count), false};
        out.push_back(std::move(t));
        tp_writes.push_back(p.shard.sharded() || par.coords.tp == 0);
      });
    }
  // The ranks differing from this one only in their replica index (dp / shards) hold the same
  // parts: each part goes to the replica with the fewest bytes so far, biggest parts first. Every
  // replica computes the same assignment.
  const int replicas = par.dp_size() / store.shards(), replica = par.coords.dp / store.shards();
  std::vector<std::size_t> order(out.size());
  std::iota(order.begin(), order.end(), 0);
  auto bytes = [&](std::size_t i) {
    std::int64_t n = 0;
    for (auto& p : out[i].pieces) n += p.piece.numel();
    return n;
  };
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return bytes(a) > bytes(b); });
  std::vector<std::int64_t> load(static_cast<std::size_t>(replicas), 0);
  for (std::size_t i : order) {
    if (!tp_writes[i]) continue;
    const auto r = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    load[r] += bytes(i);
    out[i].writes = static_cast<int>(r) == replica;
  }
  return out;
}

}  // namespace kiln::checkpoint
