#include <algorithm>
#include <cmath>

#include "cpu_backend.hpp"
#include "kiln/ops/formulas.hpp"

namespace kiln::ops::cpu {

namespace {
// Overwrites a row of logits with (softmax - onehot(t)) * dloss over its first Vr columns, given
// the row's logsumexp, and zeros in the padded columns; t < 0 or >= Vr: no onehot in this row.
template <class Store>
void write_grad(float* row, std::int64_t V, std::int64_t Vr, std::int64_t t, float lse, float dloss, Store store) {
  for (std::int64_t v = 0; v < Vr; ++v) row[v] = store(xent_grad(row[v], lse, v == t, dloss));
  for (std::int64_t v = Vr; v < V; ++v) row[v] = 0;
}
// An ignored row (target -1): loss 0, gradient 0.
void ignore_row(float* row, std::int64_t V, float& loss) {
  loss = 0;
  for (std::int64_t v = 0; v < V; ++v) row[v] = 0;
}
}  // namespace

void CpuBackend::cross_entropy(const CrossEntropy& a) {
  Timer timer(*this, "cross_entropy");
  const CrossEntropyDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, V = d.V;
  const std::int64_t Vr = a.vocab_real;
  float* logits = a.logits.as<float>();
  float* losses = a.losses.as<float>();
  const auto* targets = a.targets.as<std::int32_t>();
  check_targets("cross_entropy", targets, N, Vr);
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    float* row = logits + n * V;
    const int t = targets[n];
    if (t < 0) {
      ignore_row(row, V, losses[n]);
      continue;
    }
    float mx = -INFINITY;
    for (std::int64_t v = 0; v < Vr; ++v) mx = std::max(mx, row[v]);
    float sum = 0;
    for (std::int64_t v = 0; v < Vr; ++v) sum += std::exp(row[v] - mx);
    const float lse = mx + std::log(sum);
    losses[n] = lse - row[t];
    write_grad(row, V, Vr, t, lse, a.dloss, [this](float x) { return store(x); });
  }
}


void CpuBackend::cross_entropy_stats(const CrossEntropyStats& a) {
  Timer timer(*this, "cross_entropy_stats");
  const CrossEntropyDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, V = d.V;
  // This rank's real columns: [0, Vr) of its V.
  const std::int64_t Vr = std::clamp<std::int64_t>(a.vocab_real - a.vocab_begin, 0, V);
  const float* logits = a.logits.as<float>();
  float* stats = a.stats.as<float>();
  const auto* targets = a.targets.as<std::int32_t>();
  check_targets("cross_entropy_stats", targets, N, a.vocab_real);
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const float* row = logits + n * V;
    float mx = -INFINITY;
    for (std::int64_t v = 0; v < Vr; ++v) mx = std::max(mx, row[v]);
    float sum = 0;
    for (std::int64_t v = 0; v < Vr; ++v) sum += std::exp(row[v] - mx);
    const std::int64_t t = targets[n] - a.vocab_begin;
    stats[n * 3 + 0] = mx;
    stats[n * 3 + 1] = sum;
    stats[n * 3 + 2] = targets[n] >= 0 && t >= 0 && t < Vr ? row[t] : 0.0f;
  }
}

void CpuBackend::cross_entropy_finish(const CrossEntropyFinish& a) {
  Timer timer(*this, "cross_entropy_finish");
  const CrossEntropyDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, V = d.V, R = d.ranks;
  const std::int64_t Vr = std::clamp<std::int64_t>(a.vocab_real - a.vocab_begin, 0, V);
  float* logits = a.logits.as<float>();
  float* losses = a.losses.as<float>();
  const float* st = a.all_stats.as<float>();
  const auto* targets = a.targets.as<std::int32_t>();
  float* lse_out = a.lse ? a.lse.as<float>() : nullptr;
  check_targets("cross_entropy_finish", targets, N, a.vocab_real);
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    float* row = logits + n * V;
    const int t = targets[n];
    if (t < 0) {
      if (lse_out) lse_out[n] = 0;
      if (a.write_dlogits)
        ignore_row(row, V, losses[n]);
      else
        losses[n] = 0;
      continue;
    }
    // Every rank combines the ranks' statistics in rank order: identical bits everywhere.
    float mx = -INFINITY, target = 0;
    for (std::int64_t r = 0; r < R; ++r) mx = std::max(mx, st[(r * N + n) * 3]);
    float sum = 0;
    for (std::int64_t r = 0; r < R; ++r) {
      const float m = st[(r * N + n) * 3], s = st[(r * N + n) * 3 + 1];
      if (s > 0) sum += s * std::exp(m - mx);
      target += st[(r * N + n) * 3 + 2];
    }
    const float lse = mx + std::log(sum);
    losses[n] = lse - target;
    if (lse_out) lse_out[n] = lse;
    if (a.write_dlogits) write_grad(row, V, Vr, t - a.vocab_begin, lse, a.dloss, [this](float x) { return store(x); });
  }
}

}  // namespace kiln::ops::cpu
