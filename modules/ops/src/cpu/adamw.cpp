#include <cmath>

#include "cpu_backend.hpp"
#include "kiln/ops/formulas.hpp"

namespace kiln::ops::cpu {

void CpuBackend::adamw(const AdamW& a) {
  Timer timer(*this, "adamw");
  const AdamWPlan plan = check_args(a, kTarget);
  float *p = a.params.as<float>(), *g = a.grads.as<float>(), *m = a.m.as<float>(), *v = a.v.as<float>();
  float* pa = a.params_act ? a.params_act.as<float>() : nullptr;
  float bc1 = 0, bc2 = 0;
  adamw_bias_corrections(a.beta1, a.beta2, a.step, bc1, bc2);
  for (const AdamWSegment& seg : plan.segments) {
    if (!seg.update) continue;
    const float wd = seg.decay ? a.weight_decay : 0.0f;
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t i = seg.offset; i < seg.offset + seg.count; ++i) {
      adamw_update(p[i], m[i], v[i], g[i] * a.grad_scale, a.lr, a.beta1, a.beta2, a.eps, wd, bc1, bc2);
      if (pa) pa[i] = store(p[i]);
    }
  }
}

}  // namespace kiln::ops::cpu
