// kiln's own block-scaled FP8 GEMM for Hopper (kiln/fp8/cuda/block_gemm.hpp): D[M, N] = X[M, K] Y[N, K]^T
// with X scaled per 1x128 block and Y per 1x128 (a weight gradient) or 128x128 block (a forward or data
// gradient), both K-major as Hopper's FP8 tensor cores take them.
//
// The kernel is persistent (one CTA an SM, tiles of 256 x 128 taken in turn; or 192 x 128 with three
// math groups of one half each, BlockGemm::Tile, chosen a shape) and warp-specialised:
//  - a producer warp group (one thread issuing) moves each 128-deep K block of X's and Y's tiles into
//    shared memory by TMA (128-byte swizzle, the layout wgmma reads), with the block's scales (X's 256
//    row scales, and Y's 128 column scales when Y is 1x128-scaled), through a ring of kStages stages,
//    each with a "full" barrier (TMA's bytes arrived) and an "empty" one (both math groups done);
//  - two math warp groups, 128 rows each as two halves of 64: per K block and half, four wgmma
//    m64n128k32 products into a fresh f32 fragment, then that block's partial sums promoted into the
//    half's f32 accumulator with their scales:
//    acc += partial * x_scale_inv[row] * y_scale_inv[col or col block]. This is the promotion the CPU
//    emulation (block_gemm_reference) describes: each block's sum apart, scaled, added in f32.
// The epilogue writes from registers: bf16 (with an optional bias added in f32 before rounding), f32,
// or f32 accumulated onto D with vector reductions (each element written by one thread once: the
// same sum D + product as a load and a store, except that the reduction flushes a subnormal sum,
// below 1.2e-38 in magnitude, to zero: REDG.ADD.F32x2.FTZ). Rows and columns outside D are not written; TMA reads
// zeros beyond M, N and K, so partial tiles and a K that is not a multiple of 128 need nothing else.
#include "kiln/fp8/cuda/block_gemm.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kiln/fp8/block.hpp"
#include "kiln/tensor/alignment.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::fp8::cuda {

