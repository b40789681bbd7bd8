// Causal flash-attention forward (FlashAttention-2 style), two tensor-core paths:
//   * D = 64, 128: Hopper warpgroup MMA (wgmma, sm_90a), see attention_forward_wgmma_kernel.
//   * D = 16, 32: mma.sync m16n8k16 (their rows are too narrow for the 128-byte wgmma layout).
//
// mma.sync kernel: one block per (batch*head, 128-query block). Each warp owns 16 * MT query rows
// and keeps their Q fragments in registers; K and V tiles of 32 or 64 keys stream through a
// double-buffered cp.async pipeline in padded (bank-conflict-free) shared memory. Scores, online
// softmax (exp2, running max and row sums in fp32) and the P V product never leave registers: the
// score accumulators are repacked to bf16 as the A operand of the next mma. Key tiles after the
// block's last row are never loaded, and a warp skips tiles that are entirely above its rows; only
// tiles crossing the diagonal (or T) pay for the mask.
#include <type_traits>

#include "attention_common.cuh"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace attn {
namespace {

template <int D_, int MT_, int WARPS_, int BN_>
struct FwdCfg {
  static constexpr int D = D_, MT = MT_, WARPS = WARPS_, NT = 32 * WARPS;
  static constexpr int BM = 16 * MT * WARPS;  // query rows per block
  static constexpr int BN = BN_;              // keys per tile (a multiple of 32: dropout draws 32-key runs)
  static constexpr int kSmem = (BM + 4 * BN) * kPad<D> * 2;  // Q, then K and V double-buffered
};
// Two m-tiles per warp halve the shared-memory traffic per mma (each K/V fragment feeds two mmas).
// Every block has 128 query rows, which halves the K/V re-reads from L2 compared with 64-row blocks.
template <int D>
struct FwdTraits;
template <>
struct FwdTraits<16> {
  using Cfg = FwdCfg<16, 2, 4, 64>;
};
template <>
struct FwdTraits<32> {
  using Cfg = FwdCfg<32, 2, 4, 32>;
};

template <class C, bool DROPOUT, bool DOC>
__global__ void __launch_bounds__(C::NT) attention_forward_kernel(bf16* __restrict__ out, float* __restrict__ lse,
                                                                   const bf16* __restrict__ qkv, const Problem pb) {
  constexpr int D = C::D, MT = C::MT, BM = C::BM, BN = C::BN, NT = C::NT, P = kPad<D>;
  constexpr int KS = D / 16;   // k-steps over the head dimension
  constexpr int NTL = BN / 8;  // score n-tiles per key tile
  constexpr int DT = D / 8;    // output n-tiles
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + BM * P;
  bf16* sV = sK + 2 * BN * P;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int T = pb.T, H = pb.H;
  const int bh = blockIdx.x, b = bh / H, h = bh - b * H;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * BM;  // the longest (last) query blocks start first
  const int wr0 = q0 + warp * 16 * MT;                // first query row of this warp
  const std::int64_t ld = qkv_ld(pb, D);              // token stride of qkv
  const bf16* base = qkv + static_cast<std::int64_t>(b) * T * ld;
  const bf16* gQ = base + q_at(pb, h, D);
  const bf16* gK = base + k_at(pb, h, D);
  const bf16* gV = base + v_at(pb, h, D);
  const int n_tiles = (min(q0 + BM, T) + BN - 1) / BN;  // keys [0, last row of the block]

  load_tile<D, BM, NT>(sQ, gQ, ld, q0, T, tid);
  load_tile<D, BN, NT>(sK, gK, ld, 0, T, tid);
  load_tile<D, BN, NT>(sV, gV, ld, 0, T, tid);
  cp_async_commit();

  std::uint32_t qf[MT][KS][4];
  float o[MT][DT][4];
  float m[MT][2], l[MT][2];  // running max (log2 units) and this thread's partial row sums
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.0f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.0f;
  }

  // Dropout: n of (row, key 0) for the two rows each thread holds per m-tile.
  std::uint64_t row_n[MT][2] = {};
  std::uint64_t seed = 0, start = 0;
  const bool aligned = (T & 3) == 0;
  if constexpr (DROPOUT) {
    seed = pb.rng.seed;
    start = pb.rng.start();
    const std::uint64_t bhg = static_cast<std::uint64_t>(pb.seq_offset + b) * pb.heads_total + pb.head_offset + h;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        row_n[mt][hr] = (bhg * T + static_cast<std::uint64_t>(wr0 + mt * 16 + g + 8 * hr)) * T;
  }

