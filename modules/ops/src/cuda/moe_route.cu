// The mixture-of-experts router: scores, each token's top-k experts and their gates (one warp per
// token), the load-balancing loss per sequence and the z-loss (fixed-order reductions: a block per
// sequence writes its partial sums, one thread adds them in sequence order), and the backward.
// The formulas and their evaluation order are the CPU reference's (src/cpu/moe.cpp); sums over the
// experts are warp reductions, so values differ from the CPU's in the last bits only.
#include <cmath>

#include "common.cuh"
#include "kiln/ops/cuda/moe.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

constexpr int kWarps = 4;              // tokens per block of the per-token kernels
constexpr int kSeqThreads = 256;       // threads of the per-sequence kernels
constexpr unsigned kFull = 0xffffffffu;

// Whether candidate (ka, ea) beats (kb, eb): the larger key, on a tie the lower expert; -1 is no
// candidate. A total order on the candidates, so the butterfly below leaves every lane the same one.
__device__ __forceinline__ bool beats(float ka, int ea, float kb, int eb) {
  if (ea < 0) return false;
  if (eb < 0) return true;
  if (ka > kb) return true;
  if (kb > ka) return false;
  return ea < eb;
}

// One warp per token. Shared memory per warp: the token's scores and selection keys (2 E floats).
// psum (optional): each token's sum of scores (sigmoid scoring's balance probabilities).
__global__ __launch_bounds__(kWarps * kWarp) void route_kernel(float* scores, float* lse_out, std::int32_t* experts,
                                                               float* gates, float* psum, const bf16* logits,
                                                               const float* bias, int N, int E, int k, bool sigmoid,
                                                               bool normalize) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= N) return;  // whole warps only: no block-wide barrier below
  float* s = smem + static_cast<std::int64_t>(warp) * 2 * E;
  float* key = s + E;
  const bf16* l = logits + static_cast<std::int64_t>(t) * E;
  float mx = -INFINITY;
  for (int e = lane; e < E; e += kWarp) mx = fmaxf(mx, __bfloat162float(l[e]));
  mx = warp_max(mx);
  float sum = 0;
  for (int e = lane; e < E; e += kWarp) sum += expf(__bfloat162float(l[e]) - mx);
  sum = warp_sum(sum);
  const float lse = mx + logf(sum);
  float ssum = 0;
  for (int e = lane; e < E; e += kWarp) {
    const float v = __bfloat162float(l[e]);
    const float sc = sigmoid ? 1.0f / (1.0f + expf(-v)) : expf(v - lse);
    s[e] = sc;
    key[e] = bias ? sc + bias[e] : sc;
    scores[static_cast<std::int64_t>(t) * E + e] = sc;
    ssum += sc;
  }
  if (lane == 0) lse_out[t] = lse;
  if (psum) {
    ssum = warp_sum(ssum);
    if (lane == 0) psum[t] = ssum;
  }
  __syncwarp();
  // The k best keys, best first. Lane `lane` owns experts lane + 32 i; bit i of `taken` marks the
  // ones already chosen (E <= 1024).
  unsigned taken = 0;
  float gsum = 0;
  std::int32_t* ex = experts + static_cast<std::int64_t>(t) * k;
  float* g = gates + static_cast<std::int64_t>(t) * k;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    float best_key = 0;
    for (int i = 0, e = lane; e < E; ++i, e += kWarp) {
      if ((taken >> i) & 1u) continue;
      if (best < 0 || key[e] > best_key) best = e, best_key = key[e];
    }
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) {
      const int other = __shfl_xor_sync(kFull, best, o);
      const float other_key = __shfl_xor_sync(kFull, best_key, o);
      if (beats(other_key, other, best_key, best)) best = other, best_key = other_key;
    }
    best = __shfl_sync(kFull, best, 0);  // k <= E: there is always a candidate
    if ((best % kWarp) == lane) taken |= 1u << (best / kWarp);
    const float chosen = s[best];
    gsum += chosen;  // in j order, as the CPU
    if (lane == 0) {
      ex[j] = best;
      g[j] = chosen;
    }
  }
  if (normalize && lane == 0)
    for (int j = 0; j < k; ++j) g[j] /= gsum;
}

