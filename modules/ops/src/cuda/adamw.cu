// AdamW over all parameters in one launch. The work is the segments the optimizer updates, laid
// end to end, each rounded up to a multiple of 4 (AdamWSegmentDev::work): a grid-stride loop over
// that space, 4 elements of one segment per thread and step (float4 where aligned), so segments left
// to another module cost nothing and a chunk never spans two segments.
#include "common.cuh"
#include "kiln/ops/cuda/moments.cuh"
#include "kiln/ops/formulas.hpp"
#include "kiln/ops/grads.hpp"
#include "kiln/ops/moments.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;

struct Hyper {
  float lr, beta1, beta2, eps, grad_scale, bc1, bc2;
  const float* scalars;  // lr, grad_scale, bc1, bc2 from device memory instead (ops::AdamW::scalars)
};

// VEC: params, grads, m, v 16-byte aligned and params_bf16 (if any) 8-byte aligned. M: the
// moments' storage, G: the gradient's (each float, or std::uint16_t: bf16 bits, read as f32 exactly).
template <bool VEC, class M, class G>
__global__ void adamw_kernel(float* params, bf16* params_bf16, const G* grads, M* m, M* v,
                             const AdamWSegmentDev* segs, int n_segs, std::int64_t W, Hyper h) {
  ops::AdamWNumbers n{h.lr, h.grad_scale, h.bc1, h.bc2};
  if (!ops::adamw_numbers(h.scalars, n)) return;  // a non-finite gradient: the step is skipped
  h.lr = n.lr, h.grad_scale = n.grad_scale, h.bc1 = n.bc1, h.bc2 = n.bc2;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * 4;
  for (std::int64_t w = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4; w < W; w += stride) {
    const int seg = entry_at_work(segs, n_segs, w);
    const std::int64_t local = w - __ldg(&segs[seg].work), count = __ldg(&segs[seg].count);
    if (local >= count) continue;  // the rounding after the segment's last element
    const std::int64_t i = __ldg(&segs[seg].offset) + local;
    const float wd = __ldg(&segs[seg].weight_decay);
    const std::int64_t act = __ldg(&segs[seg].act);  // -1: no act copy
    bf16* pa = params_bf16 && act >= 0 ? params_bf16 + act + local : nullptr;
    if (VEC && local + 4 <= count && i % 4 == 0 && (act < 0 || (act + local) % 4 == 0)) {
      const float4 p4 = *reinterpret_cast<const float4*>(params + i);
      float p[4] = {p4.x, p4.y, p4.z, p4.w}, mm[4], vv[4], g[4];
      load4(grads + i, g);
      load4(m + i, mm);
      load4(v + i, vv);
#pragma unroll
      for (int k = 0; k < 4; ++k)
        ops::adamw_update(p[k], mm[k], vv[k], g[k] * h.grad_scale, h.lr, h.beta1, h.beta2, h.eps, wd, h.bc1, h.bc2);
      *reinterpret_cast<float4*>(params + i) = make_float4(p[0], p[1], p[2], p[3]);
      store4(m + i, mm);
      store4(v + i, vv);
      if (pa) {
        uint2 packed;
        packed.x = pack2(p[0], p[1]);
        packed.y = pack2(p[2], p[3]);
        *reinterpret_cast<uint2*>(pa) = packed;
      }
    } else {
      for (std::int64_t j = i; j < i + 4 && j - i + local < count; ++j) {
        float pj = params[j], mj = ops::moment_load(m, j), vj = ops::moment_load(v, j);
        ops::adamw_update(pj, mj, vj, ops::grad_load(grads, j) * h.grad_scale, h.lr, h.beta1, h.beta2, h.eps, wd, h.bc1, h.bc2);
        params[j] = pj;
        ops::moment_store(m, j, mj);
        ops::moment_store(v, j, vj);
        if (pa) pa[j - i] = __float2bfloat16_rn(pj);
      }
    }
  }
}

template <class M, class G>
void adamw_launch(float* params, bf16* params_bf16, const G* grads, M* m, M* v, const AdamWSegmentDev* segments,
                  int n_segments, std::int64_t work, const Hyper& h, cudaStream_t s) {
  const bool vec = aligned16(params) && aligned16(grads) && aligned16(m) && aligned16(v) &&
                   (reinterpret_cast<std::uintptr_t>(params_bf16) & 7u) == 0;
  const unsigned grid = grid_for(ceil_div(work, 4), kThreads, 8192);
  if (vec)
    adamw_kernel<true><<<grid, kThreads, 0, s>>>(params, params_bf16, grads, m, v, segments, n_segments, work, h);
  else
    adamw_kernel<false><<<grid, kThreads, 0, s>>>(params, params_bf16, grads, m, v, segments, n_segments, work, h);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace

void adamw(float* params, bf16* params_bf16, const void* grads, bool bf16_grads, void* m, void* v, bool bf16_moments,
           const AdamWSegmentDev* segments, int n_segments, std::int64_t work, float lr, float beta1, float beta2,
           float eps, float grad_scale, float bc1, float bc2, const float* scalars, cudaStream_t s) {
  if (work <= 0 || n_segments <= 0) return;
  const Hyper h{lr, beta1, beta2, eps, grad_scale, bc1, bc2, scalars};
  ops::with_moments(bf16_moments, m, v, [&](auto* mt, auto* vt) {
    ops::with_grads(bf16_grads, grads, [&](auto* g) {
      adamw_launch(params, params_bf16, g, mt, vt, segments, n_segments, work, h, s);
    });
  });
}

}  // namespace kiln::cuda
