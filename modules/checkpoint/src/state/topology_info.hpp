#pragma once
// The layout a checkpoint records: the topology's sizes (and how the parameters are split), and a
// rank's coordinates in it.
#include <cstdint>
#include <map>
#include <string>

#include "kiln/engine/world.hpp"

namespace kiln::checkpoint {

// world, tp, dp, pp, cp, ep, fsdp_shards, sequence_parallel, vocab_parallel.
std::map<std::string, std::int64_t> topology_of(World& w);
// tp, dp, pp, cp, ep of this rank.
std::map<std::string, int> coords_of(World& w);

}  // namespace kiln::checkpoint
