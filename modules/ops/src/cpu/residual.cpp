#include "cpu_backend.hpp"

namespace kiln::ops::cpu {

void CpuBackend::residual_forward(const ResidualForward& a) {
  Timer timer(*this, "residual_forward");
  const RowDims dims = check_args(a, kTarget);
  const std::int64_t N = dims.N, C = dims.C;
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
  const RowDims dims = check_args(a, kTarget);
  const std::int64_t N = dims.N, C = dims.C;
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
