// Decode attention (generation with a KV cache): the newest query of each (sequence, head) against
// every cached position, split over the positions as flash-decoding does, because one query row per
// head gives too few blocks to fill the GPU from (B * H) alone.
//
// Pass 1, one block per (sequence x head, split): each of the 4 warps walks its positions of the
// split (warp w takes positions w, w + 4, ...); a position's k and v rows are read by the whole warp
// (lane l holds channels l, l + 32, ..., so each load is one contiguous run of the row), the score
// is a butterfly warp sum, and the warp keeps an online softmax (running max, sum of exp2, fp32
// accumulator) in registers. The warps' states are combined in warp order; with one split the block
// writes the output, else its state (max, sum, accumulator) goes to scratch.
// Pass 2, one block per (sequence x head): the splits' states combined in split order.
// The number of splits depends only on (B, H, length), never on the device, and every combination
// runs in a fixed order, so the output is deterministic.
#include "common.cuh"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace decode {
namespace {

constexpr int kWarps = 4, kThreads = kWarps * kWarp;
constexpr int kUnroll = 4;         // positions a warp scores before its softmax update (independent loads)
constexpr int kMinChunk = 64;      // positions per split at least
constexpr int kTargetBlocks = 256; // about two waves of blocks on an H100 (132 SMs)
constexpr float kLog2e = 1.4426950408889634f;

struct Split {
  int splits, chunk;
};

Split split_of(int BH, int length) {
  const int most = (length + kMinChunk - 1) / kMinChunk;
  const int want = (kTargetBlocks + BH - 1) / BH;
  const int splits = std::max(1, std::min(most, want));
  const int chunk = (length + splits - 1) / splits;
  return {(length + chunk - 1) / chunk, chunk};
}

// Adds state (m2, s2, a2) into (m, s, a): exp2 domain; an empty state has m = -inf.
template <int E>
__device__ __forceinline__ void merge(float& m, float& s, float (&a)[E], float m2, float s2, const float (&a2)[E]) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;
  const float c1 = exp2f(m - mn), c2 = exp2f(m2 - mn);
  s = s * c1 + s2 * c2;
#pragma unroll
  for (int i = 0; i < E; ++i) a[i] = a[i] * c1 + a2[i] * c2;
  m = mn;
}

// E: channels per lane (D <= 32 E).
template <int E>
__global__ void __launch_bounds__(kThreads)
    decode_kernel(bf16* __restrict__ out, float* __restrict__ part, const bf16* __restrict__ qkv, int Tmax, int H,
                  int D, int length, int chunk, float scale_log2, int K) {
  const int bh = blockIdx.x, split = blockIdx.y, b = bh / H, h = bh - b * H;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const std::int64_t ld = static_cast<std::int64_t>(H + 2 * K) * D;  // [B, Tmax, H + 2K, D]
  const int kv = h / (H / K);
  const bf16* seq = qkv + static_cast<std::int64_t>(b) * Tmax * ld;
  const bf16* q = seq + static_cast<std::int64_t>(length - 1) * ld + static_cast<std::int64_t>(h) * D;
  const bf16* keys = seq + static_cast<std::int64_t>(H + kv) * D;
  const bf16* values = seq + static_cast<std::int64_t>(H + K + kv) * D;
  float qf[E], acc[E];
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const int d = lane + kWarp * i;
    qf[i] = d < D ? __bfloat162float(q[d]) * scale_log2 : 0.0f;  // scores in the exp2 domain
    acc[i] = 0.0f;
  }
  float m = -INFINITY, s = 0.0f;
  const int t0 = split * chunk, t1 = min(length, t0 + chunk);
  for (int tb = t0 + warp; tb < t1; tb += kWarps * kUnroll) {
    float score[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = tb + u * kWarps;
      float dot = 0.0f;
      if (t < t1) {
        const bf16* k = keys + static_cast<std::int64_t>(t) * ld;
#pragma unroll
        for (int i = 0; i < E; ++i) {
          const int d = lane + kWarp * i;
          if (d < D) dot += qf[i] * __bfloat162float(k[d]);
        }
      }
      const float total = warp_sum(dot);  // t is the same on every lane of the warp
      score[u] = t < t1 ? total : -INFINITY;
    }
    float mn = m;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) mn = fmaxf(mn, score[u]);
    const float c = exp2f(m - mn);  // m = -inf at the start: 0
    s *= c;
#pragma unroll
    for (int i = 0; i < E; ++i) acc[i] *= c;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = tb + u * kWarps;
      if (t < t1) {
        const float p = exp2f(score[u] - mn);
        s += p;
        const bf16* v = values + static_cast<std::int64_t>(t) * ld;
#pragma unroll
        for (int i = 0; i < E; ++i) {
          const int d = lane + kWarp * i;
          if (d < D) acc[i] += p * __bfloat162float(v[d]);
        }
      }
    }
    m = mn;
  }

  // The warps' states, combined in warp order by warp 0.
  __shared__ float sm_ms[kWarps][2];
  __shared__ float sm_acc[kWarps][kWarp * E];
  if (lane == 0) sm_ms[warp][0] = m, sm_ms[warp][1] = s;
