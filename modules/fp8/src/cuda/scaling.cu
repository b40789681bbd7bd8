// The delayed-scaling update of every FP8 tensor of a rank in one kernel: one thread per slot
// walks its history column (rows are [n] apart, so a warp reads 32 consecutive floats per row).
#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::fp8::cuda {

namespace {

__global__ void delayed_update_kernel(float* __restrict__ history, float* __restrict__ scale,
                                      float* __restrict__ scale_inv, int inv_stride, const float* __restrict__ fp8_max,
                                      int len, int n, bool use_max, int margin) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float amax = history[i];
  if (use_max)
    for (int h = 1; h < len; ++h) amax = amax_max(amax, history[static_cast<long long>(h) * n + i]);
  const float s = compute_scale(fp8_max[i], amax, margin, scale[i]);
  scale[i] = s;
  scale_inv[static_cast<long long>(i) * inv_stride] = reciprocal(s);
  for (int h = len - 1; h > 0; --h) history[static_cast<long long>(h) * n + i] = history[static_cast<long long>(h - 1) * n + i];
  history[i] = 0.0f;
}

}  // namespace

void delayed_update(const DelayedUpdateArgs& a, cudaStream_t s) {
  KILN_CHECK(a.len >= 1 && a.n >= 0, "fp8 delayed_update: history [", a.len, ", ", a.n, "]");
  if (a.n == 0) return;
  constexpr int kThreads = 128;
  delayed_update_kernel<<<(a.n + kThreads - 1) / kThreads, kThreads, 0, s>>>(
      a.history, a.scale, a.scale_inv, a.scale_inv_stride, a.fp8_max, a.len, a.n, a.algo == AmaxAlgo::max, a.margin);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::fp8::cuda
