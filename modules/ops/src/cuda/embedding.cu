// Token + position embedding, forward and a deterministic backward (no float atomics).
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>

#include "common.cuh"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

// Blocks of (32 chunk lanes, 8 rows): each thread handles chunks of 8 channels of one row at a
// time, so no index division is needed. VEC: C % 8 == 0 and 16-byte aligned bases.
constexpr int kLanes = 32, kRows = 8;

// Tokens outside [begin, begin + V) (another rank's rows of a vocabulary-parallel table) read zeros.
template <bool VEC>
__global__ void embedding_forward_kernel(bf16* out, const std::int32_t* tokens, const bf16* wte, const bf16* wpe,
                                         int N, int T, int C, std::int64_t begin, int V, bool positions) {
  const int chunks = (C + 7) / 8;
  for (int n = blockIdx.x * kRows + threadIdx.y; n < N; n += gridDim.x * kRows) {
    const std::int64_t row = tokens[n] - begin;
    const bf16* e = row >= 0 && row < V ? wte + row * C : nullptr;
    const bf16* p = wpe + static_cast<std::int64_t>(n % T) * C;
    bf16* o = out + static_cast<std::int64_t>(n) * C;
    for (int j = threadIdx.x; j < chunks; j += kLanes) {
      const int c = j * 8, valid = C - c;
      float a[8] = {}, b[8] = {};
      if (e) load_chunk<VEC>(e + c, valid, a);
      if (positions) load_chunk<VEC>(p + c, valid, b);
#pragma unroll
      for (int k = 0; k < 8; ++k) a[k] += b[k];
      store_chunk<VEC>(o + c, valid, a);
    }
  }
}

// dwte: one thread per (run of one token, chunk). It starts from dwte's value and adds the token's rows
// in position order (the buckets are stable-sorted), exactly the CPU's order of additions. Rows are
// loaded 4 at a time to keep several loads in flight; the additions stay in order. G: the
// gradient's type, float or bf16 (summed in f32 from its old value, stored once).
template <bool VEC, class G>
__global__ void embedding_backward_wte_kernel(G* dwte, const bf16* dout, const std::int32_t* order,
                                              const std::int32_t* bucket_end, const std::int32_t* bucket_token,
                                              const int* runs, int V, int C) {
  const int u = blockIdx.x * kRows + threadIdx.y;
  const int j = blockIdx.y * kLanes + threadIdx.x;
  const int c = j * 8, valid = C - c;
  if (u >= *runs || c >= C || bucket_token[u] >= V) return;  // the last run may be other ranks' tokens
  const int beg = u == 0 ? 0 : bucket_end[u - 1], end = bucket_end[u];
  G* dst = dwte + static_cast<std::int64_t>(bucket_token[u]) * C + c;
  float acc[8];
  load_chunk<VEC>(dst, valid, acc);
  int i = beg;
  for (; i + 4 <= end; i += 4) {
    float g[4][8];
#pragma unroll
    for (int r = 0; r < 4; ++r) load_chunk<VEC>(dout + static_cast<std::int64_t>(order[i + r]) * C + c, valid, g[r]);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] += g[r][k];
  }
  for (; i < end; ++i) {
    float g[8];
    load_chunk<VEC>(dout + static_cast<std::int64_t>(order[i]) * C + c, valid, g);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] += g[k];
  }
  store_chunk<VEC>(dst, valid, acc);
}

// dwpe[t] += dout[b*T + t] for b = 0, 1, ... in order (the CPU's order), one thread per (t, chunk).
template <bool VEC, class G>
__global__ void embedding_backward_wpe_kernel(G* dwpe, const bf16* dout, int B, int T, int C) {
  const int t = blockIdx.x * kRows + threadIdx.y;
  const int j = blockIdx.y * kLanes + threadIdx.x;
  const int c = j * 8, valid = C - c;
  if (t >= T || c >= C) return;
  G* dst = dwpe + static_cast<std::int64_t>(t) * C + c;
  const std::int64_t step = static_cast<std::int64_t>(T) * C;
  const bf16* src = dout + static_cast<std::int64_t>(t) * C + c;
  float acc[8];
  load_chunk<VEC>(dst, valid, acc);
  int b = 0;
  for (; b + 4 <= B; b += 4) {
    float g[4][8];
#pragma unroll
    for (int r = 0; r < 4; ++r) load_chunk<VEC>(src + (b + r) * step, valid, g[r]);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] += g[r][k];
  }
  for (; b < B; ++b) {
    float g[8];
    load_chunk<VEC>(src + b * step, valid, g);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] += g[k];
  }
  store_chunk<VEC>(dst, valid, acc);
}

