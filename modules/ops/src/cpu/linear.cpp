#include "cpu_backend.hpp"
#include "kiln/ops/formulas.hpp"

namespace kiln::ops::cpu {

void CpuBackend::linear_forward(const LinearForward& a) {
  Timer timer(*this, "linear_forward");
  KILN_CHECK(!a.x_gelu_pre && !a.x_ln,
             "linear_forward: x_gelu_pre and x_ln are for a LinearImpl that takes them, not the backend");
  const std::int64_t N = a.x.size(0), IC = a.x.size(1), OC = a.weight.size(0);
  expect_tensor(a.out, DType::f32, {N, OC}, "linear_forward out");
  expect_tensor(a.x, DType::f32, {N, IC}, "linear_forward x");
  expect_tensor(a.weight, DType::f32, {OC, IC}, "linear_forward weight");
  if (a.bias) expect_tensor(a.bias, DType::f32, {OC}, "linear_forward bias");
  if (a.pre_gelu) expect_tensor(a.pre_gelu, DType::f32, {N, OC}, "linear_forward pre_gelu");
  const float *x = a.x.as<float>(), *w = a.weight.as<float>(), *b = a.bias ? a.bias.as<float>() : nullptr;
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
  const std::int64_t N = a.x.size(0), IC = a.x.size(1), OC = a.weight.size(0);
  expect_tensor(a.dout, DType::f32, {N, OC}, "linear_backward dout");
  expect_tensor(a.x, DType::f32, {N, IC}, "linear_backward x");
  expect_tensor(a.weight, DType::f32, {OC, IC}, "linear_backward weight");
  expect_tensor(a.dweight, DType::f32, {OC, IC}, "linear_backward dweight");
  if (a.dbias) expect_tensor(a.dbias, DType::f32, {OC}, "linear_backward dbias");
  if (a.dx) expect_tensor(a.dx, DType::f32, {N, IC}, "linear_backward dx");
  if (a.dx_gelu_pre) expect_tensor(a.dx_gelu_pre, DType::f32, {N, IC}, "linear_backward dx_gelu_pre");
  KILN_CHECK(!a.dout_gelu_pre && !a.x_gelu_pre && !a.x_ln,
             "linear_backward: dout_gelu_pre, x_gelu_pre and x_ln are for a LinearImpl that takes them, not the backend");
  const float *x = a.x.as<float>(), *w = a.weight.as<float>(), *dout = a.dout.as<float>();
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
  }
  float* dw = a.dweight.as<float>();
  float* db = a.dbias ? a.dbias.as<float>() : nullptr;
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
}

void CpuBackend::gelu_forward(const GeluForward& a) {
  Timer timer(*this, "gelu_forward");
  KILN_CHECK(a.out.numel() == a.x.numel() && a.out.dtype == DType::f32 && a.x.dtype == DType::f32 &&
                 a.out.contiguous() && a.x.contiguous(),
             "gelu_forward ", a.x.str(), " -> ", a.out.str());
  const float* x = a.x.as<float>();
  float* out = a.out.as<float>();
  const std::int64_t n = a.x.numel();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t i = 0; i < n; ++i) out[i] = store(gelu(x[i]));
}

}  // namespace kiln::ops::cpu