// f[s, e] = the share of sequence s's T k choices that chose e. One block per sequence; the counts
// are integer atomics in shared memory (their sums do not depend on the order).
__global__ __launch_bounds__(kSeqThreads) void shares_kernel(float* f, const std::int32_t* experts, int T, int k,
                                                              int E) {
  extern __shared__ int count[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  const std::int64_t n = static_cast<std::int64_t>(T) * k, begin = blockIdx.x * n;
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int e = experts[begin + i];
    if (e >= 0 && e < E) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  const float total = static_cast<float>(n);
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    f[static_cast<std::int64_t>(blockIdx.x) * E + e] = static_cast<float>(count[e]) / total;
}

// Sequence s's parts of the two losses, in doubles as the CPU: sum_e f[s, e] P[s, e] / T and
// sum_t lse[t]^2. partial[2 s], partial[2 s + 1]. The threads stride over the sequence's tokens
// (each expert's P a fixed-order sum: per thread, then the warp's butterfly, then the warps in
// order), so the sums take T / blockDim steps, not T.
__global__ __launch_bounds__(kSeqThreads) void loss_partials_kernel(double* partial, const float* f,
                                                                     const float* scores, const float* psum,
                                                                     const float* lse, int T, int E) {
  __shared__ double red[kSeqThreads / kWarp];
  const std::int64_t t0 = static_cast<std::int64_t>(blockIdx.x) * T;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  // Every warp's sum of v, added by thread 0 in warp order.
  auto block_sum = [&](double v) {
    v = warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    double total = 0;
    if (threadIdx.x == 0)
      for (int w = 0; w < warps; ++w) total += red[w];
    __syncthreads();
    return total;
  };
  double aux = 0;  // thread 0's
  for (int e = 0; e < E; ++e) {
    double P = 0;
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
      const float sc = scores[(t0 + t) * E + e];
      P += psum ? sc / psum[t0 + t] : sc;
    }
    P = block_sum(P);
    if (threadIdx.x == 0)
      aux += static_cast<double>(f[static_cast<std::int64_t>(blockIdx.x) * E + e]) * (P / static_cast<double>(T));
  }
  double z = 0;
  for (int t = threadIdx.x; t < T; t += blockDim.x) z += static_cast<double>(lse[t0 + t]) * lse[t0 + t];
  z = block_sum(z);
  if (threadIdx.x == 0) {
    partial[2 * blockIdx.x] = aux;
    partial[2 * blockIdx.x + 1] = z;
  }
}

__global__ void loss_finish_kernel(float* loss_terms, const double* partial, int S, int E, float aux_coeff,
                                   float z_coeff) {
  double aux = 0, z = 0;
  for (int s = 0; s < S; ++s) {
    aux += partial[2 * s];
    z += partial[2 * s + 1];
  }
  loss_terms[0] = static_cast<float>(static_cast<double>(aux_coeff) * static_cast<double>(E) * aux);
  loss_terms[1] = static_cast<float>(static_cast<double>(z_coeff) * z);
}

// One warp per token; shared memory per warp: ds[E], each lane touching only its own experts.
__global__ __launch_bounds__(kWarps * kWarp) void route_backward_kernel(
    bf16* dlogits, const float* f, const float* dgates, const float* scores, const float* lse_in,
    const std::int32_t* experts, const bf16* logits, int N, int E, int k, int T, bool sigmoid, bool normalize,
    float aux_coeff, float z_coeff) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= N) return;
  float* ds = smem + static_cast<std::int64_t>(warp) * E;
  const float* s = scores + static_cast<std::int64_t>(t) * E;
  const std::int32_t* ex = experts + static_cast<std::int64_t>(t) * k;
  const float* dg = dgates + static_cast<std::int64_t>(t) * k;
  // Through the gates: g_j = s[e_j] (divided by S, the chosen scores' sum, with normalize).
  float S = 0, dot = 0;
  for (int j = 0; j < k; ++j) S += s[ex[j]];
  if (normalize)
    for (int j = 0; j < k; ++j) dot += dg[j] * (s[ex[j]] / S);
  for (int e = lane; e < E; e += kWarp) {
    float acc = 0;
    for (int j = 0; j < k; ++j)
      if (ex[j] == e) acc += normalize ? (dg[j] - dot) / S : dg[j];
    ds[e] = acc;
  }
  // Through the load-balancing loss: d/dp[t, e] = aux_coeff E f[s, e] / T.
  const float* fs = f + static_cast<std::int64_t>(t / T) * E;
  float psum = 1;
  if (sigmoid) {
    float v = 0;
    for (int e = lane; e < E; e += kWarp) v += s[e];
    psum = warp_sum(v);
  }
  float pdp = 0;
  for (int e = lane; e < E; e += kWarp) {
    const float dp = aux_coeff * static_cast<float>(E) * fs[e] / static_cast<float>(T);
    pdp += (sigmoid ? s[e] / psum : s[e]) * dp;
  }
  pdp = warp_sum(pdp);
  for (int e = lane; e < E; e += kWarp) {
    const float dp = aux_coeff * static_cast<float>(E) * fs[e] / static_cast<float>(T);
    ds[e] += sigmoid ? (dp - pdp) / psum : dp;
  }
  // To the logits: the softmax's or the sigmoid's derivative; and the z-loss's, 2 z lse softmax(l).
  float sds = 0;
  if (!sigmoid) {
    for (int e = lane; e < E; e += kWarp) sds += s[e] * ds[e];
    sds = warp_sum(sds);
  }
  const float lse = lse_in[t];
  const bf16* l = logits + static_cast<std::int64_t>(t) * E;
  bf16* out = dlogits + static_cast<std::int64_t>(t) * E;
  for (int e = lane; e < E; e += kWarp) {
    float g = sigmoid ? ds[e] * s[e] * (1.0f - s[e]) : s[e] * (ds[e] - sds);
    if (z_coeff != 0) g += z_coeff * 2.0f * lse * expf(__bfloat162float(l[e]) - lse);
    out[e] = __float2bfloat16_rn(g);
  }
}

