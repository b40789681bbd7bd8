#include "cpu_backend.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/ops/grad_staging.hpp"

namespace kiln::ops::cpu {

void CpuBackend::linear_forward(const LinearForward& a) {
  Timer timer(*this, "linear_forward");
  const LinearDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, IC = d.IC, OC = d.OC;
  const float *x = d.x.as<float>(), *w = a.weight.as<float>(), *b = a.bias ? a.bias.as<float>() : nullptr;
  float *out = a.out.as<float>(), *pre = a.pre_gelu ? a.pre_gelu.as<float>() : nullptr;
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * IC;
    for (std::int64_t o = 0; o < OC; ++o) {
      const float* wr = w + o * IC;
      float acc = 0;
#pragma omp simd reduction(+ : acc)
      for (std::int64_t i = 0; i < IC; ++i) acc += xr[i] * wr[i];
      if (b) acc += b[o];
      if (pre) {
        pre[n * OC + o] = store(acc);
        out[n * OC + o] = store(gelu(acc));
      } else {
        out[n * OC + o] = store(acc);
      }
    }
  }
}

void CpuBackend::linear_backward(const LinearBackward& a) {
  Timer timer(*this, "linear_backward");
  const LinearDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, IC = d.IC, OC = d.OC;
  const float *x = d.x.as<float>(), *w = a.weight.as<float>(), *dout = d.dout.as<float>();
  if (a.dx) {
    float* dx = a.dx.as<float>();
    const float* pre = a.dx_gelu_pre ? a.dx_gelu_pre.as<float>() : nullptr;
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t n = 0; n < N; ++n) {
      std::vector<float> acc(static_cast<std::size_t>(IC), 0.0f);
      for (std::int64_t o = 0; o < OC; ++o) {
        const float g = dout[n * OC + o];
        const float* wr = w + o * IC;
#pragma omp simd
        for (std::int64_t i = 0; i < IC; ++i) acc[i] += g * wr[i];
      }
      for (std::int64_t i = 0; i < IC; ++i)
        dx[n * IC + i] = store(pre ? acc[i] * gelu_grad(pre[n * IC + i]) : acc[i]);
    }
    if (a.dgrad_queued) a.dgrad_queued();
  }
  if (!a.dweight) return;  // dx alone
  GradStaging w_grad(a.dweight), b_grad(a.dbias);  // f32 in place, bf16 through an f32 copy
  float* dw = w_grad.data();
  float* db = b_grad.data();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t o = 0; o < OC; ++o) {
    float* dwr = dw + o * IC;
    if (a.dweight_overwrite) std::fill(dwr, dwr + IC, 0.0f);  // then the same sums as accumulating onto zeros
    float bsum = 0;
    for (std::int64_t n = 0; n < N; ++n) {
      const float g = dout[n * OC + o];
      bsum += g;
      const float* xr = x + n * IC;
#pragma omp simd
      for (std::int64_t i = 0; i < IC; ++i) dwr[i] += g * xr[i];
    }
    if (db) db[o] += bsum;
  }
  w_grad.finish();
  b_grad.finish();
}

void CpuBackend::gelu_forward(const GeluForward& a) {
  Timer timer(*this, "gelu_forward");
  const std::int64_t n = check_args(a, kTarget);
  const float* x = a.x.as<float>();
  float* out = a.out.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t i = 0; i < n; ++i) out[i] = store(gelu(x[i]));
}

void CpuBackend::gelu_backward(const GeluBackward& a) {
  Timer timer(*this, "gelu_backward");
  const std::int64_t n = check_args(a, kTarget);
  const float *x = a.x.as<float>(), *dout = a.dout.as<float>();
  float* dx = a.dx.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t i = 0; i < n; ++i) dx[i] = store(dout[i] * gelu_grad(x[i]));
}

}  // namespace kiln::ops::cpu
