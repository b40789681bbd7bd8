// Splitting the blocks into pipeline chunks.
#include "kiln/parallel/pipeline_split.hpp"

#include <cmath>
#include <limits>
#include <numeric>

#include "kiln/core/error.hpp"

namespace kiln::parallel {

std::vector<int> balanced_split(const std::vector<double>& block_cost, double first_cost, double last_cost,
                                int chunks) {
  const int n = static_cast<int>(block_cost.size());
  KILN_CHECK(chunks > 0, chunks, " pipeline chunks");
  KILN_CHECK(n >= chunks, n, " blocks cannot fill ", chunks, " pipeline chunks (each needs at least one)");
  std::vector<double> prefix(static_cast<std::size_t>(n) + 1, 0.0);
  for (int l = 0; l < n; ++l) prefix[l + 1] = prefix[l] + block_cost[l];
  auto cost = [&](int c, int from, int to) {  // chunk c holding blocks [from, to)
    return prefix[to] - prefix[from] + (c == 0 ? first_cost : 0.0) + (c == chunks - 1 ? last_cost : 0.0);
  };
  // best[c][i]: the first i blocks in chunks 0..c, as (largest chunk cost, sum of squared costs),
  // compared in that order (a relative tolerance keeps equal costs equal).
  struct Score {
    double max = std::numeric_limits<double>::infinity(), squares = 0;
  };
  auto better = [](const Score& a, const Score& b) {
    if (std::isinf(b.max)) return !std::isinf(a.max);
    const double tol = 1e-9 * std::max(1.0, std::max(std::abs(a.max), std::abs(b.max)));
    if (a.max < b.max - tol) return true;
    if (a.max > b.max + tol) return false;
    return a.squares < b.squares - 1e-9 * std::max(1.0, b.squares);
  };
  std::vector<std::vector<Score>> best(static_cast<std::size_t>(chunks), std::vector<Score>(static_cast<std::size_t>(n) + 1));
  std::vector<std::vector<int>> cut(static_cast<std::size_t>(chunks), std::vector<int>(static_cast<std::size_t>(n) + 1, -1));
  for (int i = 1; i <= n; ++i) best[0][i] = {cost(0, 0, i), cost(0, 0, i) * cost(0, 0, i)};
  for (int c = 1; c < chunks; ++c)
    for (int i = c + 1; i <= n; ++i)
      for (int j = c; j < i; ++j) {  // chunk c holds [j, i)
        const Score& prev = best[c - 1][j];
        const double k = cost(c, j, i);
        const Score s{std::max(prev.max, k), prev.squares + k * k};
        if (better(s, best[c][i])) {
          best[c][i] = s;
          cut[c][i] = j;
        }
      }
  std::vector<int> layers(static_cast<std::size_t>(chunks));
  for (int c = chunks - 1, i = n; c >= 0; --c) {
    const int j = c == 0 ? 0 : cut[c][i];
    layers[c] = i - j;
    i = j;
  }
  return layers;
}

std::string split_problem(const std::vector<int>& layers, int n_blocks, int chunks) {
  if (static_cast<int>(layers.size()) != chunks)
    return cat("gives ", layers.size(), " chunks' blocks, but the pipeline has ", chunks,
               " chunks (parallel.pp x parallel.vpp)");
  for (std::size_t c = 0; c < layers.size(); ++c)
    if (layers[c] < 1) return cat("gives chunk ", c, " ", layers[c], " blocks; each chunk needs at least one");
  const int sum = std::accumulate(layers.begin(), layers.end(), 0);
  if (sum != n_blocks) return cat("gives ", sum, " blocks in all, but the model has ", n_blocks, " (model.n_layer)");
  return {};
}

std::vector<int> split_starts(const std::vector<int>& layers) {
  std::vector<int> starts{0};
  for (int n : layers) starts.push_back(starts.back() + n);
  return starts;
}

}  // namespace kiln::parallel
