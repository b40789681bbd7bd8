#include <cmath>

#include "cpu_backend.hpp"
#include "kiln/ops/formulas.hpp"

namespace kiln::ops::cpu {

void CpuBackend::adamw(const AdamW& a) {
  Timer timer(*this, "adamw");
  const AdamWPlan plan = check_args(a, kTarget);
  float *p = a.params.as<float>(), *g = a.grads.as<float>(), *m = a.m.as<float>(), *v = a.v.as<float>();
  float* pa = a.params_act ? a.params_act.as<float>() : nullptr;
  AdamWNumbers n{a.lr, a.grad_scale, 0, 0};
  adamw_bias_corrections(a.beta1, a.beta2, a.step, n.bc1, n.bc2);
  if (!adamw_numbers(a.scalars, n)) return;  // a non-finite gradient: the step is skipped
  for (const AdamWSegment& seg : plan.segments) {
    if (!seg.update) continue;
    const float wd = seg.decay ? a.weight_decay : 0.0f;
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t i = seg.offset; i < seg.offset + seg.count; ++i) {
      adamw_update(p[i], m[i], v[i], g[i] * n.grad_scale, n.lr, a.beta1, a.beta2, a.eps, wd, n.bc1, n.bc2);
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
