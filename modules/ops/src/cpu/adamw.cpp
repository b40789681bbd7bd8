#include <cmath>

#include "cpu_backend.hpp"
#include "kiln/ops/formulas.hpp"

namespace kiln::ops::cpu {

void CpuBackend::adamw(const AdamW& a) {
  Timer timer(*this, "adamw");
  const std::int64_t P = a.params.numel();
  expect_tensor(a.params, DType::f32, {P}, "adamw params");
  expect_tensor(a.grads, DType::f32, {P}, "adamw grads");
  expect_tensor(a.m, DType::f32, {P}, "adamw m");
  expect_tensor(a.v, DType::f32, {P}, "adamw v");
  if (a.params_act) expect_tensor(a.params_act, DType::f32, {P}, "adamw params_act");
  float *p = a.params.as<float>(), *g = a.grads.as<float>(), *m = a.m.as<float>(), *v = a.v.as<float>();
  float* pa = a.params_act ? a.params_act.as<float>() : nullptr;
  float bc1 = 0, bc2 = 0;
  adamw_bias_corrections(a.beta1, a.beta2, a.step, bc1, bc2);
  std::int64_t covered = 0;
  for (auto& seg : a.segments) {
    KILN_CHECK(seg.offset >= 0 && seg.offset + seg.count <= P, "adamw segment out of range");
    covered += seg.count;
    if (!seg.update) continue;
    const float wd = seg.decay ? a.weight_decay : 0.0f;
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t i = seg.offset; i < seg.offset + seg.count; ++i) {
      adamw_update(p[i], m[i], v[i], g[i] * a.grad_scale, a.lr, a.beta1, a.beta2, a.eps, wd, bc1, bc2);
      if (pa) pa[i] = store(p[i]);
    }
  }
  KILN_CHECK(covered == P, "adamw segments cover ", covered, " of ", P, " elements");
}

}  // namespace kiln::ops::cpu