namespace {

constexpr int kBN = 128, kBK = 128;

// A tile's geometry (BlockGemm::Tile): Groups math warp groups, each owning Halves wgmma m64 row
// blocks of the tile (summed one after the other), beside one producer warp group. The stages fill
// what shared memory takes (at most 6); the registers go to the math groups (setmaxnreg).
template <int Groups, int Halves>
struct Geometry {
  static constexpr int kGroups = Groups, kHalves = Halves, kBM = 64 * Groups * Halves, kThreads = 128 * (Groups + 1);
  static constexpr int kStageBytes = (kBM + kBN) * (kBK + 4);
  static constexpr int kStages = std::min(220 * 1024 / kStageBytes, 6);
  static constexpr int kProducerRegs = Groups > 2 ? 24 : 40;
  static constexpr int kMathRegs = std::min((65536 / 128 - kProducerRegs) / Groups / 8 * 8, 232);
};

template <class G>
struct alignas(1024) BlockGemmSmem {
  std::uint8_t a[G::kStages][G::kBM * kBK];  // X's tile, kBM rows of 128 bytes, 128-byte swizzle
  std::uint8_t b[G::kStages][kBN * kBK];     // Y's tile
  float sa[G::kStages][G::kBM];              // X's scales of the tile's rows
  float sb[G::kStages][kBN];                 // Y's scales of the tile's columns (1x128 Y)
  std::uint64_t full[G::kStages], empty[G::kStages];
};
template <class G>
constexpr std::size_t kSmemBytes = sizeof(BlockGemmSmem<G>) + 1024;  // with room to align the base

using Tile256 = Geometry<2, 2>;  // 256 x 128: two groups of two halves
using Tile192 = Geometry<3, 1>;  // 192 x 128: three groups of one (a third more tensor-core chains an SM)
static_assert(kSmemBytes<Tile256> <= 227 * 1024 && kSmemBytes<Tile192> <= 227 * 1024,
              "the block GEMM's stages exceed Hopper's shared memory");

enum OutKind : int { kOutBf16 = 0, kOutF32 = 1, kOutF32Add = 2 };

struct BlockGemmParams {
  int M, N, kblocks, tiles_n, tiles;
  const float* y_block_scale;  // 128x128 Y: BlockLayout{128x128, N, K}; null when Y is 1x128 (TMA)
  int y_block_ld;
  void* d;
  const __nv_bfloat16* bias;  // bf16 D only, may be null
  int out;
  int probe;  // BlockGemm::set_probe: 1 skips the epilogue's stores, 2 the promotions
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KILN_BLOCK_GEMM_SM90 1
#endif

#ifdef KILN_BLOCK_GEMM_SM90
__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(std::uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(std::uint64_t* bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// Waits for the completion of the barrier's phase of the given parity.
__device__ __forceinline__ void mbar_wait(std::uint64_t* bar, std::uint32_t parity) {
  const std::uint32_t a = smem_addr(bar);
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int c1, std::uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<std::uint64_t>(map)) : "memory");
}
// A shared-memory matrix descriptor of a K-major tile with 128-byte rows and 128-byte swizzle: 8-row
// groups 1,024 bytes apart; the leading offset is unused for this layout.
__device__ __forceinline__ std::uint64_t smem_desc(const void* p) {
  const std::uint32_t a = smem_addr(p);
  return static_cast<std::uint64_t>((a & 0x3FFFF) >> 4) | (std::uint64_t{1} << 16) | (std::uint64_t{1024 >> 4} << 32) |
         (std::uint64_t{1} << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Keeps the compiler from moving reads or writes of the fragment across the wgmma's issue and wait.
__device__ __forceinline__ void fence_fragment(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 f32 a thread: a 64 x 128 fragment of the warp group) = (accumulate ? d : 0) + A B^T over 32 of K.
#define KILN_WGMMA_FP8(NAME, TYPES)                                                                      \
  __device__ __forceinline__ void NAME(float (&d)[64], std::uint64_t da, std::uint64_t db, int accumulate) { \
    asm volatile(                                                                                        \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                     \
        "wgmma.mma_async.sync.aligned.m64n128k32.f32." TYPES " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"         \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                                                         \
        : "l"(da), "l"(db), "r"(accumulate));                                                           \
  }
KILN_WGMMA_FP8(wgmma_e4m3_e4m3, "e4m3.e4m3")
KILN_WGMMA_FP8(wgmma_e5m2_e4m3, "e5m2.e4m3")
KILN_WGMMA_FP8(wgmma_e4m3_e5m2, "e4m3.e5m2")
#undef KILN_WGMMA_FP8

template <int XType, int YType>
__device__ __forceinline__ void wgmma_fp8(float (&d)[64], std::uint64_t da, std::uint64_t db, int accumulate) {
  if constexpr (XType == 0 && YType == 0)
    wgmma_e4m3_e4m3(d, da, db, accumulate);
  else if constexpr (XType == 1)
    wgmma_e5m2_e4m3(d, da, db, accumulate);
  else
    wgmma_e4m3_e5m2(d, da, db, accumulate);
}
#endif  // KILN_BLOCK_GEMM_SM90

// XType / YType: 0 e4m3, 1 e5m2. YRowwise: Y 1x128-scaled (else 128x128).
template <int XType, int YType, bool YRowwise, class G>
__global__ void __launch_bounds__(G::kThreads, 1)
    block_gemm_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_y,
                      const __grid_constant__ CUtensorMap map_xs, const __grid_constant__ CUtensorMap map_ys,
                      const BlockGemmParams p) {
#ifdef KILN_BLOCK_GEMM_SM90
  // The stages 1,024-byte aligned (the 128-byte swizzle's atom), addressed from the shared array so
  // that the compiler keeps them in the shared space (LDS, not generic loads, for the scales).
  extern __shared__ __align__(1024) std::uint8_t smem_raw[];
  const std::uint32_t pad = (1024 - (smem_addr(smem_raw) & 1023)) & 1023;
  auto& sm = *reinterpret_cast<BlockGemmSmem<G>*>(smem_raw + pad);
  constexpr int kBM = G::kBM, kStages = G::kStages, kMathGroups = G::kGroups, kHalves = G::kHalves;
  constexpr int kGroupRows = 64 * kHalves;
  const int group = static_cast<int>(threadIdx.x) / 128, tid = static_cast<int>(threadIdx.x) % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&sm.full[s], 1);
      mbar_init(&sm.empty[s], kMathGroups * 4);  // one arrival a math warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (group == kMathGroups) {  // the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(G::kProducerRegs));
    if (tid != 0) return;
    prefetch_map(&map_x);
    prefetch_map(&map_y);
    prefetch_map(&map_xs);
    if constexpr (YRowwise) prefetch_map(&map_ys);
    constexpr std::uint32_t bytes = (kBM + kBN) * kBK + kBM * 4 + (YRowwise ? kBN * 4 : 0);
    int it = 0;
    for (int t = static_cast<int>(blockIdx.x); t < p.tiles; t += static_cast<int>(gridDim.x)) {
      const int m0 = (t / p.tiles_n) * kBM, n0 = (t % p.tiles_n) * kBN;
      for (int kb = 0; kb < p.kblocks; ++kb, ++it) {
        const int s = it % kStages;
        mbar_wait(&sm.empty[s], ((it / kStages) & 1) ^ 1);
        mbar_expect_tx(&sm.full[s], bytes);
        tma_load_2d(sm.a[s], &map_x, kb * kBK, m0, &sm.full[s]);
        tma_load_2d(sm.b[s], &map_y, kb * kBK, n0, &sm.full[s]);
        tma_load_2d(sm.sa[s], &map_xs, m0, kb, &sm.full[s]);
        if constexpr (YRowwise) tma_load_2d(sm.sb[s], &map_ys, n0, kb, &sm.full[s]);
      }
    }
    return;
  }

