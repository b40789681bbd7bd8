#include <cmath>

#include "cpu_backend.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/ops/grads.hpp"
#include "kiln/ops/moments.hpp"

namespace kiln::ops::cpu {

void CpuBackend::adamw(const AdamW& a) {
  Timer timer(*this, "adamw");
  const AdamWPlan plan = check_args(a, kTarget);
  float* p = a.params.as<float>();
  float* pa = a.params_act ? a.params_act.as<float>() : nullptr;
  AdamWNumbers n{a.lr, a.grad_scale, 0, 0};
  adamw_bias_corrections(a.beta1, a.beta2, a.step, n.bc1, n.bc2);
  if (!adamw_numbers(a.scalars, n)) return;  // a non-finite gradient: the step is skipped
  // Typed by the moments' storage and the gradient's (each f32 or bf16 bits).
  with_moments(a.m.dtype == DType::bf16, a.m.data, a.v.data, [&](auto* m, auto* v) {
  with_grads(a.grads.dtype == DType::bf16, a.grads.data, [&](auto* g) {
    for (const AdamWSegment& seg : plan.segments) {
      if (!seg.update) continue;
      const float wd = seg.decay ? a.weight_decay : 0.0f;
      // The segment's act copy: at the same index, elsewhere, or none.
      const bool act = pa && seg.act != AdamWSegment::kNoAct;
      const std::int64_t shift = seg.act == AdamWSegment::kActAtOffset || !act ? 0 : seg.act - seg.offset;
#pragma omp parallel for num_threads(threads_) schedule(static)
      for (std::int64_t i = seg.offset; i < seg.offset + seg.count; ++i) {
        float mi = moment_load(m, i), vi = moment_load(v, i);
        adamw_update(p[i], mi, vi, grad_load(g, i) * n.grad_scale, n.lr, a.beta1, a.beta2, a.eps, wd, n.bc1, n.bc2);
        moment_store(m, i, mi);
        moment_store(v, i, vi);
        if (act) pa[i + shift] = store(p[i]);
      }
    }
  });
  });
}

void CpuBackend::grad_clip(const GradClip& a) {
  KILN_CHECK(a.scalars && a.norm, "grad_clip: scalars and norm are required");
  if (!a.sum_squares) check_grad_tensor("grad_clip", "grads", a.grads, kTarget);  // named as grad_clip's
  const double norm = std::sqrt(a.sum_squares ? static_cast<double>(*a.sum_squares) : sum_squares(a.grads));
  *a.norm = norm;
  a.scalars[kAdamWGradScale] = grad_clip_scale(norm, a.max_norm);
}

void CpuBackend::sum_squares_parts(const SumSquaresParts& a) {
  check_args(a, kTarget);
  double total = 0;  // each counted part's sum_squares (sum_squares_each's), in order
  for (std::size_t i = 0; i < a.parts.size(); ++i)
    if (a.divisors[i] > 0) total += sum_squares(a.parts[i]) / a.divisors[i];
  *a.out.as<float>() = static_cast<float>(total);
}

}  // namespace kiln::ops::cpu
