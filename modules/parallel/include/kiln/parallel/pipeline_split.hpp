#pragma once
// How a model's blocks split into pipeline chunks (virtual stages, pipeline_schedule.hpp): contiguous
// runs of blocks, each chunk at least one block, the embedding before the first and the output head
// and loss after the last.
#include <string>
#include <vector>

namespace kiln::parallel {

// The blocks of each chunk, in virtual-stage order, balanced by cost: the chunks' largest cost as
// small as it can be (then their costs as even as they can be), where block l costs block_cost[l],
// the first chunk also `first_cost` (the embedding) and the last also `last_cost` (the head and the
// loss). Throws kiln::Error with fewer blocks than chunks.
std::vector<int> balanced_split(const std::vector<double>& block_cost, double first_cost, double last_cost,
                                int chunks);
// Why `layers` (blocks per chunk, as parallel.pp_layers gives them) is not a split of n_blocks blocks
// into `chunks` chunks; empty when it is one.
std::string split_problem(const std::vector<int>& layers, int n_blocks, int chunks);
// The first block of each chunk, and n_blocks last: chunk c holds blocks [starts[c], starts[c + 1]).
std::vector<int> split_starts(const std::vector<int>& layers);

}  // namespace kiln::parallel
