#include <cmath>

#include "cpu_backend.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/ops/grad_staging.hpp"

namespace kiln::ops::cpu {

void CpuBackend::rmsnorm_forward(const RmsNormForward& a) {
  Timer timer(*this, "rmsnorm_forward");
  const RowDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, C = d.C;
  const float *x = a.x.as<float>(), *w = a.weight.as<float>();
  float *out = a.out.as<float>(), *rstd = a.rstd.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    const float r = rmsnorm_row_rstd(xr, C, a.eps);
    for (std::int64_t c = 0; c < C; ++c) out[n * C + c] = store(xr[c] * r * w[c]);
    rstd[n] = r;
  }
}

// y_c = x_c r w_c with r = (mean(x^2) + eps)^(-1/2), so dr/dx_c = -r^3 x_c / C and
//   dx_c = r w_c g_c - x_c r^3 / C * sum_k g_k w_k x_k,   dw_c = sum_n g_c x_c r.
void CpuBackend::rmsnorm_backward(const RmsNormBackward& a) {
  Timer timer(*this, "rmsnorm_backward");
  const RowDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, C = d.C;
  const float *x = a.x.as<float>(), *w = a.weight.as<float>(), *dout = a.dout.as<float>(), *rstd = a.rstd.as<float>();
  GradStaging w_grad(a.dweight);  // f32 in place, bf16 through an f32 copy
  float *dx = a.dx.as<float>(), *dw = w_grad.data();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const float *xr = x + n * C, *g = dout + n * C;
    const float r = rstd[n];
    float dot = 0;  // sum_k g_k w_k x_k
    for (std::int64_t c = 0; c < C; ++c) dot += g[c] * w[c] * xr[c];
    const float k = dot * r * r * r / static_cast<float>(C);
    for (std::int64_t c = 0; c < C; ++c) dx[n * C + c] = store(dx[n * C + c] + (r * w[c] * g[c] - xr[c] * k));
  }
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t c = 0; c < C; ++c) {
    float s = 0;
    for (std::int64_t n = 0; n < N; ++n) s += dout[n * C + c] * x[n * C + c] * rstd[n];
    dw[c] += s;
  }
  w_grad.finish();
}

}  // namespace kiln::ops::cpu