  // Packed documents: the document start of each row this thread holds, and the smallest of the
  // warp's rows (key tiles before it are skipped).
  [[maybe_unused]] int rs[MT][2] = {};
  [[maybe_unused]] int warp_first = 0;
  if constexpr (DOC) {
    int lo = 0x7fffffff;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int row = wr0 + mt * 16 + g + 8 * hr;
        rs[mt][hr] = row < T ? pb.doc_start[static_cast<std::int64_t>(b) * T + row] : 0;
        if (row < T) lo = min(lo, rs[mt][hr]);
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    warp_first = lo;
  }

  const std::uint32_t k_frag = smem_addr(sK) + frag_b_offset<D>(lane) * 2;
  const std::uint32_t v_frag = smem_addr(sV) + frag_bt_offset<D>(lane) * 2;

  // One key tile: S = Q K^T, mask, online softmax, (dropout), O += P V.
  auto tile = [&](auto masked, int stage, int kv0) {
    constexpr bool MASK = decltype(masked)::value;
    float s[MT][NTL][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
    const std::uint32_t kb = k_frag + stage * BN * P * 2;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        std::uint32_t f[4];
        ldsm_x4(f, kb + (np * 16 * P + ks * 16) * 2);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(s[mt][2 * np], qf[mt][ks], f[0], f[1]);
          mma(s[mt][2 * np + 1], qf[mt][ks], f[2], f[3]);
        }
      }
    if constexpr (MASK) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = wr0 + mt * 16 + g + ((e >> 1) << 3);
            const int col = kv0 + nt * 8 + 2 * t + (e & 1);
            if (col > row || (DOC && col < rs[mt][e >> 1])) s[mt][nt][e] = -INFINITY;
          }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NTL; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hr], s[mt][nt][2 * hr + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[mt][hr], mx * pb.scale_log2);
        const float base = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet stays at 0
        const float corr = ex2(m[mt][hr] - base);
        m[mt][hr] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[mt][nt][2 * hr + e];
            x = ex2(fmaf(x, pb.scale_log2, -base));
            sum += x;
          }
        l[mt][hr] = l[mt][hr] * corr + sum;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          o[mt][dt][2 * hr] *= corr;
          o[mt][dt][2 * hr + 1] *= corr;
        }
      }
    if constexpr (DROPOUT) {  // after the row sums: normalisation uses the undropped probabilities
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
#pragma unroll
          for (int c = 0; c < BN / 32; ++c) {
            const std::uint32_t bits =
                keep_bits_row32(seed, start, row_n[mt][hr] + kv0 + 32 * c, pb.threshold, t, aligned);
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
              for (int e = 0; e < 2; ++e)
                if (!((bits >> (q * 8 + 2 * t + e)) & 1u)) s[mt][4 * c + q][2 * hr + e] = 0.0f;
          }
    }
    const std::uint32_t vb = v_frag + stage * BN * P * 2;
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) {
      std::uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = pack_bf16(s[mt][2 * ks][0], s[mt][2 * ks][1]);
        pa[mt][1] = pack_bf16(s[mt][2 * ks][2], s[mt][2 * ks][3]);
        pa[mt][2] = pack_bf16(s[mt][2 * ks + 1][0], s[mt][2 * ks + 1][1]);
        pa[mt][3] = pack_bf16(s[mt][2 * ks + 1][2], s[mt][2 * ks + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        std::uint32_t f[4];
        ldsm_x4_t(f, vb + (ks * 16 * P + dp * 16) * 2);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma(o[mt][2 * dp], pa[mt], f[0], f[1]);
          mma(o[mt][2 * dp + 1], pa[mt], f[2], f[3]);
        }
      }
    }
  };

  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it & 1;
    if (it + 1 < n_tiles) {  // prefetch the next tile into the other stage (freed by the last barrier)
      load_tile<D, BN, NT>(sK + (stage ^ 1) * BN * P, gK, ld, (it + 1) * BN, T, tid);
      load_tile<D, BN, NT>(sV + (stage ^ 1) * BN * P, gV, ld, (it + 1) * BN, T, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (it == 0) {
      const std::uint32_t qa = smem_addr(sQ + warp * 16 * MT * P) + frag_a_offset<D>(lane) * 2;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) ldsm_x4(qf[mt][ks], qa + (mt * 16 * P + ks * 16) * 2);
    }
    const int kv0 = it * BN;
    if (kv0 <= wr0 + 16 * MT - 1) {  // else every key of the tile lies after every row of this warp
      if constexpr (DOC) {             // every tile masked; none before the warp's first document
        if (kv0 + BN - 1 >= warp_first) tile(std::true_type{}, stage, kv0);
      } else if (kv0 + BN - 1 > wr0) {
        tile(std::true_type{}, stage, kv0);
      } else {
        tile(std::false_type{}, stage, kv0);
      }
    }
    __syncthreads();
  }

  // Epilogue: full row sums, lse, O / l (times 1 / (1 - p)), staged through this warp's own Q rows
  // so the global stores are 16 bytes wide.
  bf16* sO = sQ + warp * 16 * MT * P;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float sum = l[mt][hr];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int row = wr0 + mt * 16 + g + 8 * hr;
      if (t == 0 && row < T) lse[static_cast<std::int64_t>(bh) * T + row] = m[mt][hr] * kLn2 + logf(sum);
      const float inv = pb.keep_scale / sum;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        *reinterpret_cast<std::uint32_t*>(sO + (mt * 16 + g + 8 * hr) * P + dt * 8 + 2 * t) =
            pack_bf16(o[mt][dt][2 * hr] * inv, o[mt][dt][2 * hr + 1] * inv);
    }
  __syncwarp();
  store_rows<D, 16 * MT>(out + (static_cast<std::int64_t>(b) * T * H + h) * D, static_cast<std::int64_t>(H) * D,
                         wr0, T, sO, lane);
}

