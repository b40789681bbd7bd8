#pragma once
// Device helpers shared by the flash-attention forward and backward kernels (sm_80+ instructions:
// cp.async, ldmatrix, mma.sync m16n8k16 bf16 -> f32; sm_90a: wgmma for the forward), plus the
// host-side argument checks.
//
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4), which the kernels rely on:
//   A 16x16 (row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B 16x8  (k x n):     b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g)
//   C 16x8  (f32):       c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, 2t), (g+8, 2t+1)
// So a C tile pair (n-tiles 2k, 2k+1) repacked to bf16 is directly the A operand of the next mma
// (P -> P V), and ldmatrix (.trans for operands stored k-major) produces A and B fragments from
// row-major shared-memory tiles.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kiln/ops/cuda/launchers.hpp"
#include "kiln/tensor/alignment.hpp"
#include "kiln/rng/philox.hpp"
#include "kiln/core/error.hpp"

namespace kiln::cuda::attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Shared-memory tiles are rows of D bf16 padded by 16 bytes: the row stride (2D + 16 bytes) is an
// odd number of 16-byte units, so the 8 row addresses of one ldmatrix phase hit 8 different bank
// groups (conflict-free for every D), and rows stay 16-byte aligned for cp.async.
template <int D>
inline constexpr int kPad = D + 8;

// What every attention kernel needs to know about the problem.
struct Problem {
  int B, T, H;
  int K;                         // key/value heads (H: multi-head); query head h reads kv head h / (H / K)
  int head_offset, heads_total;  // for the dropout stream index
  std::int64_t seq_offset;       // likewise: the global index of sequence 0
  float scale;                   // softmax scale
  float scale_log2;              // scale * log2(e): scores go through exp2
  float keep_scale;              // 1 / (1 - p), 1 without dropout
  std::uint32_t threshold;       // dropout_threshold(p)
  rng::PhiloxArgs rng;
  // [B, T] or null: packed documents; query i reads keys [doc_start[b, i], i] only (the kernels'
  // DOC instantiations, which mask every tile they visit).
  const std::int32_t* doc_start;
};

// The fused QKV's token stride ([B, T, H + 2K, D]) and where query head h's q, k and v start in a
// token's row.
__host__ __device__ __forceinline__ std::int64_t qkv_ld(const Problem& p, int D) {
  return static_cast<std::int64_t>(p.H + 2 * p.K) * D;
}
__host__ __device__ __forceinline__ std::int64_t q_at(const Problem&, int h, int D) {
  return static_cast<std::int64_t>(h) * D;
}
__host__ __device__ __forceinline__ std::int64_t k_at(const Problem& p, int h, int D) {
  return static_cast<std::int64_t>(p.H + h / (p.H / p.K)) * D;
}
__host__ __device__ __forceinline__ std::int64_t v_at(const Problem& p, int h, int D) {
  return static_cast<std::int64_t>(p.H + p.K + h / (p.H / p.K)) * D;
}

