// Row groups of a grouped linear that share an expert (kiln/ops/moe.hpp).
#include <algorithm>

#include "kiln/ops/moe.hpp"

namespace kiln::ops {

std::vector<std::vector<int>> weight_grad_passes(const std::int32_t* offsets, int groups, const std::int32_t* expert_of) {
  std::vector<std::vector<int>> passes;
  std::vector<int> seen;  // groups with rows met so far, per expert
  for (int g = 0; g < groups; ++g) {
    if (offsets[g + 1] == offsets[g]) continue;
    const int e = group_expert(expert_of, g);
    if (static_cast<int>(seen.size()) <= e) seen.resize(static_cast<std::size_t>(e) + 1, 0);
    const int pass = seen[static_cast<std::size_t>(e)]++;
    if (static_cast<int>(passes.size()) <= pass) passes.resize(static_cast<std::size_t>(pass) + 1);
    passes[static_cast<std::size_t>(pass)].push_back(g);
  }
  return passes;
}

std::vector<int> experts_without_rows(const std::int32_t* offsets, int groups, const std::int32_t* expert_of,
                                      int experts) {
  std::vector<char> has_rows(static_cast<std::size_t>(experts), 0);
  for (int g = 0; g < groups; ++g)
    if (offsets[g + 1] > offsets[g]) has_rows[static_cast<std::size_t>(group_expert(expert_of, g))] = 1;
  std::vector<int> none;
  for (int e = 0; e < experts; ++e)
    if (!has_rows[static_cast<std::size_t>(e)]) none.push_back(e);
  return none;
}

}  // namespace kiln::ops
