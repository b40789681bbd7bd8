#include "cpu_backend.hpp"

namespace kiln::ops::cpu {

void CpuBackend::residual_forward(const ResidualForward& a) {
  Timer timer(*this, "residual_forward");
  KILN_CHECK(a.x.ndim() == 2, "residual_forward: x must be [N, C], got ", a.x.str());
  const std::int64_t N = a.x.size(0), C = a.x.size(1);
  expect_tensor(a.out, DType::f32, {N, C}, "residual_forward out");
  expect_tensor(a.residual, DType::f32, {N, C}, "residual_forward residual");
  expect_tensor(a.x, DType::f32, {N, C}, "residual_forward x");
  const float *r = a.residual.as<float>(), *x = a.x.as<float>();
  float* out = a.out.as<float>();
  const auto& d = a.dropout;
  const std::uint32_t threshold = rng::dropout_threshold(d.p);
  const float keep_scale = d.p > 0 ? 1.0f / (1.0f - d.p) : 1.0f;
  const std::uint64_t start = d.rng.start();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t c = 0; c < C; ++c) {
      float v = x[n * C + c];
      if (d.p > 0) {
        auto u = rng::philox_u32(d.rng.seed, start, dropout_index(d, n, c, C));
        v = rng::dropout_keep(u, threshold) ? v * keep_scale : 0.0f;
      }
      out[n * C + c] = store(r[n * C + c] + v);
    }
}

void CpuBackend::dropout_backward(const DropoutBackward& a) {
  Timer timer(*this, "dropout_backward");
  KILN_CHECK(a.dout.ndim() == 2, "dropout_backward: dout must be [N, C], got ", a.dout.str());
  const std::int64_t N = a.dout.size(0), C = a.dout.size(1);
  expect_tensor(a.dx, DType::f32, {N, C}, "dropout_backward dx");
  expect_tensor(a.dout, DType::f32, {N, C}, "dropout_backward dout");
  const float* g = a.dout.as<float>();
  float* dx = a.dx.as<float>();
  const auto& d = a.dropout;
  const std::uint32_t threshold = rng::dropout_threshold(d.p);
  const float keep_scale = d.p > 0 ? 1.0f / (1.0f - d.p) : 1.0f;
  const std::uint64_t start = d.rng.start();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t c = 0; c < C; ++c) {
      float v = g[n * C + c];
      if (d.p > 0) {
        auto u = rng::philox_u32(d.rng.seed, start, dropout_index(d, n, c, C));
        v = rng::dropout_keep(u, threshold) ? v * keep_scale : 0.0f;
      }
      dx[n * C + c] = store(v);
    }
}

}  // namespace kiln::ops::cpu
