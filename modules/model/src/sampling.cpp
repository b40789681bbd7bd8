#include "kiln/model/sampling.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kiln/core/error.hpp"
#include "kiln/rng/philox.hpp"

namespace kiln::model {

namespace {
int argmax(std::span<const float> x) {
  return static_cast<int>(std::max_element(x.begin(), x.end()) - x.begin());  // the first of equal maxima
}

// Uniform in [0, 1) with 53 random bits.
double uniform53(std::uint64_t seed, std::uint64_t draw) {
  const std::uint64_t hi = rng::philox_u32(seed, 0, 2 * draw) >> 5, lo = rng::philox_u32(seed, 0, 2 * draw + 1) >> 6;
  return static_cast<double>((hi << 26) | lo) * (1.0 / 9007199254740992.0);
}
}  // namespace

int sample_token(std::span<const float> logits, const SamplingOptions& o, std::uint64_t draw) {
  KILN_CHECK(!logits.empty(), "sampling from an empty row of logits");
  KILN_CHECK(o.temperature >= 0 && std::isfinite(o.temperature), "sampling temperature ", o.temperature,
             " must be finite and not negative");
  KILN_CHECK(o.top_k >= 0, "sampling top_k ", o.top_k, " must not be negative");
  for (std::size_t i = 0; i < logits.size(); ++i)
    KILN_CHECK(!std::isnan(logits[i]), "the logit of token ", i, " is nan");
  if (o.temperature == 0 || o.top_k == 1) return argmax(logits);

  // The candidates: every token in id order, or the top k by logit (ties by id).
  std::vector<int> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  if (o.top_k > 0 && static_cast<std::size_t>(o.top_k) < ids.size()) {
    auto first = [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    std::partial_sort(ids.begin(), ids.begin() + o.top_k, ids.end(), first);
    ids.resize(static_cast<std::size_t>(o.top_k));
  }
  float top = -INFINITY;
  for (int i : ids) top = std::max(top, logits[i]);
  std::vector<double> weight(ids.size());
  double total = 0;
  for (std::size_t j = 0; j < ids.size(); ++j)
    total += weight[j] = std::exp((static_cast<double>(logits[ids[j]]) - top) / o.temperature);
  const double target = uniform53(o.seed, draw) * total;
  double cumulative = 0;
  for (std::size_t j = 0; j < ids.size(); ++j) {
    cumulative += weight[j];
    if (target < cumulative) return ids[j];
  }
  return ids.back();  // rounding left the target at the very end
}

}  // namespace kiln::model