// The radix sort's keys: the token's row, or V for a token outside this rank's rows; the values
// are the positions.
__global__ void bucket_keys_kernel(std::int32_t* keys, std::int32_t* positions, const std::int32_t* tokens,
                                   std::int64_t begin, int V, int N) {
  for (int n = blockIdx.x * blockDim.x + threadIdx.x; n < N; n += gridDim.x * blockDim.x) {
    const std::int64_t row = tokens[n] - begin;
    keys[n] = row >= 0 && row < V ? static_cast<std::int32_t>(row) : V;
    positions[n] = n;
  }
}

// embedding_buckets' scratch: keys in and out, positions in, run lengths, then CUB's temporary
// storage (the largest of the sort's, the run-length encoding's and the scan's).
struct BucketScratch {
  std::size_t words = 0, cub_bytes = 0;
};
BucketScratch bucket_scratch(int N, int V) {
  BucketScratch b;
  b.words = 4 * static_cast<std::size_t>(N) + 16;
  const int bits = V > 0 ? 32 - __builtin_clz(static_cast<unsigned>(V)) : 1;
  std::size_t sort = 0, rle = 0, scan = 0;
  KILN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort, static_cast<const std::int32_t*>(nullptr),
                                                  static_cast<std::int32_t*>(nullptr),
                                                  static_cast<const std::int32_t*>(nullptr),
                                                  static_cast<std::int32_t*>(nullptr), N, 0, bits));
  KILN_CUDA_CHECK(cub::DeviceRunLengthEncode::Encode(nullptr, rle, static_cast<const std::int32_t*>(nullptr),
                                                     static_cast<std::int32_t*>(nullptr),
                                                     static_cast<std::int32_t*>(nullptr), static_cast<int*>(nullptr),
                                                     N));
  KILN_CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, scan, static_cast<const std::int32_t*>(nullptr),
                                                static_cast<std::int32_t*>(nullptr), N));
  b.cub_bytes = std::max({sort, rle, scan});
  return b;
}

}  // namespace

std::size_t embedding_buckets_scratch(int N, int V) {
  if (N <= 0) return 0;
  const BucketScratch b = bucket_scratch(N, V);
  return b.words * sizeof(std::int32_t) + b.cub_bytes + 256;  // CUB's storage 256-byte aligned
}

void embedding_buckets(std::int32_t* order, std::int32_t* bucket_end, std::int32_t* bucket_token, int* runs,
                       const std::int32_t* tokens, std::int64_t vocab_begin, int V, int N, void* scratch,
                       std::size_t scratch_bytes, cudaStream_t s) {
  if (N <= 0) {
    KILN_CUDA_CHECK(cudaMemsetAsync(runs, 0, sizeof(int), s));
    return;
  }
  const BucketScratch b = bucket_scratch(N, V);
  const std::size_t need = b.words * sizeof(std::int32_t) + b.cub_bytes + 256;
  KILN_CHECK(scratch_bytes >= need, "embedding_buckets: ", scratch_bytes, " bytes of scratch, ", need, " needed");
  auto* keys_in = static_cast<std::int32_t*>(scratch);
  std::int32_t* keys_out = keys_in + N;
  std::int32_t* positions = keys_out + N;
  std::int32_t* lengths = positions + N;
  const auto after = reinterpret_cast<std::uintptr_t>(keys_in + b.words);
  void* cub_tmp = reinterpret_cast<void*>((after + 255) / 256 * 256);
  const int bits = V > 0 ? 32 - __builtin_clz(static_cast<unsigned>(V)) : 1;
  bucket_keys_kernel<<<grid_for(N, 256, 4096), 256, 0, s>>>(keys_in, positions, tokens, vocab_begin, V, N);
  KILN_CUDA_LAUNCH_CHECK();
  std::size_t bytes = b.cub_bytes;
  // Stable: equal tokens keep their positions' order, the CPU's order of additions.
  KILN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_tmp, bytes, keys_in, keys_out, positions, order, N, 0, bits, s));
  bytes = b.cub_bytes;
  KILN_CUDA_CHECK(cub::DeviceRunLengthEncode::Encode(cub_tmp, bytes, keys_out, bucket_token, lengths, runs, N, s));
  bytes = b.cub_bytes;
  // Only the first *runs lengths are written; the sums past them are never read.
  KILN_CUDA_CHECK(cub::DeviceScan::InclusiveSum(cub_tmp, bytes, lengths, bucket_end, N, s));
}

void embedding_forward(bf16* out, const std::int32_t* tokens, const bf16* wte, const bf16* wpe, int N, int T, int C,
                       std::int64_t vocab_begin, int V, bool positions, cudaStream_t s) {
  if (N <= 0 || C <= 0) return;
  KILN_CHECK(T > 0, "embedding_forward: T = ", T);
  const dim3 block(kLanes, kRows);
  const unsigned grid = grid_for(N, kRows, 65535);
  if (C % 8 == 0 && aligned16(out) && aligned16(wte) && aligned16(wpe))
    embedding_forward_kernel<true><<<grid, block, 0, s>>>(out, tokens, wte, wpe, N, T, C, vocab_begin, V, positions);
  else
    embedding_forward_kernel<false><<<grid, block, 0, s>>>(out, tokens, wte, wpe, N, T, C, vocab_begin, V, positions);
  KILN_CUDA_LAUNCH_CHECK();
}

namespace {
template <class G>
void launch_embedding_backward(G* dwte, G* dwpe, const bf16* dout, const std::int32_t* order,
                               const std::int32_t* bucket_end, const std::int32_t* bucket_token, const int* runs, int V,
                               int N, int T, int C, cudaStream_t s) {
  if (N <= 0 || C <= 0) return;
  KILN_CHECK(T > 0 && N % T == 0, "embedding_backward: N = ", N, " is not a multiple of T = ", T);
  const bool vec = C % 8 == 0 && aligned16(dwte) && (!dwpe || aligned16(dwpe)) && aligned16(dout);
  const dim3 block(kLanes, kRows);
  const unsigned chunk_blocks = static_cast<unsigned>(ceil_div(ceil_div(C, 8), kLanes));
  {  // as many runs as positions at most; the count is on the device
    const dim3 grid(static_cast<unsigned>(ceil_div(N, kRows)), chunk_blocks);
    if (vec)
      embedding_backward_wte_kernel<true, G><<<grid, block, 0, s>>>(dwte, dout, order, bucket_end, bucket_token, runs, V, C);
    else
      embedding_backward_wte_kernel<false, G><<<grid, block, 0, s>>>(dwte, dout, order, bucket_end, bucket_token, runs, V, C);
    KILN_CUDA_LAUNCH_CHECK();
  }
  if (!dwpe) return;  // no position table
  const dim3 grid(static_cast<unsigned>(ceil_div(T, kRows)), chunk_blocks);
  if (vec)
    embedding_backward_wpe_kernel<true, G><<<grid, block, 0, s>>>(dwpe, dout, N / T, T, C);
  else
    embedding_backward_wpe_kernel<false, G><<<grid, block, 0, s>>>(dwpe, dout, N / T, T, C);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace

void embedding_backward(float* dwte, float* dwpe, const bf16* dout, const std::int32_t* order,
                        const std::int32_t* bucket_end, const std::int32_t* bucket_token, const int* runs, int V,
                        int N, int T, int C, cudaStream_t s) {
  launch_embedding_backward(dwte, dwpe, dout, order, bucket_end, bucket_token, runs, V, N, T, C, s);
}

void embedding_backward(bf16* dwte, bf16* dwpe, const bf16* dout, const std::int32_t* order,
                        const std::int32_t* bucket_end, const std::int32_t* bucket_token, const int* runs, int V,
                        int N, int T, int C, cudaStream_t s) {
  launch_embedding_backward(dwte, dwpe, dout, order, bucket_end, bucket_token, runs, V, N, T, C, s);
}

}  // namespace kiln::cuda