// ---------------------------------------------------------------------------------------------
// wgmma kernel (D = 64, 128)
// ---------------------------------------------------------------------------------------------
// Each warpgroup (4 warps) owns 64 query rows; the block's NWG warpgroups share K and V tiles of
// 64 keys, double-buffered through cp.async into 128-byte-swizzled shared memory. S = Q K^T
// (m64n64k16, both operands in shared memory) and O += P V (m64nDk16, P from registers, V
// MN-major) run on the asynchronous warpgroup MMA; the softmax between them is the mma.sync
// kernel's, since the wgmma accumulator fragments have the mma.sync layout. Softmax and MMA
// overlap across the warpgroups resident on a multiprocessor (measured on an H200: issuing the
// next tile's S before the softmax, with three K/V stages, was no faster; nor were 128-key tiles
// or 1, 3 or 4 warpgroups per block without dropout).
template <int D_, int NWG_>
struct FwdWgCfg {
  static constexpr int D = D_, NWG = NWG_, NT = 128 * NWG;
  static constexpr int BM = 64 * NWG;  // query rows per block
  static constexpr int BN = 64;        // keys per tile
  static constexpr int kQBytes = BM * D * 2, kKVBytes = BN * D * 2;
  static constexpr int kSmem = kQBytes + 4 * kKVBytes + 1024;  // + slack to align the swizzle atoms
  static_assert(D % 64 == 0, "rows are whole 128-byte swizzle chunks");
};
// Two warpgroups per block: 119 (D = 64) and 165 (D = 128) registers, so two blocks (D = 64) or
// one block per multiprocessor. Dropout's Philox state costs registers (150 at D = 64 would leave
// one block per SM): there one warpgroup per block fits three (D = 64) or two (D = 128) blocks.
template <int D, bool DROPOUT>
struct FwdWgTraits {
  using Cfg = FwdWgCfg<D, DROPOUT ? 1 : 2>;
};