void check_experts(int E, const char* op) {
  KILN_CHECK(E >= 1 && E <= kMoeMaxExperts, op, ": the CUDA kernels take 1 to ", kMoeMaxExperts, " experts, got ", E);
}

}  // namespace

std::int64_t moe_route_scratch(int N, int E, int T) {
  const std::int64_t S = N / T;
  return 4 * S + S * E + N;  // 2 S doubles, f [S, E], psum [N]
}

void moe_route(float* scores, float* lse, std::int32_t* experts, float* gates, float* loss_terms, float* scratch,
               const bf16* logits, const float* bias, int N, int E, int k, int T, ops::MoeScore score,
               bool normalize, float aux_coeff, float z_coeff, cudaStream_t s) {
  check_experts(E, "moe_route");
  if (N == 0) return;
  const bool sigmoid = score == ops::MoeScore::sigmoid;
  const int S = N / T;
  double* partial = reinterpret_cast<double*>(scratch);
  float* f = scratch + 4 * static_cast<std::int64_t>(S);
  float* psum = loss_terms && sigmoid ? f + static_cast<std::int64_t>(S) * E : nullptr;
  const std::size_t smem = static_cast<std::size_t>(kWarps) * 2 * E * sizeof(float);
  route_kernel<<<static_cast<unsigned>(ceil_div(N, kWarps)), kWarps * kWarp, smem, s>>>(
      scores, lse, experts, gates, psum, logits, bias, N, E, k, sigmoid, normalize);
  KILN_CUDA_LAUNCH_CHECK();
  if (!loss_terms) return;
  shares_kernel<<<S, kSeqThreads, E * sizeof(int), s>>>(f, experts, T, k, E);
  KILN_CUDA_LAUNCH_CHECK();
  loss_partials_kernel<<<S, kSeqThreads, 0, s>>>(partial, f, scores, psum, lse, T, E);
  KILN_CUDA_LAUNCH_CHECK();
  loss_finish_kernel<<<1, 1, 0, s>>>(loss_terms, partial, S, E, aux_coeff, z_coeff);
  KILN_CUDA_LAUNCH_CHECK();
}

std::int64_t moe_route_backward_scratch(int N, int E, int T) { return static_cast<std::int64_t>(N / T) * E; }

void moe_route_backward(bf16* dlogits, float* scratch, const float* dgates, const float* scores, const float* lse,
                        const std::int32_t* experts, const bf16* logits, int N, int E, int k, int T,
                        ops::MoeScore score, bool normalize, float aux_coeff, float z_coeff, cudaStream_t s) {
  check_experts(E, "moe_route_backward");
  if (N == 0) return;
  const int S = N / T;
  shares_kernel<<<S, kSeqThreads, E * sizeof(int), s>>>(scratch, experts, T, k, E);
  KILN_CUDA_LAUNCH_CHECK();
  const std::size_t smem = static_cast<std::size_t>(kWarps) * E * sizeof(float);
  route_backward_kernel<<<static_cast<unsigned>(ceil_div(N, kWarps)), kWarps * kWarp, smem, s>>>(
      dlogits, scratch, dgates, scores, lse, experts, logits, N, E, k, T, score == ops::MoeScore::sigmoid, normalize,
      aux_coeff, z_coeff);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda
