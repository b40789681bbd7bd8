#include <cmath>

#include "cpu_backend.hpp"
#include "kiln/ops/formulas.hpp"

namespace kiln::ops::cpu {

void CpuBackend::rope(const Rope& a) {
  Timer timer(*this, "rope");
  const RopeDims s = check_args(a, kTarget);
  const int D = static_cast<int>(s.D), half = D / 2;
  float* x = a.x.as<float>();
  const float sign = a.inverse ? -1.0f : 1.0f;
#pragma omp parallel for collapse(2) num_threads(threads_) schedule(static)
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t t = 0; t < s.T; ++t) {
      const float pos = static_cast<float>(a.pos_offset + t);
      for (int i = 0; i < half; ++i) {
        const float angle = pos * rope_inv_freq(i, D, a.theta, a.scaling);
        const float c = std::cos(angle), sn = sign * std::sin(angle);
        for (std::int64_t h = 0; h < a.rotated_heads; ++h) {
          float* head = x + ((b * s.T + t) * s.heads + h) * D;
          const float x0 = head[i], x1 = head[i + half];
          head[i] = store(x0 * c - x1 * sn);
          head[i + half] = store(x1 * c + x0 * sn);
        }
      }
    }
}

}  // namespace kiln::ops::cpu
