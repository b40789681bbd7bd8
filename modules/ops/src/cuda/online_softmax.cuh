#pragma once
// The online softmax statistics (running max and sum of exp relative to it) shared by the
// cross-entropy kernels, and their block-wide combination.
#include "common.cuh"

namespace kiln::cuda {

constexpr float kLog2e = 1.4426950408889634f;

struct Online {
  float m = -INFINITY;  // running max
  float s = 0;          // sum of exp(x - m)
};

__device__ __forceinline__ void combine(Online& a, const Online& b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return;  // both empty
  a.s = a.s * exp2f((a.m - m) * kLog2e) + b.s * exp2f((b.m - m) * kLog2e);
  a.m = m;
}

// Butterfly within warps (commutative combine, so all lanes agree), then warps in order.
__device__ __forceinline__ Online block_combine(Online o, Online* sm) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) {
    Online other{__shfl_xor_sync(0xffffffffu, o.m, off), __shfl_xor_sync(0xffffffffu, o.s, off)};
    combine(o, other);
  }
  if (threadIdx.x % kWarp == 0) sm[threadIdx.x / kWarp] = o;
  __syncthreads();
  Online r = sm[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / kWarp); ++w) combine(r, sm[w]);
  return r;
}

// Adds the elements of a chunk below vocab_real (base is the chunk's first column).
__device__ __forceinline__ void add_chunk(Online& o, const float f[8], int base, int Vr) {
  float cm = -INFINITY;
#pragma unroll
  for (int k = 0; k < 8; ++k)
    if (base + k < Vr) cm = fmaxf(cm, f[k]);
  if (cm == -INFINITY) return;
  if (cm > o.m) {
    o.s *= exp2f((o.m - cm) * kLog2e);
    o.m = cm;
  }
  const float ml = o.m * kLog2e;
#pragma unroll
  for (int k = 0; k < 8; ++k)
    if (base + k < Vr) o.s += exp2f(fmaf(f[k], kLog2e, -ml));
}

}  // namespace kiln::cuda
