#include "kiln/rng/seed_policy.hpp"

#include "kiln/core/error.hpp"

namespace kiln::rng {

std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

std::uint64_t stream_seed(SeedPolicy policy, std::uint64_t master_seed, StreamKind kind, const RankCoords& c) {
  const std::uint64_t pp = static_cast<std::uint64_t>(c.pp);
  std::uint64_t a = 0, b = 0;
  switch (kind) {
    case StreamKind::default_:
    case StreamKind::data_parallel: break;
    case StreamKind::model_parallel: a = static_cast<std::uint64_t>(c.tp); break;
    case StreamKind::expert_parallel:
      a = static_cast<std::uint64_t>(c.ep);
      b = static_cast<std::uint64_t>(c.tp);
      break;
  }
  if (policy == SeedPolicy::megatron) {
    // megatron/core/tensor_parallel/random.py: model_parallel_cuda_manual_seed, with the
    // +100 * pp_rank that megatron/training/initialize.py adds to the seed first.
    const std::uint64_t base = master_seed + 100 * pp;
    switch (kind) {
      case StreamKind::default_: return base;
      case StreamKind::data_parallel: return base;
      case StreamKind::model_parallel: return base + 2718 + a;
      case StreamKind::expert_parallel: return base + 1024 + 100 * a + b;
    }
  }
  if (pp >= 65536 || a >= 65536 || b >= 65536)
    KILN_THROW("rank coordinates must stay below 65536 for the collision-free seed policy");
  const std::uint64_t identity = (static_cast<std::uint64_t>(kind) << 48) | (pp << 32) | (a << 16) | b;
  // mix64 is a bijection, so distinct identities (under one master seed) give distinct seeds.
  return mix64(identity ^ mix64(master_seed ^ 0x6b696c6e5f726e67ULL));  // "kiln_rng"
}

RngStatesTracker make_tracker(SeedPolicy policy, bool layout_invariant, std::uint64_t master_seed,
                              const RankCoords& coords) {
  // Layout-invariant streams are the same on every tensor-, expert- and pipeline-parallel rank: draws
  // are placed by global element index, and a pipeline stage's draws where one rank's would be.
  RankCoords sharded = coords;
  if (layout_invariant) sharded.tp = sharded.ep = sharded.pp = 0;
  RngStatesTracker t(stream_seed(policy, master_seed, StreamKind::default_, sharded));
  t.add(kModelParallelRng, stream_seed(policy, master_seed, StreamKind::model_parallel, sharded));
  t.add(kDataParallelRng, stream_seed(policy, master_seed, StreamKind::data_parallel, sharded));
  t.add(kExpertParallelRng, stream_seed(policy, master_seed, StreamKind::expert_parallel, sharded));
  return t;
}

}  // namespace kiln::rng