// (The explicit 1 block per SM in the launch bounds keeps ptxas from capping registers for an
// occupancy of its own choosing, which spilled.)
template <class C, bool DROPOUT, bool DOC>
__global__ void __launch_bounds__(C::NT, 1)
    attention_forward_wgmma_kernel(bf16* __restrict__ out, float* __restrict__ lse, const bf16* __restrict__ qkv,
                                   const Problem pb) {
  constexpr int D = C::D, BM = C::BM, BN = C::BN, NT = C::NT;
  constexpr int NTL = BN / 8;  // score n-tiles per key tile
  constexpr int DT = D / 8;    // output n-tiles
  extern __shared__ __align__(1024) unsigned char smem[];
  const std::uint32_t sQ = (smem_addr(smem) + 1023u) & ~1023u;  // [D / 64][BM][128 B]
  const std::uint32_t sK = sQ + C::kQBytes;                       // [2][D / 64][BN][128 B]
  const std::uint32_t sV = sK + 2 * C::kKVBytes;                  // [2][D / 64][BN][128 B]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, g = lane >> 2, t = lane & 3;
  const int T = pb.T, H = pb.H;
  const int bh = blockIdx.x, b = bh / H, h = bh - b * H;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * BM;  // the longest (last) query blocks start first
  const int wg0 = q0 + wg * 64;                      // first query row of this warpgroup
  const int wr0 = wg0 + (warp & 3) * 16;             // first query row of this warp
  const std::int64_t ld = qkv_ld(pb, D);
  const bf16* base = qkv + static_cast<std::int64_t>(b) * T * ld;
  const bf16* gQ = base + q_at(pb, h, D);
  const bf16* gK = base + k_at(pb, h, D);
  const bf16* gV = base + v_at(pb, h, D);
  const int n_tiles = (min(q0 + BM, T) + BN - 1) / BN;

  load_tile_sw128<D, BM, NT>(sQ, gQ, ld, q0, T, tid);
  load_tile_sw128<D, BN, NT>(sK, gK, ld, 0, T, tid);
  load_tile_sw128<D, BN, NT>(sV, gV, ld, 0, T, tid);
  cp_async_commit();

  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dt][e] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  std::uint64_t row_n[2] = {};
  std::uint64_t seed = 0, start = 0;
  const bool aligned = (T & 3) == 0;
  if constexpr (DROPOUT) {
    seed = pb.rng.seed;
    start = pb.rng.start();
    const std::uint64_t bhg = static_cast<std::uint64_t>(pb.seq_offset + b) * pb.heads_total + pb.head_offset + h;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) row_n[hr] = (bhg * T + static_cast<std::uint64_t>(wr0 + g + 8 * hr)) * T;
  }

  [[maybe_unused]] int rs[2] = {};  // packed documents: the document start of each row this thread holds
  if constexpr (DOC) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = wr0 + g + 8 * hr;
      rs[hr] = row < T ? pb.doc_start[static_cast<std::int64_t>(b) * T + row] : 0;
    }
  }

  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it & 1;
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // tile `it` is in; every warpgroup is done with tile it - 1 (the other stage)
    if (it + 1 < n_tiles) {
      load_tile_sw128<D, BN, NT>(sK + (stage ^ 1) * C::kKVBytes, gK, ld, (it + 1) * BN, T, tid);
      load_tile_sw128<D, BN, NT>(sV + (stage ^ 1) * C::kKVBytes, gV, ld, (it + 1) * BN, T, tid);
      cp_async_commit();
    }
    const int kv0 = it * BN;
    if (kv0 > wg0 + 63) continue;  // every key after every row of this warpgroup (uniform in it)

    // S = Q K^T
    float s[NTL][4];
    const std::uint32_t kst = sK + stage * C::kKVBytes, vst = sV + stage * C::kKVBytes;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma_ss<BN>(s, sw128_desc(sQ + (ks >> 2) * BM * 128 + wg * 64 * 128 + (ks & 3) * 32, 16),
                   sw128_desc(kst + (ks >> 2) * BN * 128 + (ks & 3) * 32, 16), ks > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);

    if (DOC || kv0 + BN - 1 > wr0) {  // the tile crosses this warp's diagonal (or T); documents: any
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = wr0 + g + ((e >> 1) << 3);
          const int col = kv0 + nt * 8 + 2 * t + (e & 1);
          if (col > row || (DOC && col < rs[e >> 1])) s[nt][e] = -INFINITY;
        }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * hr], s[nt][2 * hr + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[hr], mx * pb.scale_log2);
      const float base = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet stays at 0
      const float corr = ex2(m[hr] - base);
      m[hr] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[nt][2 * hr + e];
          x = ex2(fmaf(x, pb.scale_log2, -base));
          sum += x;
        }
      l[hr] = l[hr] * corr + sum;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        o[dt][2 * hr] *= corr;
        o[dt][2 * hr + 1] *= corr;
      }
    }
    if constexpr (DROPOUT) {  // after the row sums: normalisation uses the undropped probabilities
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int c = 0; c < BN / 32; ++c) {
          const std::uint32_t bits = keep_bits_row32(seed, start, row_n[hr] + kv0 + 32 * c, pb.threshold, t, aligned);
#pragma unroll
          for (int q = 0; q < 4; ++q)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (!((bits >> (q * 8 + 2 * t + e)) & 1u)) s[4 * c + q][2 * hr + e] = 0.0f;
        }
    }

    // O += P V
    std::uint32_t pa[BN / 16][4];
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) {
      pa[ks][0] = pack_bf16(s[2 * ks][0], s[2 * ks][1]);
      pa[ks][1] = pack_bf16(s[2 * ks][2], s[2 * ks][3]);
      pa[ks][2] = pack_bf16(s[2 * ks + 1][0], s[2 * ks + 1][1]);
      pa[ks][3] = pack_bf16(s[2 * ks + 1][2], s[2 * ks + 1][3]);
    }
    fence_regs(o);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) wgmma_rs_nmajor<D>(o, pa[ks], sw128_desc(vst + ks * 16 * 128, BN * 128));
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
  }

  // Epilogue: full row sums, lse, O / l (times 1 / (1 - p)).
  bf16* gO = out + (static_cast<std::int64_t>(b) * T * H + h) * D;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float sum = l[hr];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = wr0 + g + 8 * hr;
    if (row < T) {
      if (t == 0) lse[static_cast<std::int64_t>(bh) * T + row] = m[hr] * kLn2 + logf(sum);
      const float inv = pb.keep_scale / sum;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        *reinterpret_cast<std::uint32_t*>(gO + static_cast<std::int64_t>(row) * H * D + dt * 8 + 2 * t) =
            pack_bf16(o[dt][2 * hr] * inv, o[dt][2 * hr + 1] * inv);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------
template <class C, bool DROPOUT, bool DOC>
void launch_forward(bf16* out, float* lse, const bf16* qkv, const Problem& pb, cudaStream_t s) {
  auto kernel = attention_forward_kernel<C, DROPOUT, DOC>;
  KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
  const dim3 grid(static_cast<unsigned>(pb.B * pb.H), static_cast<unsigned>((pb.T + C::BM - 1) / C::BM));
  kernel<<<grid, C::NT, C::kSmem, s>>>(out, lse, qkv, pb);
  KILN_CUDA_LAUNCH_CHECK();
}

template <class C, bool DROPOUT, bool DOC>
void launch_forward_wgmma(bf16* out, float* lse, const bf16* qkv, const Problem& pb, cudaStream_t s) {
  auto kernel = attention_forward_wgmma_kernel<C, DROPOUT, DOC>;
  KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
  const dim3 grid(static_cast<unsigned>(pb.B * pb.H), static_cast<unsigned>((pb.T + C::BM - 1) / C::BM));
  kernel<<<grid, C::NT, C::kSmem, s>>>(out, lse, qkv, pb);
  KILN_CUDA_LAUNCH_CHECK();
}

template <int D, bool DROPOUT, bool DOC>
void run_forward(bf16* out, float* lse, const bf16* qkv, const Problem& pb, cudaStream_t s) {
  if constexpr (D >= 64)
    launch_forward_wgmma<typename FwdWgTraits<D, DROPOUT>::Cfg, DROPOUT, DOC>(out, lse, qkv, pb, s);
  else
    launch_forward<typename FwdTraits<D>::Cfg, DROPOUT, DOC>(out, lse, qkv, pb, s);
}

template <int D>
void dispatch_forward(bf16* out, float* lse, const bf16* qkv, const Problem& pb, bool dropout, cudaStream_t s) {
  const bool doc = pb.doc_start != nullptr;
  if (dropout)
    doc ? run_forward<D, true, true>(out, lse, qkv, pb, s) : run_forward<D, true, false>(out, lse, qkv, pb, s);
  else
    doc ? run_forward<D, false, true>(out, lse, qkv, pb, s) : run_forward<D, false, false>(out, lse, qkv, pb, s);
}

}  // namespace
}  // namespace attn

