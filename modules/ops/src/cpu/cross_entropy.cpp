#include <cmath>

#include "cpu_backend.hpp"

namespace kiln::ops::cpu {

void CpuBackend::cross_entropy(const CrossEntropy& a) {
  Timer timer(*this, "cross_entropy");
  const std::int64_t N = a.logits.size(0), V = a.logits.size(1);
  expect_tensor(a.logits, DType::f32, {N, V}, "cross_entropy logits");
  expect_tensor(a.losses, DType::f32, {N}, "cross_entropy losses");
  expect_tensor(a.targets, DType::i32, {N}, "cross_entropy targets");
  KILN_CHECK(a.vocab_real > 0 && a.vocab_real <= V, "cross_entropy: vocab_real ", a.vocab_real, " vs V ", V);
  const std::int64_t Vr = a.vocab_real;
  float* logits = a.logits.as<float>();
  float* losses = a.losses.as<float>();
  const auto* targets = a.targets.as<std::int32_t>();
  for (std::int64_t n = 0; n < N; ++n)
    KILN_CHECK(targets[n] >= -1 && targets[n] < Vr, "target ", targets[n], " at row ", n, " outside [0, ", Vr, ")");
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    float* row = logits + n * V;
    const int t = targets[n];
    if (t < 0) {
      losses[n] = 0;
      for (std::int64_t v = 0; v < V; ++v) row[v] = 0;
      continue;
    }
    float mx = -INFINITY;
    for (std::int64_t v = 0; v < Vr; ++v) mx = std::max(mx, row[v]);
    float sum = 0;
    for (std::int64_t v = 0; v < Vr; ++v) sum += std::exp(row[v] - mx);
    const float lse = mx + std::log(sum);
    losses[n] = lse - row[t];
    for (std::int64_t v = 0; v < Vr; ++v) {
      float prob = std::exp(row[v] - lse);
      row[v] = store((prob - (v == t ? 1.0f : 0.0f)) * a.dloss);
    }
    for (std::int64_t v = Vr; v < V; ++v) row[v] = 0;
  }
}

}  // namespace kiln::ops::cpu