  // The math groups: group g owns the tile's kGroupRows rows from g * kGroupRows as kHalves halves of
  // 64 rows, each one wgmma m64n128 fragment; its accumulators are acc[h] for half h.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(G::kMathRegs));
  const int warp = tid / 32, lane = tid % 32;
  // The tile row of acc[h][4j], acc[h][4j + 1] is r0 + 64 h; of acc[h][4j + 2], acc[h][4j + 3] r0 + 64 h + 8.
  const int r0 = group * kGroupRows + warp * 16 + lane / 4;
  const int c0 = 2 * (lane % 4);  // the tile column of acc[h][4j] is 8j + c0
  float part[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) part[i] = 0.0f;
  int it = 0;
  for (int t = static_cast<int>(blockIdx.x); t < p.tiles; t += static_cast<int>(gridDim.x)) {
    const int m0 = (t / p.tiles_n) * kBM, n0 = (t % p.tiles_n) * kBN;
    float acc[kHalves][64];
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
    const float* yscale = YRowwise ? nullptr : p.y_block_scale + static_cast<std::int64_t>(n0 / kBK) * p.y_block_ld;
    for (int kb = 0; kb < p.kblocks; ++kb, ++it) {
      const int s = it % kStages;
      float yb = 0.0f;
      if constexpr (!YRowwise) yb = __ldg(yscale + kb);
      mbar_wait(&sm.full[s], (it / kStages) & 1);
      const std::uint64_t db = smem_desc(sm.b[s]);
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const std::uint64_t da = smem_desc(sm.a[s] + (group * kGroupRows + h * 64) * kBK);
        fence_fragment(part);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < kBK / 32; ++k) wgmma_fp8<XType, YType>(part, da + 2 * k, db + 2 * k, k);
        wgmma_commit();
        const float xs0 = sm.sa[s][r0 + 64 * h], xs1 = sm.sa[s][r0 + 64 * h + 8];
        wgmma_wait_all();
        fence_fragment(part);
        if (p.probe & 2) {
        } else if constexpr (YRowwise) {
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const float2 ys = *reinterpret_cast<const float2*>(&sm.sb[s][8 * j + c0]);
            acc[h][4 * j + 0] += part[4 * j + 0] * (xs0 * ys.x);
            acc[h][4 * j + 1] += part[4 * j + 1] * (xs0 * ys.y);
            acc[h][4 * j + 2] += part[4 * j + 2] * (xs1 * ys.x);
            acc[h][4 * j + 3] += part[4 * j + 3] * (xs1 * ys.y);
          }
        } else {
          const float s0 = xs0 * yb, s1 = xs1 * yb;
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            acc[h][4 * j + 0] += part[4 * j + 0] * s0;
            acc[h][4 * j + 1] += part[4 * j + 1] * s0;
            acc[h][4 * j + 2] += part[4 * j + 2] * s1;
            acc[h][4 * j + 3] += part[4 * j + 3] * s1;
          }
        }
      }
      __syncwarp();  // every lane of the warp has read the stage: its codes (wgmma) and scales
      if (lane == 0) mbar_arrive(&sm.empty[s]);
    }
    // The epilogue, from registers.
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int col = n0 + 8 * j + c0;
        if (col >= p.N) continue;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int row = m0 + r0 + 64 * h + 8 * e;
          if (row >= p.M) continue;
          float v0 = acc[h][4 * j + 2 * e], v1 = acc[h][4 * j + 2 * e + 1];
          if ((p.probe & 1) && v0 != -12345.0f) continue;
          const std::int64_t off = static_cast<std::int64_t>(row) * p.N + col;
          if (p.out == kOutBf16) {
            if (p.bias) {
              v0 += __bfloat162float(p.bias[col]);
              v1 += __bfloat162float(p.bias[col + 1]);
            }
            *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.d) + off) = __floats2bfloat162_rn(v0, v1);
          } else if (p.out == kOutF32) {
            *reinterpret_cast<float2*>(static_cast<float*>(p.d) + off) = make_float2(v0, v1);
          } else {
            asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(static_cast<float*>(p.d) + off), "f"(v0),
                         "f"(v1)
                         : "memory");
          }
        }
      }
  }
#endif  // KILN_BLOCK_GEMM_SM90
}

int type_code(DType t) { return t == DType::e5m2 ? 1 : 0; }

}  // namespace

struct BlockGemm::Impl {
  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  int sms = 0;
  bool sm90 = false;
};

namespace {

using Kernel = void (*)(CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap, BlockGemmParams);

template <class G>
Kernel kernel_for(int xt, int yt, bool y_rowwise) {
  if (xt == 0 && yt == 0) return y_rowwise ? block_gemm_kernel<0, 0, true, G> : block_gemm_kernel<0, 0, false, G>;
  if (xt == 1 && yt == 0) return y_rowwise ? block_gemm_kernel<1, 0, true, G> : block_gemm_kernel<1, 0, false, G>;
  return y_rowwise ? block_gemm_kernel<0, 1, true, G> : block_gemm_kernel<0, 1, false, G>;
}

template <class G>
void allow_smem() {
  for (int xt = 0; xt < 2; ++xt)
    for (int yt = 0; yt < 2; ++yt)
      for (bool rowwise : {false, true})
        if (xt + yt < 2)
          KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel_for<G>(xt, yt, rowwise),
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(kSmemBytes<G>)));
}

// A 2-D tensor map of a row-major [outer, inner] tensor, boxes of [box_outer, box_inner].
CUtensorMap map_2d(PFN_cuTensorMapEncodeTiled_v12000 encode, const void* base, CUtensorMapDataType type,
                   std::uint64_t inner, std::uint64_t outer, std::uint64_t row_bytes, std::uint32_t box_inner,
                   std::uint32_t box_outer, CUtensorMapSwizzle swizzle, const char* what) {
  CUtensorMap m{};
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(&m, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  KILN_CHECK(r == CUDA_SUCCESS, "block GEMM: cuTensorMapEncodeTiled refused ", what, " [", outer, ", ", inner,
             "] (CUresult ", static_cast<int>(r), ")");
  return m;
}

// D = X Y^T for G's tiles: the tensor maps, the parameters, one CTA an SM (or a tile).
template <class G>
void launch(const GemmArgs& g, PFN_cuTensorMapEncodeTiled_v12000 encode, int sms, int probe, cudaStream_t stream) {
  const std::int64_t M = g.x.size(0), N = g.y.size(0), K = g.x.size(1);
  const bool y_rowwise = g.y_mode == ScalingMode::block_1x128;
  const BlockLayout lx{ScalingMode::block_1x128, M, K}, ly{g.y_mode, N, K};
  const auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
  const CUtensorMap mx = map_2d(encode, g.x.data, CU_TENSOR_MAP_DATA_TYPE_UINT8, u(K), u(M), u(K), kBK, G::kBM,
                                CU_TENSOR_MAP_SWIZZLE_128B, "X");
  const CUtensorMap my = map_2d(encode, g.y.data, CU_TENSOR_MAP_DATA_TYPE_UINT8, u(K), u(N), u(K), kBK, kBN,
                                CU_TENSOR_MAP_SWIZZLE_128B, "Y");
  const CUtensorMap mxs = map_2d(encode, g.x_scale_inv, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, u(lx.ld()),
                                 u(blocks_of(K)), u(lx.ld() * 4), G::kBM, 1, CU_TENSOR_MAP_SWIZZLE_NONE, "X's scales");
  const CUtensorMap mys = y_rowwise ? map_2d(encode, g.y_scale_inv, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, u(ly.ld()),
                                             u(blocks_of(K)), u(ly.ld() * 4), kBN, 1, CU_TENSOR_MAP_SWIZZLE_NONE,
                                             "Y's scales")
                                    : mxs;
  BlockGemmParams p{};
  p.M = static_cast<int>(M);
  p.N = static_cast<int>(N);
  p.kblocks = static_cast<int>(blocks_of(K));
  p.tiles_n = static_cast<int>((N + kBN - 1) / kBN);
  p.tiles = static_cast<int>((M + G::kBM - 1) / G::kBM) * p.tiles_n;
  p.y_block_scale = y_rowwise ? nullptr : g.y_scale_inv;
  p.y_block_ld = y_rowwise ? 0 : static_cast<int>(ly.ld());
  p.d = g.d.data;
  p.bias = g.bias ? static_cast<const __nv_bfloat16*>(g.bias.data) : nullptr;
  p.out = !g.f32_result ? kOutBf16 : g.accumulate ? kOutF32Add : kOutF32;
  p.probe = probe;
  const int grid = p.tiles < sms ? p.tiles : sms;
  kernel_for<G>(type_code(g.x.dtype), type_code(g.y.dtype), y_rowwise)<<<grid, G::kThreads, kSmemBytes<G>, stream>>>(
      mx, my, mxs, mys, p);
  KILN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

BlockGemm::BlockGemm() : impl_(std::make_unique<Impl>()) {
  int dev = 0, major = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&dev));
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&impl_->sms, cudaDevAttrMultiProcessorCount, dev));
  impl_->sm90 = major == 9;
  if (!impl_->sm90) return;
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  KILN_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
  KILN_CHECK(found == cudaDriverEntryPointSuccess && fn, "block GEMM: the driver has no cuTensorMapEncodeTiled");
  impl_->encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  allow_smem<Tile256>();
  allow_smem<Tile192>();
}