// ---------------------------------------------------------------------------------------------
// PTX wrappers
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; with valid == false the destination is zero-filled (no read).
__device__ __forceinline__ void cp_async16(std::uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async4(std::uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lane l gives the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void ldsm_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a * b (16x16 bf16 times 16x8 bf16, f32 accumulators).
__device__ __forceinline__ void mma(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as bf16x2 (round to nearest even); `lo` is the element with the smaller column.
__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<std::uint32_t*>(&v);
}

// 2^x (MUFU; ~2 ulp, exp2(-inf) = 0).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------------------------
// Fragment address helpers (element offsets inside a [rows][kPad<D>] tile, per lane)
// ---------------------------------------------------------------------------------------------
// A operand (16 rows x 16 cols at row 0, col 0): matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15).
template <int D>
__device__ __forceinline__ int frag_a_offset(int lane) {
  return (lane & 15) * kPad<D> + ((lane >> 4) << 3);
}
// B operand stored n-major (rows = n, e.g. K for Q K^T): one x4 load gives {b0, b1} of the n-tile at
// rows 0-7 and {b0, b1} of the n-tile at rows 8-15, for the k-step at columns 0-15.
template <int D>
__device__ __forceinline__ int frag_b_offset(int lane) {
  return ((lane & 7) + ((lane >> 4) << 3)) * kPad<D> + (((lane >> 3) & 1) << 3);
}
// B operand stored k-major (rows = k, e.g. V for P V), loaded with .trans: one x4 load gives
// {b0, b1} of the n-tile at columns 0-7 and of the n-tile at columns 8-15, for rows (k) 0-15.
template <int D>
__device__ __forceinline__ int frag_bt_offset(int lane) {
  return ((lane & 7) + (((lane >> 3) & 1) << 3)) * kPad<D> + ((lane >> 4) << 3);
}

// ---------------------------------------------------------------------------------------------
// Global -> shared tile copies
// ---------------------------------------------------------------------------------------------
// Rows [row0, row0 + ROWS) of a row-strided [T, D] bf16 matrix (row stride `ld` elements) into a
// padded shared tile. Rows >= T are zero-filled: padded keys/values must be finite, since a masked
// probability of 0 times a NaN would still poison an mma.
template <int D, int ROWS, int NT>
__device__ __forceinline__ void load_tile(bf16* smem, const bf16* g, std::int64_t ld, int row0, int T, int tid) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kTotal = ROWS * kChunks;
  const std::uint32_t base = smem_addr(smem);
#pragma unroll
  for (int i = 0; i < (kTotal + NT - 1) / NT; ++i) {
    const int c = tid + i * NT;
    if (kTotal % NT == 0 || c < kTotal) {
      const int r = c / kChunks, k = c % kChunks;
      const int t = row0 + r;
      const bool ok = t < T;
      const bf16* src = ok ? g + static_cast<std::int64_t>(t) * ld + k * 8 : g;
      cp_async16(base + (r * kPad<D> + k * 8) * 2, src, ok);
    }
  }
}

// Copies rows of a padded shared tile to global memory with 16-byte stores (rows >= T skipped).
// Used by one warp for its own rows after it staged its results there.
template <int D, int ROWS>
__device__ __forceinline__ void store_rows(bf16* g, std::int64_t ld, int row0, int T, const bf16* smem, int lane) {
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int i = 0; i < (ROWS * kChunks + 31) / 32; ++i) {
    const int c = lane + i * 32;
    if ((ROWS * kChunks) % 32 == 0 || c < ROWS * kChunks) {
      const int r = c / kChunks, k = c % kChunks;
      if (row0 + r < T)
        *reinterpret_cast<uint4*>(g + static_cast<std::int64_t>(row0 + r) * ld + k * 8) =
            *reinterpret_cast<const uint4*>(smem + r * kPad<D> + k * 8);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Hopper warpgroup MMA (sm_90a): the forward's tensor-core path
// ---------------------------------------------------------------------------------------------
// Operands in shared memory use the 128-byte swizzle: a tile of R rows x 64 bf16 (128 bytes a row)
// stores the 16-byte unit u of row r at r * 128 + ((u ^ (r % 8)) * 16), from a 1024-byte aligned
// base; wider rows are split into such 64-column chunks. The hardware applies the same XOR to
// the address bits, so a k-step inside a chunk just moves the start address by 32 bytes.
// Descriptor (PTX "matrix descriptor"): start >> 4, leading byte offset >> 4 at bit 16, stride
// byte offset >> 4 at bit 32, swizzle mode 1 (128 B) at bit 62. For a K-major operand the stride
// offset is the step between 8-row groups (1024) and the leading offset is unused; for an
// MN-major operand (V in P V) the leading offset steps between 64-column chunks along N and the
// stride offset between groups of 8 k-rows (1024).
__device__ __forceinline__ std::uint64_t sw128_desc(std::uint32_t addr, std::uint32_t lead) {
  return static_cast<std::uint64_t>((addr & 0x3ffff) >> 4) | static_cast<std::uint64_t>(lead >> 4) << 16 |
         static_cast<std::uint64_t>(1024 >> 4) << 32 | 1ull << 62;
}

// Rows [row0, row0 + ROWS) of a row-strided [T, D] bf16 matrix into 128-byte-swizzled chunks at
// `base` (chunk c holds columns 64c .. 64c + 63 of all ROWS rows). Rows >= T are zero-filled.
template <int D, int ROWS, int NT>
__device__ __forceinline__ void load_tile_sw128(std::uint32_t base, const bf16* g, std::int64_t ld, int row0, int T,
                                                int tid) {
  constexpr int kUnits = D / 8;  // 16-byte units per row
  constexpr int kTotal = ROWS * kUnits;
#pragma unroll
  for (int i = 0; i < (kTotal + NT - 1) / NT; ++i) {
    const int c = tid + i * NT;
    if (kTotal % NT == 0 || c < kTotal) {
      const int r = c / kUnits, u = c % kUnits;
      const int t = row0 + r;
      const bool ok = t < T;
      const bf16* src = ok ? g + static_cast<std::int64_t>(t) * ld + u * 8 : g;
      cp_async16(base + (u >> 3) * ROWS * 128 + r * 128 + (((u & 7) ^ (r & 7)) << 4), src, ok);
    }
  }
}

// Makes this thread's completed cp.async writes visible to the tensor cores' (async proxy) reads;
// a barrier must follow before other threads' wgmma read them.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of wgmma accumulators across the asynchronous MMA.
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// d (64 x N, f32, accumulator layout of m64nNk16: warp w of the group holds rows 16w .. 16w + 15
// exactly as an mma.sync C fragment, n-tile i in d[i]) = (accumulate ? d : 0) + A B, with A
// (64 x 16) and B (16 x N, K-major) from shared memory.
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], std::uint64_t a, std::uint64_t b, int accumulate);
// d += A B with A (64 x 16) from registers in the mma.sync A layout (warp w: rows 16w ..) and B
// MN-major in shared memory.
template <int N>
__device__ __forceinline__ void wgmma_rs_nmajor(float (&d)[N / 8][4], const std::uint32_t (&a)[4], std::uint64_t b);
template <>
__device__ __forceinline__ void wgmma_ss<64>(float (&d)[8][4], std::uint64_t a, std::uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, "
      "1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(a), "l"(b), "r"(accumulate));
}
template <>
__device__ __forceinline__ void wgmma_rs_nmajor<64>(float (&d)[8][4], const std::uint32_t (&a)[4], std::uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, "
      "%35}, %36, 1, 1, 1, 1;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_rs_nmajor<128>(float (&d)[16][4], const std::uint32_t (&a)[4], std::uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, "
      "%35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, "
      "%57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]),
        "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]),
        "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// ---------------------------------------------------------------------------------------------
// Dropout masks. Probability (b, h, i, j) is kept iff dropout_keep(philox_u32(seed, start, n)) with
// n = (((seq_offset + b) * heads_total + head_offset + h) * T + i) * T + j, i.e. word n % 4 of Philox block
// start + n / 4. Each block gives 4 consecutive n, so lanes compute disjoint blocks and exchange
// keep bits by shuffles: 1/4 of a Philox call per probability (plus one block per run when T is
// not a multiple of 4 and runs do not start on a block boundary).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ std::uint32_t keep4(std::uint64_t seed, std::uint64_t block, std::uint32_t threshold) {
  const rng::Philox4 w = rng::philox_block(seed, block);
  return static_cast<std::uint32_t>(rng::dropout_keep(w.v[0], threshold)) |
         static_cast<std::uint32_t>(rng::dropout_keep(w.v[1], threshold)) << 1 |
         static_cast<std::uint32_t>(rng::dropout_keep(w.v[2], threshold)) << 2 |
         static_cast<std::uint32_t>(rng::dropout_keep(w.v[3], threshold)) << 3;
}

__device__ __forceinline__ std::uint64_t shfl_xor64(std::uint64_t v, int m) {
  const std::uint32_t lo = __shfl_xor_sync(0xffffffffu, static_cast<std::uint32_t>(v), m);
  const std::uint32_t hi = __shfl_xor_sync(0xffffffffu, static_cast<std::uint32_t>(v >> 32), m);
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}

// Keep bits of 32 consecutive probabilities n0 .. n0 + 31 (bit k <-> n0 + k), computed by the four
// lanes of a quad together (all four pass the same n0; `t` = lane % 4). For the row layout of an
// mma C fragment: a quad holds one row's 32 columns of four consecutive n-tiles. `aligned` (every
// n0 a multiple of 4, i.e. T % 4 == 0) must be warp-uniform.
__device__ __forceinline__ std::uint32_t keep_bits_row32(std::uint64_t seed, std::uint64_t start, std::uint64_t n0,
                                                         std::uint32_t threshold, int t, bool aligned) {
  const std::uint64_t blk = start + (n0 >> 2);
  const int off = static_cast<int>(n0 & 3);
  std::uint64_t bits = static_cast<std::uint64_t>(keep4(seed, blk + t, threshold)) << (4 * t) |
                       static_cast<std::uint64_t>(keep4(seed, blk + 4 + t, threshold)) << (16 + 4 * t);
  if (!aligned && t == 0 && off != 0)  // the run straddles a ninth block
    bits |= static_cast<std::uint64_t>(keep4(seed, blk + 8, threshold)) << 32;
  bits |= shfl_xor64(bits, 1);
  bits |= shfl_xor64(bits, 2);
  return static_cast<std::uint32_t>(bits >> off);
}

// Keep bits for the column layout of a 16x8 C tile whose rows are 16 consecutive keys j0 .. j0+15
// and whose columns are 8 consecutive queries (i.e. a tile of P^T). `n_col` is n of (query of
// column lane / 4, key j0). Returns, for this lane's columns 2t and 2t + 1, 16-bit masks over the
// rows (bit r <-> key j0 + r) in m0 and m1; c0 <-> m0 bit g, c1 <-> m1 bit g, c2 <-> m0 bit g + 8,
// c3 <-> m1 bit g + 8. `n_col_lo` is n of (query of column lane % 8, key j0), needed for the fifth
// block when !aligned.
__device__ __forceinline__ void keep_bits_col16(std::uint64_t seed, std::uint64_t start, std::uint64_t n_col,
                                                std::uint64_t n_col_lo, std::uint32_t threshold, int lane,
                                                bool aligned, std::uint32_t& m0, std::uint32_t& m1) {
  const int line = lane >> 2, part = lane & 3;  // column `line`, blocks `part` (and 4 below)
  std::uint32_t bits = keep4(seed, start + (n_col >> 2) + part, threshold) << (4 * part);
  bits |= __shfl_xor_sync(0xffffffffu, bits, 1);
  bits |= __shfl_xor_sync(0xffffffffu, bits, 2);
  std::uint64_t full = bits;
  if (!aligned) {  // lanes 0..7 draw the fifth block of column `lane`
    std::uint32_t fifth = 0;
    if (lane < 8) fifth = keep4(seed, start + (n_col_lo >> 2) + 4, threshold);
    fifth = __shfl_sync(0xffffffffu, fifth, line);
    full |= static_cast<std::uint64_t>(fifth) << 16;
  }
  const std::uint32_t mine = static_cast<std::uint32_t>(full >> (n_col & 3)) & 0xffffu;
  const int t = lane & 3;
  m0 = __shfl_sync(0xffffffffu, mine, (2 * t) * 4);
  m1 = __shfl_sync(0xffffffffu, mine, (2 * t + 1) * 4);
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------
// Checks the arguments shared by forward and backward (throws kiln::Error) and returns the Problem.
inline Problem make_problem(int B, int T, int H, int D, float scale, float dropout, rng::PhiloxArgs rng,
                            int head_offset, int heads_total, std::int64_t seq_offset, const char* op, int K) {
  KILN_CHECK(D == 16 || D == 32 || D == 64 || D == 128, op, ": head dim D = ", D,
             " is not supported (the CUDA kernels take D = 16, 32, 64 or 128)");
  KILN_CHECK(B >= 0 && T >= 0 && H >= 0, op, ": bad shape B=", B, " T=", T, " H=", H);
  // Key/query blocks are at least 64 rows and run along grid.y (at most 65535 blocks).
  KILN_CHECK((static_cast<std::int64_t>(T) + 63) / 64 <= 65535, op, ": T = ", T, " is too long");
  KILN_CHECK(scale > 0 && scale < 3.0e38f, op, ": scale must be positive and finite, got ", scale);
  KILN_CHECK(dropout >= 0 && dropout < 1, op, ": dropout must be in [0, 1), got ", dropout);
  if (heads_total == 0) heads_total = H;
  KILN_CHECK(head_offset >= 0 && head_offset + H <= heads_total, op, ": heads [", head_offset, ", ",
             head_offset + H, ") outside ", heads_total);
  if (K == 0) K = H;
  KILN_CHECK(K > 0 ? H % K == 0 : H == 0, op, ": ", K, " key/value heads do not divide ", H, " query heads");
  Problem p{};
  p.B = B;
  p.T = T;
  p.H = H;
  p.K = K > 0 ? K : 1;
  p.head_offset = head_offset;
  p.heads_total = heads_total;
  KILN_CHECK(seq_offset >= 0, op, ": negative sequence offset ", seq_offset);
  p.seq_offset = seq_offset;
  p.scale = scale;
  p.scale_log2 = scale * kLog2e;
  p.keep_scale = dropout > 0 ? 1.0f / (1.0f - dropout) : 1.0f;
  p.threshold = rng::dropout_threshold(dropout);
  p.rng = rng;
  return p;
}

using kiln::aligned16;  // kiln/tensor/alignment.hpp

}  // namespace kiln::cuda::attn
