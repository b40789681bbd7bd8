#pragma once
// Where every rank's RNG seeds come from: one place, one function.
//
// collision_free (default): each stream is identified by (kind, pp, a, b) with every field below
// 65,536, packed into 64 bits and passed through a bijective mixer keyed by the master seed.
// Distinct identities therefore always get distinct seeds, for any topology up to 65,536 ranks
// per axis. megatron: Megatron-LM's additive offsets, kept for users who must match it; they
// collide across ranks (e.g. ep_rank 17 against tp_rank 6).
#include <cstdint>
#include <boost/describe/enum.hpp>

#include "kiln/rng/tracker.hpp"

namespace kiln::rng {

// A rank's place in the job as far as seeds are concerned: its tensor-, expert- and
// pipeline-parallel ranks (its data- and context-parallel ranks never change a seed). The engine
// glue fills it from kiln::parallel's coordinates; this library does not depend on that one.
struct RankCoords {
  int tp = 0, ep = 0, pp = 0;
};

enum class SeedPolicy { collision_free, megatron };
BOOST_DESCRIBE_ENUM(SeedPolicy, collision_free, megatron)

enum class StreamKind : std::uint64_t { default_ = 0, model_parallel = 1, data_parallel = 2, expert_parallel = 3 };

// Seed of one stream for a rank at `c`. Semantics (both policies):
//   default_          equal on every rank of a pipeline stage (so on all ranks of a TP group)
//   model_parallel    differs per TP rank ("model-parallel-rng")
//   data_parallel     equal on every rank of a pipeline stage, separate from default_
//   expert_parallel   differs per (EP rank, expert-TP rank) ("expert-parallel-rng")
// Expert-TP rank is taken equal to the TP rank (kiln has no separate expert-TP size yet).
std::uint64_t stream_seed(SeedPolicy policy, std::uint64_t master_seed, StreamKind kind, const RankCoords& c);

// The 64-bit bijection used by collision_free (splitmix64's finaliser).
std::uint64_t mix64(std::uint64_t x);

// A rank's tracker: the default state and the named states of kiln's parallel layout, seeded by
// `policy` from the master seed. With `layout_invariant`, every stream is keyed as on TP, EP and
// pipeline rank 0 (shards are decorrelated by their global element indices instead, and a pipeline
// stage draws where one rank's draws would be, so every layout draws what one rank would).
RngStatesTracker make_tracker(SeedPolicy policy, bool layout_invariant, std::uint64_t master_seed,
                              const RankCoords& coords);

}  // namespace kiln::rng