void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int H, int D, float scale, float dropout,
                       rng::PhiloxArgs rng, int head_offset, int heads_total, std::int64_t seq_offset,
                       cudaStream_t s, int kv_heads, const std::int32_t* doc_start) {
  attn::Problem pb = attn::make_problem(B, T, H, D, scale, dropout, rng, head_offset, heads_total, seq_offset,
                                        "attention_forward", kv_heads);
  pb.doc_start = doc_start;
  if (static_cast<std::int64_t>(B) * T * H == 0) return;
  KILN_CHECK(attn::aligned16(out) && attn::aligned16(qkv), "attention_forward: qkv and out must be 16-byte aligned");
  KILN_CHECK(static_cast<std::int64_t>(B) * H <= 0x7fffffff, "attention_forward: B * H = ", static_cast<std::int64_t>(B) * H, " is too large");
  const bool drop = dropout > 0;
  switch (D) {
    case 16: attn::dispatch_forward<16>(out, lse, qkv, pb, drop, s); break;
    case 32: attn::dispatch_forward<32>(out, lse, qkv, pb, drop, s); break;
    case 64: attn::dispatch_forward<64>(out, lse, qkv, pb, drop, s); break;
    default: attn::dispatch_forward<128>(out, lse, qkv, pb, drop, s); break;
  }
}

}  // namespace kiln::cuda
