// The cross-entropy kernels production does not run (cross_entropy.cu runs the streaming kernel
// with 256 threads), kept to be measured against it (bench_kernels): the row cached in registers,
// streaming with 512 threads, the row staged in shared memory.
#include "cross_entropy_variants.hpp"

#include "cross_entropy_row.cuh"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda::ce {
namespace {

constexpr int kMaxThreads = 1024;
constexpr int kStreamThreads = 512;

// V % 8 == 0, V / 8 <= CACHE * blockDim.x: thread t caches chunks t, t + blockDim.x, ...
template <int CACHE>
__global__ __launch_bounds__(kMaxThreads) void ce_cached(float* losses, bf16* logits, const std::int32_t* targets, int V,
                                                          int Vr, float dloss) {
  __shared__ Online sm[kMaxThreads / kWarp];
  const std::int64_t row = blockIdx.x;
  bf16* lr = logits + row * V;
  const int t = targets[row];
  if (t < 0) return zero_row<true>(losses, lr, row, V);
  const int chunks = V / 8;
  uint4 cache[CACHE];
#pragma unroll
  for (int j = 0; j < CACHE; ++j) {
    const int q = threadIdx.x + j * blockDim.x;
    cache[j] = q < chunks ? load16(lr + q * 8) : make_uint4(0, 0, 0, 0);
  }
  // Read before the barrier in block_combine, hence before any thread overwrites the row.
  const float xt = threadIdx.x == 0 ? __bfloat162float(lr[t]) : 0.0f;
  Online o;
#pragma unroll
  for (int j = 0; j < CACHE; ++j) {
    const int q = threadIdx.x + j * blockDim.x;
    if (q >= chunks) continue;
    float f[8];
    unpack8(cache[j], f);
    add_chunk(o, f, q * 8, Vr);
  }
  o = block_combine(o, sm);
  const float lse = o.m + logf(o.s);
  if (threadIdx.x == 0) losses[row] = lse - xt;
  const float lse_l2 = lse * kLog2e;
#pragma unroll
  for (int j = 0; j < CACHE; ++j) {
    const int q = threadIdx.x + j * blockDim.x;
    if (q >= chunks) continue;
    float f[8];
    unpack8(cache[j], f);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = grad(f[k], q * 8 + k, Vr, t, lse_l2, dloss);
    store8(lr + q * 8, f);
  }
}

// V % 8 == 0: the row is staged in shared memory with cp.async (one global read, one write); the
// blocks are small in registers, so two rows (2 x 100 KB at V = 50304) are resident per SM and one
// row's loads overlap the other's arithmetic and stores.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

template <int THREADS>
__global__ __launch_bounds__(THREADS) void ce_smem(float* losses, bf16* logits, const std::int32_t* targets, int V,
                                                   int Vr, float dloss) {
  extern __shared__ uint4 row_s[];
  __shared__ Online sm[THREADS / kWarp];
  const std::int64_t row = blockIdx.x;
  bf16* lr = logits + row * V;
  const int t = targets[row];
  if (t < 0) return zero_row<true>(losses, lr, row, V);
  const int chunks = V / 8;
  for (int q = threadIdx.x; q < chunks; q += THREADS) cp_async16(row_s + q, lr + q * 8);
  asm volatile("cp.async.commit_group;\ncp.async.wait_all;\n" ::: "memory");
  __syncthreads();
  const bf16* rs = reinterpret_cast<const bf16*>(row_s);
  const float xt = __bfloat162float(rs[t]);
  Online o;
  for (int q = threadIdx.x; q < chunks; q += THREADS) {
    float f[8];
    unpack8(row_s[q], f);
    add_chunk(o, f, q * 8, Vr);
  }
  o = block_combine(o, sm);
  const float lse = o.m + logf(o.s);
  if (threadIdx.x == 0) losses[row] = lse - xt;
  const float lse_l2 = lse * kLog2e;
  for (int q = threadIdx.x; q < chunks; q += THREADS) {
    float f[8];
    unpack8(row_s[q], f);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = grad(f[k], q * 8 + k, Vr, t, lse_l2, dloss);
    store8(lr + q * 8, f);
  }
}

template <int THREADS>
void launch_smem(float* losses, bf16* logits, const std::int32_t* targets, int N, int V, int Vr, float dloss,
                 cudaStream_t s) {
  const std::size_t bytes = static_cast<std::size_t>(V) * sizeof(bf16);
  KILN_CUDA_CHECK(cudaFuncSetAttribute(ce_smem<THREADS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bytes)));
  ce_smem<THREADS><<<N, THREADS, bytes, s>>>(losses, logits, targets, V, Vr, dloss);
}

template <int CACHE>
void launch_cached(float* losses, bf16* logits, const std::int32_t* targets, int N, int V, int Vr, float dloss,
                   cudaStream_t s) {
  const int threads = static_cast<int>(ceil_div(ceil_div(V / 8, CACHE), kWarp) * kWarp);
  ce_cached<CACHE><<<N, threads, 0, s>>>(losses, logits, targets, V, Vr, dloss);
}

}  // namespace
}  // namespace kiln::cuda::ce

namespace kiln::cuda {

// Rows up to this many bf16 are staged in shared memory (two such rows fit one SM).
constexpr int kSmemMaxV = 56 * 1024;

void cross_entropy_variant(CrossEntropyVariant variant, float* losses, bf16* logits, const std::int32_t* targets, int N,
                           int V, int vocab_real, float dloss, cudaStream_t s) {
  using enum CrossEntropyVariant;
  using namespace ce;
  if (N <= 0 || V <= 0) return;
  KILN_CHECK(vocab_real > 0 && vocab_real <= V, "cross_entropy: vocab_real ", vocab_real, " vs V ", V);
  KILN_CHECK(V % 8 == 0 && aligned16(logits), "the variants read rows in 16-byte chunks: V % 8 == 0, aligned logits");
  const std::int64_t chunks = V / 8;
  switch (variant) {
    case row_in_registers:
      if (chunks <= kMaxThreads * 1)
        launch_cached<1>(losses, logits, targets, N, V, vocab_real, dloss, s);
      else if (chunks <= kMaxThreads * 2)
        launch_cached<2>(losses, logits, targets, N, V, vocab_real, dloss, s);
      else if (chunks <= kMaxThreads * 4)
        launch_cached<4>(losses, logits, targets, N, V, vocab_real, dloss, s);
      else if (chunks <= kMaxThreads * 8)
        launch_cached<8>(losses, logits, targets, N, V, vocab_real, dloss, s);
      else
        ce_stream<kStreamThreads><<<N, kStreamThreads, 0, s>>>(losses, logits, targets, V, vocab_real, dloss);
      break;
    case streaming_512: ce_stream<kStreamThreads><<<N, kStreamThreads, 0, s>>>(losses, logits, targets, V, vocab_real, dloss); break;
    case shared_512:
      if (V > kSmemMaxV) KILN_THROW("cross_entropy: a row of ", V, " logits does not fit shared memory");
      launch_smem<512>(losses, logits, targets, N, V, vocab_real, dloss, s);
      break;
    case streaming_256: ce_stream<256><<<N, 256, 0, s>>>(losses, logits, targets, V, vocab_real, dloss); break;
    case shared_256:
      if (V > kSmemMaxV) KILN_THROW("cross_entropy: a row of ", V, " logits does not fit shared memory");
      launch_smem<256>(losses, logits, targets, N, V, vocab_real, dloss, s);
      break;
  }
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda
