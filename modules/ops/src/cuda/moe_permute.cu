// The tokens' rows grouped by expert (a stable counting sort of the N k choices, with a capacity
// per sequence) and its backward. Deterministic without atomics:
//   1. rank: one block per chunk of a sequence's choices; each choice's rank among its chunk's
//      choices of the same expert, in choice order (warp match + per-warp counts), and each
//      expert's count in the chunk;
//   2. scan: one block; per expert, the chunks' bases within their sequence, the rows the sequences
//      before it keep (the capacity applied per sequence), then the offsets over the experts;
//   3. scatter: one thread per choice: its row (or -1 past the capacity) and the row's source id;
//      rows from offsets[E] on get -1;
//   4. gather (with out): 32 lanes per grouped row (16-byte chunks where aligned), x's row or zeros.
#include "common.cuh"
#include "kiln/ops/cuda/moe.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

constexpr int kChunk = 1024;        // choices per block of the rank kernel (a sequence's chunks)
constexpr int kRankThreads = 256;   // one tile of choices per pass
constexpr int kRankWarps = kRankThreads / kWarp;
constexpr int kScanThreads = 256;
constexpr int kThreads = 256;
constexpr int kLanes = 32, kRows = 8;  // row kernels: blocks of (32 chunk lanes, 8 rows), chunks of 8

// The layout of the work: S sequences of per_seq choices (one sequence of N k without a capacity),
// each cut into chunks of kChunk; chunk g = s * chunks + c.
struct Segments {
  std::int64_t per_seq;
  int S, chunks;
};

Segments segments_of(int N, int k, int seq_len, std::int64_t capacity) {
  const std::int64_t NK = static_cast<std::int64_t>(N) * k;
  Segments g{};
  g.per_seq = capacity > 0 ? static_cast<std::int64_t>(seq_len) * k : NK;
  g.S = static_cast<int>(NK / g.per_seq);
  g.chunks = static_cast<int>(ceil_div(g.per_seq, kChunk));
  return g;
}

// rank[i]: choice i's rank among its chunk's choices of the same expert (-1: expert outside
// [0, E)); count[g, e]: the chunk's choices of expert e. Shared memory: running[E], per-warp
// counts [kRankWarps][E].
__global__ __launch_bounds__(kRankThreads) void rank_kernel(std::int32_t* rank, std::int32_t* count,
                                                            const std::int32_t* experts, Segments seg, int E) {
  extern __shared__ int sm[];
  int* running = sm;
  int* wcount = sm + E;
  for (int i = threadIdx.x; i < (kRankWarps + 1) * E; i += kRankThreads) sm[i] = 0;
  __syncthreads();
  const int g = blockIdx.x, lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  const std::int64_t seq_begin = static_cast<std::int64_t>(g / seg.chunks) * seg.per_seq;
  const std::int64_t begin = seq_begin + static_cast<std::int64_t>(g % seg.chunks) * kChunk;
  const std::int64_t end = min(begin + kChunk, seq_begin + seg.per_seq);
  for (std::int64_t base = begin; base < end; base += kRankThreads) {  // uniform over the block
    const std::int64_t i = base + threadIdx.x;
    int e = -1;
    if (i < end) {
      e = experts[i];
      if (e < 0 || e >= E) e = -1;
    }
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int before = __popc(peers & ((1u << lane) - 1u));  // same-expert lanes before this one
    if (e >= 0 && before == 0) wcount[w * E + e] = __popc(peers);
    __syncthreads();
    if (e >= 0) {
      int r = running[e] + before;
      for (int v = 0; v < w; ++v) r += wcount[v * E + e];
      rank[i] = r;
    } else if (i < end) {
      rank[i] = -1;
    }
    __syncthreads();
    for (int x = threadIdx.x; x < E; x += kRankThreads) {
      int add = 0;
      for (int v = 0; v < kRankWarps; ++v) {
        add += wcount[v * E + x];
        wcount[v * E + x] = 0;
      }
      running[x] += add;
    }
    __syncthreads();
  }
  for (int x = threadIdx.x; x < E; x += kRankThreads) count[static_cast<std::int64_t>(g) * E + x] = running[x];
}

// In: chunk_base[g, e] = the chunk's counts. Out: chunk_base[g, e] = expert e's choices in the
// chunks of its sequence before g; seq_base[s, e] = the first row of expert e's rows from sequence
// s; offsets [E + 1]. One block; each thread walks its experts' sequences and chunks in order.
__global__ __launch_bounds__(kScanThreads) void scan_kernel(std::int32_t* offsets, std::int32_t* chunk_base,
                                                            std::int32_t* seq_base, Segments seg, int E,
                                                            std::int64_t capacity) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    std::int64_t total = 0;  // expert e's rows from the sequences before
    for (int s = 0; s < seg.S; ++s) {
      std::int64_t in_seq = 0;
      for (int c = 0; c < seg.chunks; ++c) {
        std::int32_t& v = chunk_base[(static_cast<std::int64_t>(s) * seg.chunks + c) * E + e];
        const std::int32_t n = v;
        v = static_cast<std::int32_t>(in_seq);
        in_seq += n;
      }
      seq_base[static_cast<std::int64_t>(s) * E + e] = static_cast<std::int32_t>(total);
      total += capacity > 0 ? min(in_seq, capacity) : in_seq;
    }
    offsets[e + 1] = static_cast<std::int32_t>(total);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    for (int e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const std::int32_t o = offsets[e];
    for (int s = 0; s < seg.S; ++s) seq_base[static_cast<std::int64_t>(s) * E + e] += o;
  }
}

// Choice i: row_of[i] (in: its rank in its chunk) becomes its row, or -1; source[row] its id. Row
// i (R = N k): -1 from offsets[E] on. The two write disjoint rows.
__global__ __launch_bounds__(kThreads) void scatter_kernel(std::int32_t* row_of, std::int32_t* source,
                                                           const std::int32_t* experts,
                                                           const std::int32_t* chunk_base,
                                                           const std::int32_t* seq_base,
                                                           const std::int32_t* offsets, std::int64_t NK, int k,
                                                           int E, Segments seg, std::int64_t capacity,
                                                           std::int64_t token_offset) {
  const std::int32_t used = offsets[E];
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < NK;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t local = row_of[i];
    if (local >= 0) {
      const int e = experts[i];
      const std::int64_t s = i / seg.per_seq, c = (i % seg.per_seq) / kChunk;
      const std::int64_t in_seq = chunk_base[(s * seg.chunks + c) * E + e] + static_cast<std::int64_t>(local);
      if (capacity > 0 && in_seq >= capacity) {
        row_of[i] = -1;
      } else {
        const std::int64_t row = seq_base[s * E + e] + in_seq;
        row_of[i] = static_cast<std::int32_t>(row);
        source[row] = static_cast<std::int32_t>((token_offset + i / k) * E + e);
      }
    }
    if (i >= used) source[i] = -1;
  }
}

// out[r] = x[source[r] / E - token_offset], or zeros where source[r] < 0. Copies the bits.
template <bool VEC>
__global__ void gather_kernel(bf16* out, const bf16* x, const std::int32_t* source, int R, int C, int E,
                              std::int64_t token_offset) {
  const int chunks = (C + 7) / 8;
  for (int r = blockIdx.x * kRows + threadIdx.y; r < R; r += gridDim.x * kRows) {
    const std::int32_t src = source[r];
    const bf16* xr = src >= 0 ? x + (src / E - token_offset) * C : nullptr;
    bf16* o = out + static_cast<std::int64_t>(r) * C;
    for (int j = threadIdx.x; j < chunks; j += kLanes) {
      const int c = j * 8;
      if constexpr (VEC) {
        store16(o + c, xr ? load16(xr + c) : make_uint4(0u, 0u, 0u, 0u));
      } else {
        const int n = min(8, C - c);
        for (int q = 0; q < n; ++q) o[c + q] = xr ? xr[c + q] : __float2bfloat16_rn(0.0f);
      }
    }
  }
}

// dx[t] = sum over j of dout[row_of[t, j]] in j order (f32, as the CPU: bit for bit).
template <bool VEC>
__global__ void permute_backward_kernel(bf16* dx, const bf16* dout, const std::int32_t* row_of, int N, int k, int C,
                                        std::int64_t R) {
  const int chunks = (C + 7) / 8;
  for (int t = blockIdx.x * kRows + threadIdx.y; t < N; t += gridDim.x * kRows) {
    const std::int32_t* rows = row_of + static_cast<std::int64_t>(t) * k;
    for (int j = threadIdx.x; j < chunks; j += kLanes) {
      const int c = j * 8, valid = C - c;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int q = 0; q < k; ++q) {
        const std::int32_t r = rows[q];
        if (r < 0 || r >= R) continue;
        float v[8];
        load_chunk<VEC>(dout + static_cast<std::int64_t>(r) * C + c, valid, v);
#pragma unroll
        for (int m = 0; m < 8; ++m) acc[m] = __fadd_rn(acc[m], v[m]);
      }
      store_chunk<VEC>(dx + static_cast<std::int64_t>(t) * C + c, valid, acc);
    }
  }
}

unsigned row_blocks(std::int64_t rows) { return grid_for(rows, kRows); }

}  // namespace

std::int64_t moe_permute_scratch(int N, int k, int E, int seq_len, std::int64_t capacity) {
  if (static_cast<std::int64_t>(N) * k == 0) return 0;
  const Segments seg = segments_of(N, k, seq_len, capacity);
  return (static_cast<std::int64_t>(seg.S) * seg.chunks + seg.S) * E;
}

void moe_permute(std::int32_t* offsets, std::int32_t* row_of, std::int32_t* source, bf16* out, const bf16* x,
                 const std::int32_t* experts, std::int32_t* scratch, int N, int k, int E, int C, int seq_len,
                 std::int64_t capacity, std::int64_t token_offset, cudaStream_t s,
                 const std::function<void()>& indexed) {
  KILN_CHECK(E >= 1 && E <= kMoeMaxExperts, "moe_permute: the CUDA kernels take 1 to ", kMoeMaxExperts,
             " experts, got ", E);
  const std::int64_t NK = static_cast<std::int64_t>(N) * k;
  if (NK == 0) {
    KILN_CUDA_CHECK(cudaMemsetAsync(offsets, 0, (E + 1) * sizeof(std::int32_t), s));
    if (indexed) indexed();
    return;
  }
  const Segments seg = segments_of(N, k, seq_len, capacity);
  const int G = seg.S * seg.chunks;
  std::int32_t* chunk_base = scratch;
  std::int32_t* seq_base = scratch + static_cast<std::int64_t>(G) * E;
  rank_kernel<<<G, kRankThreads, (kRankWarps + 1) * E * sizeof(int), s>>>(row_of, chunk_base, experts, seg, E);
  KILN_CUDA_LAUNCH_CHECK();
  scan_kernel<<<1, kScanThreads, 0, s>>>(offsets, chunk_base, seq_base, seg, E, capacity);
  KILN_CUDA_LAUNCH_CHECK();
  scatter_kernel<<<grid_for(NK, kThreads), kThreads, 0, s>>>(row_of, source, experts, chunk_base, seq_base, offsets,
                                                              NK, k, E, seg, capacity, token_offset);
  KILN_CUDA_LAUNCH_CHECK();
  if (indexed) indexed();
  if (!out) return;
  const int R = static_cast<int>(NK);
  const dim3 block(kLanes, kRows);
  if (C % 8 == 0 && aligned16(out) && aligned16(x))
    gather_kernel<true><<<row_blocks(R), block, 0, s>>>(out, x, source, R, C, E, token_offset);
  else
    gather_kernel<false><<<row_blocks(R), block, 0, s>>>(out, x, source, R, C, E, token_offset);
  KILN_CUDA_LAUNCH_CHECK();
}

void moe_permute_backward(bf16* dx, const bf16* dout, const std::int32_t* row_of, int N, int k, int C,
                          cudaStream_t s) {
  if (static_cast<std::int64_t>(N) * C == 0) return;
  const std::int64_t R = static_cast<std::int64_t>(N) * k;
  const dim3 block(kLanes, kRows);
  if (C % 8 == 0 && aligned16(dx) && aligned16(dout))
    permute_backward_kernel<true><<<row_blocks(N), block, 0, s>>>(dx, dout, row_of, N, k, C, R);
  else
    permute_backward_kernel<false><<<row_blocks(N), block, 0, s>>>(dx, dout, row_of, N, k, C, R);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda
