// Causal flash-attention backward, deterministic (no atomics: every output element is written by
// exactly one thread, after a reduction in a fixed order). Three kernels:
//   1. dsum:  D_i = dO_i . O_i (fp32, into the scratch buffer), the softmax-backward row term.
//   2. dK/dV: one block per 64 keys; each warp owns 16 keys (K, V fragments stay in registers at
//      D <= 64) and walks the query tiles from the diagonal to T, recomputing P^T = exp(K Q^T - lse)
//      in the transposed orientation so P^T and dS^T are directly the A operands of dV += P^T dO
//      and dK += dS^T Q. Q, dO, lse and D stream through a double-buffered cp.async pipeline.
//   3. dQ:    one block per 64 queries; each warp owns 16 query rows (Q, dO fragments in
//      registers) and walks the key tiles up to the diagonal: S, dP, dS again, dQ += dS K.
// Recomputing S and dP in the dQ kernel costs 3 of the 7 mma passes, the price of determinism.
// Dropout draws the same Philox bits as the forward (see attention_common.cuh).
#include <type_traits>

#include "attention_common.cuh"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace attn {
namespace {

// ---------------------------------------------------------------------------------------------
// 1. D_i = sum_d dO[i, d] * O[i, d]; D / 8 lanes per row, 16-byte loads, fixed shuffle tree.
// ---------------------------------------------------------------------------------------------
template <int D>
__global__ void __launch_bounds__(256) attention_dsum_kernel(float* __restrict__ dsum, const bf16* __restrict__ dout,
                                                             const bf16* __restrict__ out, int T, int H,
                                                             std::int64_t rows) {
  constexpr int L = D / 8;
  const std::int64_t gid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t row = gid / L;  // row of out: (b * T + t) * H + h
  const int part = static_cast<int>(gid % L);
  float acc = 0.0f;
  if (row < rows) {
    const uint4 x = *reinterpret_cast<const uint4*>(dout + row * D + part * 8);
    const uint4 y = *reinterpret_cast<const uint4*>(out + row * D + part * 8);
    const std::uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // a bf16 is the top half of a float
      acc = fmaf(bits_float(xs[k] << 16), bits_float(ys[k] << 16), acc);
      acc = fmaf(bits_float(xs[k] & 0xffff0000u), bits_float(ys[k] & 0xffff0000u), acc);
    }
  }
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (row < rows && part == 0) {
    const std::int64_t bt = row / H;
    const int h = static_cast<int>(row - bt * H);
    const std::int64_t b = bt / T, t = bt - b * T;
    dsum[(b * H + h) * T + t] = acc;
  }
}

// ---------------------------------------------------------------------------------------------
// 2. dK, dV
// ---------------------------------------------------------------------------------------------
template <int D_, int WARPS_, int BM_, bool KV_REGS_>
struct DkvCfg {
  static constexpr int D = D_, WARPS = WARPS_, NT = 32 * WARPS;
  static constexpr int BN = 16 * WARPS;  // keys per block
  static constexpr int BM = BM_;         // queries per tile
  static constexpr bool KV_REGS = KV_REGS_;
  // K, V; Q and dO double-buffered; lse and D double-buffered (and, packed documents, the queries'
  // document starts: kDocSmem more).
  static constexpr int kSmem = (2 * BN + 4 * BM) * kPad<D> * 2 + 4 * BM * 4;
  static constexpr int kDocSmem = 2 * BM * 4;
};
// At D = 128 the dK, dV accumulators alone take 128 registers, so K and V fragments are re-read
// from shared memory each tile and the query tile is halved (ptxas: no spills either way).
template <int D>
struct DkvTraits {
  using Cfg = DkvCfg<D, 4, 64, true>;
};
template <>
struct DkvTraits<128> {
  using Cfg = DkvCfg<128, 4, 32, false>;
};

template <class C, bool DROPOUT, bool DOC>
__global__ void __launch_bounds__(C::NT)
    attention_dkv_kernel(bf16* __restrict__ dqkv, const bf16* __restrict__ dout, const float* __restrict__ lse,
                         const float* __restrict__ dsum, const bf16* __restrict__ qkv, const Problem pb,
                         bf16* __restrict__ dkv_heads) {
  constexpr int D = C::D, BM = C::BM, BN = C::BN, NT = C::NT, P = kPad<D>;
  constexpr int KS = D / 16, NQ = BM / 8, DT = D / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem);
  bf16* sV = sK + BN * P;
  bf16* sQ = sV + BN * P;    // [2][BM][P]
  bf16* sdO = sQ + 2 * BM * P;  // [2][BM][P]
  float* sL = reinterpret_cast<float*>(sdO + 2 * BM * P);  // [2][BM] lse
  float* sD = sL + 2 * BM;                                  // [2][BM] D_i
  [[maybe_unused]] std::int32_t* sS = reinterpret_cast<std::int32_t*>(sD + 2 * BM);  // DOC: [2][BM] starts

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int T = pb.T, H = pb.H;
  const int bh = blockIdx.x, b = bh / H, h = bh - b * H;
  const int k0 = blockIdx.y * BN;  // block 0 (the most queries) starts first
  const int kw0 = k0 + warp * 16;  // first key of this warp
  const std::int64_t ld = qkv_ld(pb, D), ldo = static_cast<std::int64_t>(H) * D;
  const bf16* base = qkv + static_cast<std::int64_t>(b) * T * ld;
  const bf16* gQ = base + q_at(pb, h, D);
  const bf16* gK = base + k_at(pb, h, D);
  const bf16* gV = base + v_at(pb, h, D);
  const bf16* gdO = dout + static_cast<std::int64_t>(b) * T * ldo + h * D;
  const float* gL = lse + static_cast<std::int64_t>(bh) * T;
  const float* gD = dsum + static_cast<std::int64_t>(bh) * T;
  const int qt0 = k0 / BM;                    // first query tile that reaches these keys
  const int n_tiles = (T + BM - 1) / BM - qt0;

  auto load_q_tile = [&](int stage, int qq0) {
    load_tile<D, BM, NT>(sQ + stage * BM * P, gQ, ld, qq0, T, tid);
    load_tile<D, BM, NT>(sdO + stage * BM * P, gdO, ldo, qq0, T, tid);
    for (int c = tid; c < 2 * BM; c += NT) {  // lse then D, zero past T
      const int i = c < BM ? c : c - BM;
      const bool ok = qq0 + i < T;
      const float* src = c < BM ? gL : gD;
      cp_async4(smem_addr((c < BM ? sL : sD) + stage * BM + i), ok ? src + qq0 + i : src, ok);
    }
    if constexpr (DOC) {  // the queries' document starts, 0 past T (those queries are masked anyway)
      const std::int32_t* gS = pb.doc_start + static_cast<std::int64_t>(b) * T;
      for (int i = tid; i < BM; i += NT) {
        const bool ok = qq0 + i < T;
        cp_async4(smem_addr(sS + stage * BM + i), ok ? gS + qq0 + i : gS, ok);
      }
    }
  };
  load_tile<D, BN, NT>(sK, gK, ld, k0, T, tid);
  load_tile<D, BN, NT>(sV, gV, ld, k0, T, tid);
  load_q_tile(0, qt0 * BM);
  cp_async_commit();

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.0f;
  std::uint32_t kf[C::KV_REGS ? KS : 1][4], vf[C::KV_REGS ? KS : 1][4];
  const std::uint32_t k_a = smem_addr(sK + warp * 16 * P) + frag_a_offset<D>(lane) * 2;
  const std::uint32_t v_a = smem_addr(sV + warp * 16 * P) + frag_a_offset<D>(lane) * 2;
  const std::uint32_t q_b = smem_addr(sQ) + frag_b_offset<D>(lane) * 2;
  const std::uint32_t o_b = smem_addr(sdO) + frag_b_offset<D>(lane) * 2;
  const std::uint32_t q_bt = smem_addr(sQ) + frag_bt_offset<D>(lane) * 2;
  const std::uint32_t o_bt = smem_addr(sdO) + frag_bt_offset<D>(lane) * 2;

  std::uint64_t seed = 0, start = 0, col_base = 0;
  const bool aligned = (T & 3) == 0;
  if constexpr (DROPOUT) {
    seed = pb.rng.seed;
    start = pb.rng.start();
    col_base = (static_cast<std::uint64_t>(pb.seq_offset + b) * pb.heads_total + pb.head_offset + h) * T;  // n / T of query 0
  }

  // One query tile: S^T = K Q^T, P^T, dP^T = V dO^T, dS^T; dV += P^T dO, dK += dS^T Q.
  auto tile = [&](auto masked, int stage, int qq0) {
    constexpr bool MASK = decltype(masked)::value;
    float st[NQ][4], dpt[NQ][4];
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
    const int so = stage * BM * P * 2;  // byte offset of the stage
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      std::uint32_t ka[4], va[4];
      if constexpr (C::KV_REGS) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          ka[r] = kf[ks][r];
          va[r] = vf[ks][r];
        }
      } else {
        ldsm_x4(ka, k_a + ks * 32);
        ldsm_x4(va, v_a + ks * 32);
      }
#pragma unroll
      for (int np = 0; np < BM / 16; ++np) {
        std::uint32_t f[4];
        ldsm_x4(f, q_b + so + (np * 16 * P + ks * 16) * 2);
        mma(st[2 * np], ka, f[0], f[1]);
        mma(st[2 * np + 1], ka, f[2], f[3]);
        ldsm_x4(f, o_b + so + (np * 16 * P + ks * 16) * 2);
        mma(dpt[2 * np], va, f[0], f[1]);
        mma(dpt[2 * np + 1], va, f[2], f[3]);
      }
    }
    const float* lse_s = sL + stage * BM;
    const float* d_s = sD + stage * BM;
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt) {
      const float2 lq = *reinterpret_cast<const float2*>(lse_s + nt * 8 + 2 * t);
      const float2 dq = *reinterpret_cast<const float2*>(d_s + nt * 8 + 2 * t);
      [[maybe_unused]] std::uint32_t m0 = 0xffffffffu, m1 = 0xffffffffu;  // used with DROPOUT
      if constexpr (DROPOUT) {
        const std::uint64_t q = col_base + qq0 + nt * 8;
        keep_bits_col16(seed, start, (q + (lane >> 2)) * T + kw0, (q + (lane & 7)) * T + kw0, pb.threshold, lane,
                        aligned, m0, m1);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = kw0 + g + ((e >> 1) << 3);
        const int query = qq0 + nt * 8 + 2 * t + (e & 1);
        const float lse2 = (e & 1 ? lq.y : lq.x) * kLog2e;
        const float di = e & 1 ? dq.y : dq.x;
        float p = ex2(fmaf(st[nt][e], pb.scale_log2, -lse2));
        if (MASK && (query < key || query >= T)) p = 0.0f;
        if (DOC && key < sS[stage * BM + nt * 8 + 2 * t + (e & 1)]) p = 0.0f;  // another document's key
        float dp = dpt[nt][e];
        bool keep = true;
        if constexpr (DROPOUT) {
          keep = (((e & 1) ? m1 : m0) >> (g + ((e >> 1) << 3))) & 1u;
          dp = keep ? dp * pb.keep_scale : 0.0f;
        }
        dpt[nt][e] = p * (dp - di);   // dS^T (without the softmax scale, applied at the end)
        st[nt][e] = keep ? p : 0.0f;  // P^T with the dropout mask (1 / (1 - p) applied at the end)
      }
    }
#pragma unroll
    for (int ks = 0; ks < BM / 16; ++ks) {
      const std::uint32_t pa[4] = {pack_bf16(st[2 * ks][0], st[2 * ks][1]), pack_bf16(st[2 * ks][2], st[2 * ks][3]),
                                   pack_bf16(st[2 * ks + 1][0], st[2 * ks + 1][1]),
                                   pack_bf16(st[2 * ks + 1][2], st[2 * ks + 1][3])};
      const std::uint32_t sa[4] = {pack_bf16(dpt[2 * ks][0], dpt[2 * ks][1]), pack_bf16(dpt[2 * ks][2], dpt[2 * ks][3]),
                                   pack_bf16(dpt[2 * ks + 1][0], dpt[2 * ks + 1][1]),
                                   pack_bf16(dpt[2 * ks + 1][2], dpt[2 * ks + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        std::uint32_t f[4];
        ldsm_x4_t(f, o_bt + so + (ks * 16 * P + dp * 16) * 2);
        mma(dv[2 * dp], pa, f[0], f[1]);
        mma(dv[2 * dp + 1], pa, f[2], f[3]);
        ldsm_x4_t(f, q_bt + so + (ks * 16 * P + dp * 16) * 2);
        mma(dk[2 * dp], sa, f[0], f[1]);
        mma(dk[2 * dp + 1], sa, f[2], f[3]);
      }
    }
  };

  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it & 1;
    const int qq0 = (qt0 + it) * BM;
    if (it + 1 < n_tiles) {
      load_q_tile(stage ^ 1, qq0 + BM);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if constexpr (C::KV_REGS) {
      if (it == 0) {
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          ldsm_x4(kf[ks], k_a + ks * 32);
          ldsm_x4(vf[ks], v_a + ks * 32);
        }
      }
    }
    if (qq0 + BM - 1 >= kw0) {  // else every query of the tile precedes every key of this warp
      if (DOC || qq0 < kw0 + 16 || qq0 + BM > T)
        tile(std::true_type{}, stage, qq0);
      else
        tile(std::false_type{}, stage, qq0);
    }
    __syncthreads();
  }

  // Epilogue: scale, stage in this warp's own K and V rows, 16-byte stores.
  bf16* sdK = sK + warp * 16 * P;
  bf16* sdV = sV + warp * 16 * P;
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int off = (g + 8 * hr) * P + dt * 8 + 2 * t;
      *reinterpret_cast<std::uint32_t*>(sdK + off) =
          pack_bf16(dk[dt][2 * hr] * pb.scale, dk[dt][2 * hr + 1] * pb.scale);
      *reinterpret_cast<std::uint32_t*>(sdV + off) =
          pack_bf16(dv[dt][2 * hr] * pb.keep_scale, dv[dt][2 * hr + 1] * pb.keep_scale);
    }
  __syncwarp();
  if (dkv_heads) {  // grouped queries: this query head's share, [B, T, 2, H, D], summed per group later
    const std::int64_t ld2 = 2LL * H * D;
    bf16* gdK = dkv_heads + static_cast<std::int64_t>(b) * T * ld2 + static_cast<std::int64_t>(h) * D;
    store_rows<D, 16>(gdK, ld2, kw0, T, sdK, lane);
    store_rows<D, 16>(gdK + static_cast<std::int64_t>(H) * D, ld2, kw0, T, sdV, lane);
    return;
  }
  bf16* gdK = dqkv + static_cast<std::int64_t>(b) * T * ld + k_at(pb, h, D);
  store_rows<D, 16>(gdK, ld, kw0, T, sdK, lane);
  store_rows<D, 16>(dqkv + static_cast<std::int64_t>(b) * T * ld + v_at(pb, h, D), ld, kw0, T, sdV, lane);
}

// ---------------------------------------------------------------------------------------------
// 3. dQ
// ---------------------------------------------------------------------------------------------
template <int D_, int WARPS_, int BN_>
struct DqCfg {
  static constexpr int D = D_, WARPS = WARPS_, NT = 32 * WARPS;
  static constexpr int BM = 16 * WARPS;  // query rows per block
  static constexpr int BN = BN_;         // keys per tile (a multiple of 32 for the dropout runs)
  static constexpr int kSmem = (2 * BM + 4 * BN) * kPad<D> * 2;  // Q, dO; K and V double-buffered
};
template <int D>
struct DqTraits {
  using Cfg = DqCfg<D, 4, 64>;
};
template <>
struct DqTraits<128> {
  using Cfg = DqCfg<128, 4, 32>;
};

template <class C, bool DROPOUT, bool DOC>
__global__ void __launch_bounds__(C::NT)
    attention_dq_kernel(bf16* __restrict__ dqkv, const bf16* __restrict__ dout, const float* __restrict__ lse,
                        const float* __restrict__ dsum, const bf16* __restrict__ qkv, const Problem pb) {
  constexpr int D = C::D, BM = C::BM, BN = C::BN, NT = C::NT, P = kPad<D>;
  constexpr int KS = D / 16, NTL = BN / 8, DT = D / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sdO = sQ + BM * P;
  bf16* sK = sdO + BM * P;  // [2][BN][P]
  bf16* sV = sK + 2 * BN * P;  // [2][BN][P]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int T = pb.T, H = pb.H;
  const int bh = blockIdx.x, b = bh / H, h = bh - b * H;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * BM;  // the longest (last) query blocks start first
  const int wr0 = q0 + warp * 16;
  const std::int64_t ld = qkv_ld(pb, D), ldo = static_cast<std::int64_t>(H) * D;
  const bf16* base = qkv + static_cast<std::int64_t>(b) * T * ld;
  const bf16* gQ = base + q_at(pb, h, D);
  const bf16* gK = base + k_at(pb, h, D);
  const bf16* gV = base + v_at(pb, h, D);
  const int n_tiles = (min(q0 + BM, T) + BN - 1) / BN;

  load_tile<D, BM, NT>(sQ, gQ, ld, q0, T, tid);
  load_tile<D, BM, NT>(sdO, dout + static_cast<std::int64_t>(b) * T * ldo + h * D, ldo, q0, T, tid);
  load_tile<D, BN, NT>(sK, gK, ld, 0, T, tid);
  load_tile<D, BN, NT>(sV, gV, ld, 0, T, tid);
  cp_async_commit();

  // Per-row constants of the two rows this thread holds.
  float lse2[2], di[2];
  std::uint64_t row_n[2] = {};
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = wr0 + g + 8 * hr;
    lse2[hr] = row < T ? lse[static_cast<std::int64_t>(bh) * T + row] * kLog2e : 0.0f;
    di[hr] = row < T ? dsum[static_cast<std::int64_t>(bh) * T + row] : 0.0f;
  }
  std::uint64_t seed = 0, start = 0;
  const bool aligned = (T & 3) == 0;
  if constexpr (DROPOUT) {
    seed = pb.rng.seed;
    start = pb.rng.start();
    const std::uint64_t bhg = static_cast<std::uint64_t>(pb.seq_offset + b) * pb.heads_total + pb.head_offset + h;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) row_n[hr] = (bhg * T + static_cast<std::uint64_t>(wr0 + g + 8 * hr)) * T;
  }

  // Packed documents: the document start of each row this thread holds, and the smallest of the
  // warp's rows (key tiles before it are skipped).
  [[maybe_unused]] int rs[2] = {};
  [[maybe_unused]] int warp_first = 0;
  if constexpr (DOC) {
    int lo = 0x7fffffff;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = wr0 + g + 8 * hr;
      rs[hr] = row < T ? pb.doc_start[static_cast<std::int64_t>(b) * T + row] : 0;
      if (row < T) lo = min(lo, rs[hr]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    warp_first = lo;
  }

  std::uint32_t qf[KS][4], of[KS][4];
  float dq[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[dt][e] = 0.0f;
  const std::uint32_t k_b = smem_addr(sK) + frag_b_offset<D>(lane) * 2;
  const std::uint32_t v_b = smem_addr(sV) + frag_b_offset<D>(lane) * 2;
  const std::uint32_t k_bt = smem_addr(sK) + frag_bt_offset<D>(lane) * 2;

  // One key tile: S = Q K^T, P, dP = dO V^T, dS; dQ += dS K.
  auto tile = [&](auto masked, int stage, int kv0) {
    constexpr bool MASK = decltype(masked)::value;
    float s[NTL][4], dp[NTL][4];
#pragma unroll
    for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
    const int so = stage * BN * P * 2;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        std::uint32_t f[4];
        ldsm_x4(f, k_b + so + (np * 16 * P + ks * 16) * 2);
        mma(s[2 * np], qf[ks], f[0], f[1]);
        mma(s[2 * np + 1], qf[ks], f[2], f[3]);
        ldsm_x4(f, v_b + so + (np * 16 * P + ks * 16) * 2);
        mma(dp[2 * np], of[ks], f[0], f[1]);
        mma(dp[2 * np + 1], of[ks], f[2], f[3]);
      }
    [[maybe_unused]] std::uint32_t bits[2][BN / 32];  // used with DROPOUT
    if constexpr (DROPOUT) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int c = 0; c < BN / 32; ++c)
          bits[hr][c] = keep_bits_row32(seed, start, row_n[hr] + kv0 + 32 * c, pb.threshold, t, aligned);
    }
#pragma unroll
    for (int nt = 0; nt < NTL; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hr = e >> 1;
        const int row = wr0 + g + 8 * hr;
        const int col = kv0 + nt * 8 + 2 * t + (e & 1);
        float p = ex2(fmaf(s[nt][e], pb.scale_log2, -lse2[hr]));
        if (MASK && (col > row || (DOC && col < rs[hr]))) p = 0.0f;
        float d = dp[nt][e];
        if constexpr (DROPOUT) {
          const bool keep = (bits[hr][nt / 4] >> ((nt % 4) * 8 + 2 * t + (e & 1))) & 1u;
          d = keep ? d * pb.keep_scale : 0.0f;
        }
        s[nt][e] = p * (d - di[hr]);  // dS (softmax scale applied at the end)
      }
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) {
      const std::uint32_t sa[4] = {pack_bf16(s[2 * ks][0], s[2 * ks][1]), pack_bf16(s[2 * ks][2], s[2 * ks][3]),
                                   pack_bf16(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                                   pack_bf16(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
      for (int dp2 = 0; dp2 < D / 16; ++dp2) {
        std::uint32_t f[4];
        ldsm_x4_t(f, k_bt + so + (ks * 16 * P + dp2 * 16) * 2);
        mma(dq[2 * dp2], sa, f[0], f[1]);
        mma(dq[2 * dp2 + 1], sa, f[2], f[3]);
      }
    }
  };

  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it & 1;
    if (it + 1 < n_tiles) {
      load_tile<D, BN, NT>(sK + (stage ^ 1) * BN * P, gK, ld, (it + 1) * BN, T, tid);
      load_tile<D, BN, NT>(sV + (stage ^ 1) * BN * P, gV, ld, (it + 1) * BN, T, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (it == 0) {
      const std::uint32_t qa = smem_addr(sQ + warp * 16 * P) + frag_a_offset<D>(lane) * 2;
      const std::uint32_t oa = smem_addr(sdO + warp * 16 * P) + frag_a_offset<D>(lane) * 2;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        ldsm_x4(qf[ks], qa + ks * 32);
        ldsm_x4(of[ks], oa + ks * 32);
      }
    }
    const int kv0 = it * BN;
    if (kv0 <= wr0 + 15) {  // else every key of the tile lies after every row of this warp
      if constexpr (DOC) {  // every tile masked; none before the warp's first document
        if (kv0 + BN - 1 >= warp_first) tile(std::true_type{}, stage, kv0);
      } else if (kv0 + BN - 1 > wr0) {
        tile(std::true_type{}, stage, kv0);
      } else {
        tile(std::false_type{}, stage, kv0);
      }
    }
    __syncthreads();
  }

  bf16* sdQ = sQ + warp * 16 * P;
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
      *reinterpret_cast<std::uint32_t*>(sdQ + (g + 8 * hr) * P + dt * 8 + 2 * t) =
          pack_bf16(dq[dt][2 * hr] * pb.scale, dq[dt][2 * hr + 1] * pb.scale);
  __syncwarp();
  store_rows<D, 16>(dqkv + static_cast<std::int64_t>(b) * T * ld + q_at(pb, h, D), ld, wr0, T, sdQ, lane);
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------
// dK and dV of each key/value head: the sum over its query heads' shares (kv_heads: [B, T, 2, H, D]),
// in f32 in head order, rounded once.
__global__ void attention_dkv_group_sum(bf16* __restrict__ dqkv, const bf16* __restrict__ kv_heads, const Problem pb,
                                        int D) {
  const int group = pb.H / pb.K;
  const std::int64_t work = static_cast<std::int64_t>(pb.B) * pb.T * 2 * pb.K * D;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < work;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int d = static_cast<int>(i % D);
    const int kv = static_cast<int>((i / D) % pb.K);
    const int which = static_cast<int>((i / (static_cast<std::int64_t>(D) * pb.K)) % 2);  // 0: K, 1: V
    const std::int64_t bt = i / (2LL * pb.K * D);
    const bf16* src = kv_heads + bt * 2 * pb.H * D + (static_cast<std::int64_t>(which) * pb.H + kv * group) * D + d;
    float sum = 0;
    for (int j = 0; j < group; ++j) sum += __bfloat162float(src[static_cast<std::int64_t>(j) * D]);
    dqkv[bt * qkv_ld(pb, D) + static_cast<std::int64_t>(pb.H + which * pb.K + kv) * D + d] = __float2bfloat16_rn(sum);
  }
}

template <int D, bool DROPOUT, bool DOC>
void launch_backward(bf16* dqkv, float* dsum, const bf16* dout, const bf16* out, const float* lse, const bf16* qkv,
                     const Problem& pb, cudaStream_t s, bf16* kv_heads) {
  const std::int64_t rows = static_cast<std::int64_t>(pb.B) * pb.T * pb.H;
  const std::int64_t threads = rows * (D / 8);
  attention_dsum_kernel<D><<<static_cast<unsigned>((threads + 255) / 256), 256, 0, s>>>(dsum, dout, out, pb.T,
                                                                                        pb.H, rows);
  KILN_CUDA_LAUNCH_CHECK();

  using KV = typename DkvTraits<D>::Cfg;
  auto dkv = attention_dkv_kernel<KV, DROPOUT, DOC>;
  constexpr int kv_smem = KV::kSmem + (DOC ? KV::kDocSmem : 0);
  KILN_CUDA_CHECK(cudaFuncSetAttribute(dkv, cudaFuncAttributeMaxDynamicSharedMemorySize, kv_smem));
  const dim3 grid_kv(static_cast<unsigned>(pb.B * pb.H), static_cast<unsigned>((pb.T + KV::BN - 1) / KV::BN));
  dkv<<<grid_kv, KV::NT, kv_smem, s>>>(dqkv, dout, lse, dsum, qkv, pb, kv_heads);
  KILN_CUDA_LAUNCH_CHECK();
  if (kv_heads) {
    const std::int64_t work = static_cast<std::int64_t>(pb.B) * pb.T * 2 * pb.K * D;
    attention_dkv_group_sum<<<static_cast<unsigned>(std::min<std::int64_t>((work + 255) / 256, 65535)), 256, 0, s>>>(
        dqkv, kv_heads, pb, D);
    KILN_CUDA_LAUNCH_CHECK();
  }

  using Q = typename DqTraits<D>::Cfg;
  auto dq = attention_dq_kernel<Q, DROPOUT, DOC>;
  KILN_CUDA_CHECK(cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, Q::kSmem));
  const dim3 grid_q(static_cast<unsigned>(pb.B * pb.H), static_cast<unsigned>((pb.T + Q::BM - 1) / Q::BM));
  dq<<<grid_q, Q::NT, Q::kSmem, s>>>(dqkv, dout, lse, dsum, qkv, pb);
  KILN_CUDA_LAUNCH_CHECK();
}

template <int D>
void dispatch_backward(bf16* dqkv, float* dsum, const bf16* dout, const bf16* out, const float* lse, const bf16* qkv,
                       const Problem& pb, bool dropout, cudaStream_t s, bf16* kv_heads) {
  const bool doc = pb.doc_start != nullptr;
  if (dropout && doc)
    launch_backward<D, true, true>(dqkv, dsum, dout, out, lse, qkv, pb, s, kv_heads);
  else if (dropout)
    launch_backward<D, true, false>(dqkv, dsum, dout, out, lse, qkv, pb, s, kv_heads);
  else if (doc)
    launch_backward<D, false, true>(dqkv, dsum, dout, out, lse, qkv, pb, s, kv_heads);
  else
    launch_backward<D, false, false>(dqkv, dsum, dout, out, lse, qkv, pb, s, kv_heads);
}

}  // namespace
}  // namespace attn

namespace {
// The D_i rows, rounded up to 16 bytes; then, with grouped queries, each query head's dK and dV.
std::int64_t dsum_floats(int B, int T, int H) { return (static_cast<std::int64_t>(B) * T * H + 3) / 4 * 4; }
}  // namespace

std::int64_t attention_backward_scratch(int B, int T, int H, int D, int kv_heads) {
  const bool grouped = kv_heads != 0 && kv_heads != H;
  return dsum_floats(B, T, H) + (grouped ? static_cast<std::int64_t>(B) * T * H * D : 0);  // 2 bf16 per float
}

