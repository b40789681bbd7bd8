#include <cmath>

#include "cpu_backend.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/ops/grad_staging.hpp"

namespace kiln::ops::cpu {

void CpuBackend::layernorm_forward(const LayerNormForward& a) {
  Timer timer(*this, "layernorm_forward");
  const RowDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, C = d.C;
  const float *x = a.x.as<float>(), *w = a.weight.as<float>(), *b = a.bias.as<float>();
  float *out = a.out.as<float>(), *mean = a.mean.as<float>(), *rstd = a.rstd.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    float m = 0, s = 0;
    layernorm_row_stats(xr, C, a.eps, m, s);
    for (std::int64_t c = 0; c < C; ++c) out[n * C + c] = store(layernorm_apply(xr[c], m, s, w[c], b[c]));
    mean[n] = m;
    rstd[n] = s;
  }
}

void CpuBackend::layernorm_backward(const LayerNormBackward& a) {
  Timer timer(*this, "layernorm_backward");
  const RowDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, C = d.C;
  const float *x = a.x.as<float>(), *w = a.weight.as<float>(), *dout = a.dout.as<float>();
  const float *mean = a.mean.as<float>(), *rstd = a.rstd.as<float>();
  GradStaging w_grad(a.dweight), b_grad(a.dbias);  // f32 in place, bf16 through an f32 copy
  float *dx = a.dx.as<float>(), *dw = w_grad.data(), *db = b_grad.data();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const float *xr = x + n * C, *g = dout + n * C;
    float dnorm_mean = 0, dnorm_norm_mean = 0;
    for (std::int64_t c = 0; c < C; ++c) {
      float xhat = (xr[c] - mean[n]) * rstd[n];
      float dnorm = w[c] * g[c];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * xhat;
    }
    dnorm_mean /= static_cast<float>(C);
    dnorm_norm_mean /= static_cast<float>(C);
    for (std::int64_t c = 0; c < C; ++c) {
      float xhat = (xr[c] - mean[n]) * rstd[n];
      float dnorm = w[c] * g[c];
      float d = (dnorm - dnorm_mean - xhat * dnorm_norm_mean) * rstd[n];
      dx[n * C + c] = store(dx[n * C + c] + d);
    }
  }
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t c = 0; c < C; ++c) {
    float sw = 0, sb = 0;
    for (std::int64_t n = 0; n < N; ++n) {
      float xhat = (x[n * C + c] - mean[n]) * rstd[n];
      sw += dout[n * C + c] * xhat;
      sb += dout[n * C + c];
    }
    dw[c] += sw;
    db[c] += sb;
  }
  w_grad.finish();
  b_grad.finish();
}

}  // namespace kiln::ops::cpu
