#include "cpu_backend.hpp"
#include "kiln/ops/formulas.hpp"

namespace kiln::ops::cpu {

void CpuBackend::swiglu_forward(const SwigluForward& a) {
  Timer timer(*this, "swiglu_forward");
  const RowDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, F = d.C;
  const float* x = a.x.as<float>();
  float* out = a.out.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t f = 0; f < F; ++f) out[n * F + f] = store(swiglu(x[n * 2 * F + f], x[n * 2 * F + F + f]));
}

void CpuBackend::swiglu_backward(const SwigluBackward& a) {
  Timer timer(*this, "swiglu_backward");
  const RowDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, F = d.C;
  const float *x = a.x.as<float>(), *dout = a.dout.as<float>();
  float* dx = a.dx.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t f = 0; f < F; ++f) {
      const float g = x[n * 2 * F + f], u = x[n * 2 * F + F + f], go = dout[n * F + f];
      dx[n * 2 * F + f] = store(dswiglu_gate(go, g, u));
      dx[n * 2 * F + F + f] = store(dswiglu_up(go, g));
    }
}

}  // namespace kiln::ops::cpu