void attention_backward(bf16* dqkv, float* scratch, const bf16* dout, const bf16* out, const float* lse,
                        const bf16* qkv, int B, int T, int H, int D, float scale, float dropout, rng::PhiloxArgs rng,
                        int head_offset, int heads_total, std::int64_t seq_offset, cudaStream_t s, int kv_heads,
                        const std::int32_t* doc_start) {
  attn::Problem pb = attn::make_problem(B, T, H, D, scale, dropout, rng, head_offset, heads_total, seq_offset,
                                        "attention_backward", kv_heads);
  pb.doc_start = doc_start;
  bf16* kv_share = pb.K != pb.H ? reinterpret_cast<bf16*>(scratch + dsum_floats(B, T, H)) : nullptr;
  if (static_cast<std::int64_t>(B) * T * H == 0) return;
  KILN_CHECK(attn::aligned16(dqkv) && attn::aligned16(dout) && attn::aligned16(out) && attn::aligned16(qkv),
             "attention_backward: dqkv, dout, out and qkv must be 16-byte aligned");
  KILN_CHECK(static_cast<std::int64_t>(B) * H <= 0x7fffffff, "attention_backward: B * H = ",
             static_cast<std::int64_t>(B) * H, " is too large");
  const bool drop = dropout > 0;
  switch (D) {
    case 16: attn::dispatch_backward<16>(dqkv, scratch, dout, out, lse, qkv, pb, drop, s, kv_share); break;
    case 32: attn::dispatch_backward<32>(dqkv, scratch, dout, out, lse, qkv, pb, drop, s, kv_share); break;
    case 64: attn::dispatch_backward<64>(dqkv, scratch, dout, out, lse, qkv, pb, drop, s, kv_share); break;
    default: attn::dispatch_backward<128>(dqkv, scratch, dout, out, lse, qkv, pb, drop, s, kv_share); break;
  }
}

}  // namespace kiln::cuda
