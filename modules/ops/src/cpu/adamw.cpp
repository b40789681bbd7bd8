#include <cmath>

#include "cpu_backend.hpp"
#include "kiln/ops/formulas.hpp"

namespace kiln::ops::cpu {

void CpuBackend::adamw(const AdamW& a) {
  Timer timer(*this, "adamw");
  const AdamWPlan plan = check_args(a, kTarget);
  float *p = a.params.as<float>(), *g = a.grads.as<float>(), *m = a.m.as<float>(), *v = a.v.as<float>();
  float* pa = a.params_act ? a.params_act.as<float>() : nullptr;
  float lr = a.lr, grad_scale = a.grad_scale, bc1 = 0, bc2 = 0;
  if (a.scalars) {
    lr = a.scalars[kAdamWLr];
    grad_scale = a.scalars[kAdamWGradScale];
    bc1 = a.scalars[kAdamWBc1];
    bc2 = a.scalars[kAdamWBc2];
    if (std::isnan(grad_scale)) return;  // a non-finite gradient: the step is skipped
  } else {
    adamw_bias_corrections(a.beta1, a.beta2, a.step, bc1, bc2);
  }
  for (const AdamWSegment& seg : plan.segments) {
    if (!seg.update) continue;
    const float wd = seg.decay ? a.weight_decay : 0.0f;
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t i = seg.offset; i < seg.offset + seg.count; ++i) {
      adamw_update(p[i], m[i], v[i], g[i] * grad_scale, lr, a.beta1, a.beta2, a.eps, wd, bc1, bc2);
      if (pa) pa[i] = store(p[i]);
    }
  }
}

void CpuBackend::grad_clip(const GradClip& a) {
  KILN_CHECK(a.scalars && a.norm, "grad_clip: scalars and norm are required");
  const double norm = std::sqrt(sum_squares(a.grads));
  *a.norm = norm;
  a.scalars[kAdamWGradScale] = grad_clip_scale(norm, a.max_norm);
}

}  // namespace kiln::ops::cpu