#pragma unroll
  for (int i = 0; i < E; ++i) sm_acc[warp][lane + kWarp * i] = acc[i];
  __syncthreads();
  if (warp != 0) return;
  for (int w = 1; w < kWarps; ++w) {
    float other[E];
#pragma unroll
    for (int i = 0; i < E; ++i) other[i] = sm_acc[w][lane + kWarp * i];
    merge(m, s, acc, sm_ms[w][0], sm_ms[w][1], other);
  }
  if (gridDim.y == 1) {
    bf16* o = out + static_cast<std::int64_t>(bh) * D;
    const float inv = 1.0f / s;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const int d = lane + kWarp * i;
      if (d < D) o[d] = __float2bfloat16_rn(acc[i] * inv);
    }
    return;
  }
  // Scratch per (bh, split): max, sum, then D accumulator values.
  float* p = part + (static_cast<std::int64_t>(bh) * gridDim.y + split) * (D + 2);
  if (lane == 0) p[0] = m, p[1] = s;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const int d = lane + kWarp * i;
    if (d < D) p[2 + d] = acc[i];
  }
}

__global__ void __launch_bounds__(kThreads) combine_kernel(bf16* __restrict__ out, const float* __restrict__ part,
                                                           int D, int splits) {
  const int bh = blockIdx.x;
  const float* p = part + static_cast<std::int64_t>(bh) * splits * (D + 2);
  float m = -INFINITY;
  for (int j = 0; j < splits; ++j) m = fmaxf(m, p[j * (D + 2)]);
  float s = 0.0f;
  for (int j = 0; j < splits; ++j) s += p[j * (D + 2) + 1] * exp2f(p[j * (D + 2)] - m);
  const float inv = 1.0f / s;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = 0.0f;
    for (int j = 0; j < splits; ++j) a += p[j * (D + 2) + 2 + d] * exp2f(p[j * (D + 2)] - m);
    out[static_cast<std::int64_t>(bh) * D + d] = __float2bfloat16_rn(a * inv);
  }
}

template <int E>
void launch(bf16* out, float* scratch, const bf16* qkv, int BH, int Tmax, int H, int D, int length, float scale_log2,
            Split sp, cudaStream_t s, int K) {
  decode_kernel<E><<<dim3(BH, sp.splits), kThreads, 0, s>>>(out, scratch, qkv, Tmax, H, D, length, sp.chunk,
                                                            scale_log2, K);
  KILN_CUDA_LAUNCH_CHECK();
  if (sp.splits == 1) return;
  combine_kernel<<<BH, kThreads, 0, s>>>(out, scratch, D, sp.splits);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace
}  // namespace decode

std::int64_t attention_decode_scratch(int B, int H, int D, int length) {
  const int BH = B * H;
  if (BH == 0 || length <= 0) return 0;
  const decode::Split sp = decode::split_of(BH, length);
  return sp.splits == 1 ? 0 : static_cast<std::int64_t>(BH) * sp.splits * (D + 2);
}

void attention_decode(bf16* out, float* scratch, const bf16* qkv, int B, int Tmax, int H, int D, int length,
                      float scale, cudaStream_t s, int kv_heads) {
  const int K = kv_heads ? kv_heads : H;
  KILN_CHECK(K > 0 ? H % K == 0 : H == 0, "attention_decode: ", K, " key/value heads do not divide ", H, " query heads");
  KILN_CHECK(D >= 1 && D <= 256, "attention_decode: head dim D = ", D, " is not supported (the kernel takes D <= 256)");
  KILN_CHECK(length >= 1 && length <= Tmax, "attention_decode: length ", length, " outside [1, Tmax = ", Tmax, "]");
  KILN_CHECK(static_cast<std::int64_t>(B) * H <= 0x7fffffff, "attention_decode: B * H is too large");
  const int BH = B * H;
  if (BH == 0) return;
  const decode::Split sp = decode::split_of(BH, length);
  const float sl = scale * decode::kLog2e;
  if (D <= 32)
    decode::launch<1>(out, scratch, qkv, BH, Tmax, H, D, length, sl, sp, s, K > 0 ? K : 1);
  else if (D <= 64)
    decode::launch<2>(out, scratch, qkv, BH, Tmax, H, D, length, sl, sp, s, K > 0 ? K : 1);
  else if (D <= 128)
    decode::launch<4>(out, scratch, qkv, BH, Tmax, H, D, length, sl, sp, s, K > 0 ? K : 1);
  else
    decode::launch<8>(out, scratch, qkv, BH, Tmax, H, D, length, sl, sp, s, K > 0 ? K : 1);
}

}  // namespace kiln::cuda