BlockGemm::~BlockGemm() = default;

// The tile of a product: the one whose rounds of CTAs (ceil(tiles / SMs), one tile an SM a round) times
// its rows, the rows an SM computes, is least, 192-row tiles counted 6% faster a row (the rate per
// tile docs/PERF.md measured apart from the rounds' waste). So 192 rows where 256 would leave a last
// round fuller than 192 does, or where the tiles are many (the long-N forward products).
BlockGemm::Tile BlockGemm::automatic_tile(std::int64_t M, std::int64_t N, int sms) {
  const auto rows = [&](std::int64_t bm) {
    const std::int64_t tiles = (M + bm - 1) / bm * ((N + kBN - 1) / kBN);
    return static_cast<double>((tiles + sms - 1) / sms * bm);
  };
  return rows(Tile192::kBM) / 1.06 < rows(Tile256::kBM) ? Tile::m192n128 : Tile::m256n128;
}

bool BlockGemm::available() const { return impl_->sm90; }

bool BlockGemm::takes(const GemmArgs& g) const {
  return impl_->sm90 && g.x_mode == ScalingMode::block_1x128 &&
         (g.y_mode == ScalingMode::block_1x128 || g.y_mode == ScalingMode::block_128x128) &&
         g.x.size(0) <= 0x7fffffff && g.y.size(0) <= 0x7fffffff && g.x.size(1) <= 0x7fffffff;
}

void BlockGemm::run(const GemmArgs& g, cudaStream_t stream) {
  KILN_CHECK(takes(g), "block GEMM: kiln's kernel does not take this product (a Hopper device, X 1x128-scaled, Y "
                      "1x128 or 128x128)");
  KILN_CHECK(g.epilogue == ops::Epilogue::none || (g.epilogue == ops::Epilogue::bias && !g.f32_result),
             "block GEMM: kiln's kernel adds a bias to a bf16 D and runs no other epilogue");
  const std::int64_t M = g.x.size(0), N = g.y.size(0), K = g.x.size(1);
  // What Fp8GemmRunner validates, for callers that come here directly: TMA's 16-byte strides and
  // bases, and the epilogue's column pairs.
  KILN_CHECK(g.y.size(1) == K && g.d.numel() == M * N && N % 16 == 0 && K % 16 == 0,
             "block GEMM: X [", M, ", ", K, "], Y ", g.y.str(), ", D ", g.d.str(),
             ": Y must share K, D be [M, N], N and K multiples of 16");
  KILN_CHECK(aligned16(g.x.data) && aligned16(g.y.data) && aligned16(g.d.data) && aligned16(g.x_scale_inv) &&
                 aligned16(g.y_scale_inv),
             "block GEMM: operands and scales must be 16-byte aligned");
  if (M == 0 || N == 0) return;
  if ((tile_ == Tile::automatic ? automatic_tile(M, N, impl_->sms) : tile_) == Tile::m192n128)
    launch<Tile192>(g, impl_->encode, impl_->sms, probe_, stream);
  else
    launch<Tile256>(g, impl_->encode, impl_->sms, probe_, stream);
}

}  // namespace kiln::fp8::cuda
