// Block quantisation (kiln/fp8/block.hpp) on the device, bit for bit as quantize_blocks_reference:
// one CTA of 256 threads per 128 x 128 tile of x, staged once in shared memory (bf16 or f32), then
//  - 1x128: each row of the tile is a block of the rowwise codes and each column one of the
//    transpose's (colwise) codes: row and column amaxes over the staged tile;
//  - 128x128: the tile is one block of both: one amax;
// two threads per row (and per column), 64 values each: their amax, one shuffle, the codes as four
// 16-byte stores (a row of the codes, or of the transpose's). A bf16 tile for 1x128 codes is staged
// swizzled and read once into registers: rows as two threads' 16-column pieces taken in turn (their
// stores 32 contiguous bytes), columns four at a time over 16 rows a thread (8-byte reads on every
// bank, a column's eight threads storing 128 contiguous bytes). The staged values are x's or what a
// prologue computes from its tensors as it loads them (loads.cuh: the values the unfused op would
// store); with dbias the same two threads per column also sum it, one partial sum per 128-row tile.
// A grouped quantisation (a mixture of experts' rows, one group per expert) is one launch: each row
// tile belongs to one group, found in the plan the kernel takes in its parameters. A bf16 x's 1x128
// codes (no prologue) come from a persistent kernel instead, its tiles copied by cp.async into two
// buffers, the next tile's copies in flight while a tile's codes are made.
#include <cuda_bf16.h>

#include <algorithm>
#include <span>
#include <type_traits>
#include <vector>

#include "kiln/fp8/block.hpp"
#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/ops/cuda/moments.cuh"
#include "kiln/ops/moments.hpp"
#include "kiln/tensor/alignment.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "adamw.cuh"
#include "block_sources.cuh"
#include "block_tile.cuh"
#include "loads.cuh"
#include "tiles.cuh"

namespace kiln::fp8::cuda {

namespace {

template <class S, Format F, bool Swz>
__global__ void __launch_bounds__(kCtaThreads) quantize_blocks_kernel(S src, Args a, bool vec_in) {
  quantize_tile<S, F, Swz>(src, a, static_cast<std::int64_t>(blockIdx.y) * kBlock,
                      static_cast<std::int64_t>(blockIdx.x) * kBlock, vec_in);
}

// 1x128 codes of a bf16 x, persistent: CTA b takes tiles b, b + gridDim.x, ... (row-major over [row
// tiles, column tiles]) with two tile buffers, the next tile's copies (cp.async) in flight while this
// one's codes are made; the same codes and scales as quantize_blocks_kernel<PlainSource<bf16>, F, true>.
// (A load of loads.cuh applied in place to a copied tile ran slower than staging its values: 1,752
// against 2,114 GB/s for GELU on load, docs/PERF.md.)
template <Format F>
__global__ void __launch_bounds__(kCtaThreads, 3) quantize_blocks_copied_kernel(PlainSource<bf16> src, Args a,
                                                                                 int tiles_c, int tiles) {
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* const buf0 = reinterpret_cast<bf16*>(smem);
  bf16* const buf1 = buf0 + kBlock * kRowOf<bf16>;
  const auto r_of = [tiles_c](int t) { return static_cast<std::int64_t>(t / tiles_c) * kBlock; };
  const auto c_of = [tiles_c](int t) { return static_cast<std::int64_t>(t % tiles_c) * kBlock; };
  int t = static_cast<int>(blockIdx.x);
  if (t < tiles) copy_tile(buf0, src.x, a, r_of(t), c_of(t));
  cp_async_commit();
  for (int i = 0; t < tiles; t += static_cast<int>(gridDim.x), ++i) {
    bf16* const tile = i % 2 == 0 ? buf0 : buf1;
    const int next = t + static_cast<int>(gridDim.x);
    if (next < tiles) copy_tile(i % 2 == 0 ? buf1 : buf0, src.x, a, r_of(next), c_of(next));
    cp_async_commit();
    cp_async_wait_one();  // this thread's copies of tile t are in
    __syncthreads();      // and every thread's
    process_tile<bf16, F, true>(tile, a, r_of(t), c_of(t));
    __syncthreads();  // the tile read before the copies of iteration i + 1 go into it
  }
}

// Rowwise 1x128 codes alone (no transpose, no column sums), C a multiple of 128 and every row of x
// coded: no tile to stage. Eight threads take a block (16 values each, loaded as the tile kernel
// stages them: the same values), its amax by three shuffles, and store its 128 codes as eight 16-byte
// words, contiguous; a CTA takes 32 blocks.
constexpr int kRowThreads = 8;
template <class S, Format F>
__global__ void __launch_bounds__(kCtaThreads) quantize_rows_kernel(S src, Args a) {
  constexpr int V = S::kVec, kPer = kBlock / kRowThreads;
  static_assert(kPer % V == 0, "a thread's values are whole loads");
  const std::int64_t blocks_c = a.C / kBlock;
  const std::int64_t g = (static_cast<std::int64_t>(blockIdx.x) * kCtaThreads + threadIdx.x) / kRowThreads;
  const bool valid = g < a.R * blocks_c;  // the warp's lanes all reach the shuffles
  const std::int64_t r = valid ? g / blocks_c : 0, c0 = valid ? g % blocks_c * kBlock : 0,
                     c = c0 + threadIdx.x % kRowThreads * kPer;
  float v[kPer];
  std::uint32_t m = 0;
  if (valid) {
#pragma unroll
    for (int k = 0; k < kPer; k += V) {
      float t[V];
      src.load(t, a.base + r, c + k);
#pragma unroll
      for (int i = 0; i < V; ++i) v[k + i] = t[i];
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) m = max(m, abs_bits(v[i]));
  }
#pragma unroll
  for (int o = 1; o < kRowThreads; o <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (!valid) return;
  const float s = block_scale(max_value(a.f), bits_float(m), a.pow2);
  if (threadIdx.x % kRowThreads == 0) a.row_scale_inv[BlockLayout{a.mode, a.Rr, a.C}.index(r, c0)] = reciprocal(s);
  std::uint32_t w[4];
  encode16<F>(v, s, w);
  *reinterpret_cast<uint4*>(a.rowwise + r * a.C + c) = make_uint4(w[0], w[1], w[2], w[3]);
}

// A grouped quantisation's groups (up to kPlanGroups a launch), in the kernel's parameters: group g's
// row tiles are blockIdx.y in [tile[g], tile[g + 1]), its Args are the launch's with part[g]'s Rows.
constexpr int kPlanGroups = 64;
struct GroupPlan {
  int n = 0;
  int tile[kPlanGroups + 1] = {};
  Rows part[kPlanGroups] = {};
};

// The group of row tile t (blockIdx.y of a grouped launch): its rows, copies and scales into a; the
// first row of the tile within the group.
__device__ __forceinline__ std::int64_t select_group(Args& a, const GroupPlan& plan, int t) {
  int g = 0;
  while (g + 1 < plan.n && plan.tile[g + 1] <= t) ++g;
  static_cast<Rows&>(a) = plan.part[g];
  return static_cast<std::int64_t>(t - plan.tile[g]) * kBlock;
}

template <class S, Format F, bool Swz>
__global__ void __launch_bounds__(kCtaThreads) quantize_blocks_grouped_kernel(S src, Args a,
                                                                           const __grid_constant__ GroupPlan plan,
                                                                           bool vec_in) {
  const std::int64_t r0 = select_group(a, plan, static_cast<int>(blockIdx.y));
  quantize_tile<S, F, Swz>(src, a, r0, static_cast<std::int64_t>(blockIdx.x) * kBlock, vec_in);
}

// Rows [base, base + R) of x [.., C] into copies of Rr rows and Rc columns: 16-byte stores where the
// rows of the codes are multiples of 16 bytes and they are aligned.
Rows rows_of(std::int64_t base, std::int64_t R, std::int64_t Rr, std::int64_t Rc, std::uint8_t* rowwise,
             float* row_scale_inv, std::uint8_t* colwise, float* col_scale_inv, std::int64_t C) {
  return {base, R, Rr, Rc, rowwise, row_scale_inv, colwise, col_scale_inv,
          C % 16 == 0 && aligned16(rowwise), Rc % 16 == 0 && aligned16(colwise)};
}

Args args_of(const BlockCast& k, const Rows& r, float* partial) {
  Args a;
  static_cast<Rows&>(a) = r;
  a.C = k.cols;
  a.mode = k.mode;
  a.f = k.format;
  a.pow2 = k.pow2;
  a.partial = partial;
  return a;
}

std::int64_t row_tiles(const Rows& r) { return blocks_of(std::max(r.R, std::max(r.Rr, r.Rc))); }

// More than the default 48 KB of dynamic shared memory (set at each launch: a host-side call).
template <class K>
std::size_t allow_smem(K kernel, std::size_t bytes) {
  KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  return bytes;
}

// The tile kernel over x, or over the groups' tiles.
template <class S, Format F, bool Swz>
void launch_tiles(const S& src, const Args& a, std::span<const Rows> groups, bool vec_in, cudaStream_t s) {
  const std::int64_t tiles_c = blocks_of(a.C);
  constexpr std::size_t kSmem = kSmemOf<typename S::Tile>;
  if (groups.empty()) {
    const std::int64_t tiles_r = row_tiles(a);
    KILN_CHECK(tiles_c <= 0x7fffffff && tiles_r <= 65535, "fp8 quantize_blocks: [", a.R, ", ", a.C,
               "] is too large for one launch");
    quantize_blocks_kernel<S, F, Swz><<<dim3(static_cast<unsigned>(tiles_c), static_cast<unsigned>(tiles_r)),
                                        kCtaThreads, allow_smem(quantize_blocks_kernel<S, F, Swz>, kSmem), s>>>(src, a,
                                                                                                              vec_in);
    KILN_CUDA_LAUNCH_CHECK();
    return;
  }
  for (std::size_t at = 0; at < groups.size(); at += kPlanGroups) {
    GroupPlan plan;
    for (std::size_t i = at; i < groups.size() && plan.n < kPlanGroups; ++i) {
      const Rows& p = groups[i];
      const std::int64_t tiles = row_tiles(p);
      KILN_CHECK(plan.tile[plan.n] + tiles <= 65535 && tiles_c <= 0x7fffffff,
                 "fp8 quantize_blocks_grouped: too many tiles for one launch");
      plan.part[plan.n] = p;
      plan.tile[plan.n + 1] = plan.tile[plan.n] + static_cast<int>(tiles);
      ++plan.n;
    }
    if (plan.tile[plan.n] == 0) continue;
    quantize_blocks_grouped_kernel<S, F, Swz>
        <<<dim3(static_cast<unsigned>(tiles_c), static_cast<unsigned>(plan.tile[plan.n])), kCtaThreads,
           allow_smem(quantize_blocks_grouped_kernel<S, F, Swz>, kSmem), s>>>(src, a, plan, vec_in);
    KILN_CUDA_LAUNCH_CHECK();
  }
}

// quantize_blocks_copied_kernel over x: as many CTAs as run at once (two tile buffers each), at most
// one a tile.
template <Format F>
void launch_copied(const PlainSource<bf16>& src, const Args& a, cudaStream_t s) {
  const std::int64_t tiles_c = blocks_of(a.C), tiles = row_tiles(a) * tiles_c;
  // The kernel counts tiles in int, a tile and the grid added: far from int's limit.
  KILN_CHECK(tiles <= (std::int64_t{1} << 30), "fp8 quantize_blocks: [", a.R, ", ", a.C,
             "] is too large for one launch");
  const auto kernel = quantize_blocks_copied_kernel<F>;
  const std::size_t smem = allow_smem(kernel, 2 * kSmemOf<bf16>);
  int device = 0, sms = 0, per_sm = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kCtaThreads, smem));
  const std::int64_t ctas = std::max<std::int64_t>(1, std::min<std::int64_t>(tiles, std::int64_t{sms} * per_sm));
  kernel<<<static_cast<unsigned>(ctas), kCtaThreads, smem, s>>>(src, a, static_cast<int>(tiles_c),
                                                                static_cast<int>(tiles));
  KILN_CUDA_LAUNCH_CHECK();
}

// One launch over x (no groups), or over the groups' tiles: rowwise codes alone without a tile where
// they can, else the tile kernel (its swizzled instances for a bf16 tile's 1x128 codes).
template <class S, Format F>
void launch(const S& src, const Args& a, std::span<const Rows> groups, bool vec_in, cudaStream_t s) {
  if (groups.empty() && a.mode == ScalingMode::block_1x128 && a.rowwise && !a.colwise && !a.partial && vec_in &&
      a.vec_row && a.C % kBlock == 0 && a.Rr == a.R) {
    const std::int64_t ctas = (a.R * (a.C / kBlock) * kRowThreads + kCtaThreads - 1) / kCtaThreads;
    KILN_CHECK(ctas <= 0x7fffffff, "fp8 quantize_blocks: [", a.R, ", ", a.C, "] is too large for one launch");
    quantize_rows_kernel<S, F><<<static_cast<unsigned>(ctas), kCtaThreads, 0, s>>>(src, a);
    KILN_CUDA_LAUNCH_CHECK();
    return;
  }
  if constexpr (std::is_same_v<S, PlainSource<bf16>>) {
    if (groups.empty() && a.mode == ScalingMode::block_1x128 && vec_in) return launch_copied<F>(src, a, s);
  }
  if constexpr (sizeof(typename S::Tile) == 2) {
    if (a.mode == ScalingMode::block_1x128) return launch_tiles<S, F, true>(src, a, groups, vec_in, s);
  }
  launch_tiles<S, F, false>(src, a, groups, vec_in, s);
}

template <class S>
void with_format(const S& src, const Args& a, std::span<const Rows> groups, bool vec_in, cudaStream_t s) {
  if (a.f == Format::e4m3)
    launch<S, Format::e4m3>(src, a, groups, vec_in, s);
  else
    launch<S, Format::e5m2>(src, a, groups, vec_in, s);
}

}  // namespace

namespace {

void check_cast(const BlockCast& k, const char* what) {
  KILN_CHECK(k.mode == ScalingMode::block_1x128 || k.mode == ScalingMode::block_128x128, what,
             ": a block scaling mode is needed");
  KILN_CHECK(k.source == ops::Prologue::plain || k.x_dtype == DType::bf16, what, ": a prologue's tensors are bf16");
}

// The groups' parts, checked: padded copies at least the group's rows, every group the same copies.
std::vector<Rows> parts_of(const BlockCast& k, std::span<const BlockCastGroup> groups, bool padded,
                                const char* what) {
  std::vector<Rows> parts;
  int copies = -1;
  for (const BlockCastGroup& g : groups) {
    if (g.rows <= 0) continue;
    const std::int64_t Rr = g.row_rows ? g.row_rows : g.rows, Rc = g.col_cols ? g.col_cols : g.rows;
    KILN_CHECK(g.first >= 0 && g.first + g.rows <= k.rows, what, ": group rows ", g.first, "..", g.first + g.rows,
               " of ", k.rows);
    KILN_CHECK(Rr >= g.rows && Rc >= g.rows && (padded || (Rr == g.rows && Rc == g.rows)), what, ": copies of ", Rr,
               " rows and ", Rc, " columns for a group of ", g.rows, " rows");
    KILN_CHECK(!g.rowwise == !g.row_scale_inv && !g.colwise == !g.col_scale_inv && (g.rowwise || g.colwise), what,
               ": each group's copies with their scales");
    const int c = (g.rowwise ? 1 : 0) | (g.colwise ? 2 : 0);
    KILN_CHECK(copies < 0 || copies == c, what, ": every group with the same copies");
    copies = c;
    parts.push_back(rows_of(g.first, g.rows, Rr, Rc, g.rowwise, g.row_scale_inv, g.colwise, g.col_scale_inv, k.cols));
  }
  return parts;
}

// The launch of k's source (its values on load) over x, or over the groups' parts.
void dispatch(const BlockCast& k, const Args& a, std::span<const Rows> parts, cudaStream_t s) {
  const long long C = k.cols;
  const bool cols16 = C % 16 == 0 && aligned16(k.x);
  const auto* x = static_cast<const bf16*>(k.x);
  const auto* aux = static_cast<const bf16*>(k.aux);
  switch (k.source) {
    case ops::Prologue::plain:
      if (k.x_dtype == DType::bf16)
        with_format(PlainSource<bf16>{x, C}, a, parts, C % PlainSource<bf16>::kVec == 0 && aligned16(k.x), s);
      else
        with_format(PlainSource<float>{static_cast<const float*>(k.x), C}, a, parts,
                    C % PlainSource<float>::kVec == 0 && aligned16(k.x), s);
      break;
    case ops::Prologue::layernorm:
      with_format(OnX<LayerNormLoad>{x, C, {k.mean, k.rstd, static_cast<const bf16*>(k.ln_weight),
                                            static_cast<const bf16*>(k.ln_bias)}},
                  a, parts, cols16 && aligned16(k.ln_weight) && aligned16(k.ln_bias), s);
      break;
    case ops::Prologue::gelu: with_format(OnX<GeluLoad>{x, C, {}}, a, parts, cols16, s); break;
    case ops::Prologue::swiglu: with_format(Own<SwigluLoad>{{x, C}}, a, parts, cols16, s); break;
    case ops::Prologue::dgelu: with_format(Own<DgeluLoad>{{x, aux, C}}, a, parts, cols16 && aligned16(aux), s); break;
    case ops::Prologue::dswiglu:
      with_format(DswigluSource{{x, aux, C / 2}}, a, parts, C % 32 == 0 && aligned16(k.x) && aligned16(aux), s);
      break;
  }
}

void adamw_dispatch(const BlockCast& k, const AdamWQuantizeDev& u, const Args& a, std::span<const Rows> parts,
                    cudaStream_t s) {
  // Typed by the moments' storage and the gradient's (each f32 or bf16 bits).
  ops::with_moments(u.bf16_moments, u.m, u.v, [&]<class M>(M* m, M* v) {
    ops::with_grads(u.bf16_grad, u.grad, [&]<class G>(const G* g) {
      const AdamWSource<M, G> src{u.param, g, m, v, k.cols,
                                  hyper_of(u.lr, u.beta1, u.beta2, u.eps, u.weight_decay, u.grad_scale, u.step,
                                           u.scalars)};
      const bool vec = k.cols % AdamWSource<M, G>::kVec == 0 && aligned16(u.param) && aligned16(g) && aligned16(m) &&
                       aligned16(v);
      with_format(src, a, parts, vec, s);
    });
  });
}

}  // namespace

void quantize_blocks_adamw(const BlockCast& k, const AdamWQuantizeDev& u, cudaStream_t s) {
  check_cast(k, "fp8 quantize_blocks_adamw");
  KILN_CHECK(!k.rowwise == !k.row_scale_inv && !k.colwise == !k.col_scale_inv && (k.rowwise || k.colwise),
             "fp8 quantize_blocks_adamw: a copy with its scales");
  KILN_CHECK(u.param && u.grad && u.m && u.v && u.batch == 1 && u.rows == k.rows && u.cols == k.cols,
             "fp8 quantize_blocks_adamw: an f32 master [", u.rows, ",", u.cols, "] for codes [", k.rows, ",", k.cols, "]");
  if (k.rows <= 0 || k.cols <= 0) return;
  KILN_CHECK((k.row_rows == 0 || k.row_rows == k.rows) && (k.col_cols == 0 || k.col_cols == k.rows),
             "fp8 quantize_blocks_adamw: no padded copies");
  const Args a =
      args_of(k, rows_of(0, k.rows, k.rows, k.rows, k.rowwise, k.row_scale_inv, k.colwise, k.col_scale_inv, k.cols), nullptr);
  adamw_dispatch(k, u, a, {}, s);
}

void quantize_blocks_adamw_grouped(const BlockCast& k, const AdamWQuantizeDev& u,
                                   std::span<const BlockCastGroup> groups, cudaStream_t s) {
  check_cast(k, "fp8 quantize_blocks_adamw_grouped");
  KILN_CHECK(u.param && u.grad && u.m && u.v && u.batch == 1 && u.rows == k.rows && u.cols == k.cols,
             "fp8 quantize_blocks_adamw_grouped: an f32 master [", u.rows, ",", u.cols, "] for [", k.rows, ",", k.cols,
             "]");
  if (k.rows <= 0 || k.cols <= 0) return;
  const std::vector<Rows> parts = parts_of(k, groups, false, "fp8 quantize_blocks_adamw_grouped");
  std::int64_t next = 0;
  for (const Rows& p : parts) {
    KILN_CHECK(p.base == next, "fp8 quantize_blocks_adamw_grouped: the groups must cover the weight's rows in order, "
                               "group at row ", p.base, " after ", next);
    next = p.base + p.R;
  }
  KILN_CHECK(next == k.rows, "fp8 quantize_blocks_adamw_grouped: groups of ", next, " rows for a weight of ", k.rows);
  adamw_dispatch(k, u, args_of(k, {}, nullptr), parts, s);
}

std::int64_t block_partials(std::int64_t rows, std::int64_t cols) { return blocks_of(rows) * cols; }

void quantize_blocks(const BlockCast& k, cudaStream_t s) {
  check_cast(k, "fp8 quantize_blocks");
  KILN_CHECK(!k.rowwise == !k.row_scale_inv && !k.colwise == !k.col_scale_inv,
             "fp8 quantize_blocks: codes without scales, or scales without codes");
  KILN_CHECK(!k.dbias || k.partial, "fp8 quantize_blocks: dbias without partial-sum scratch");
  const std::int64_t Rr = k.row_rows ? k.row_rows : k.rows, Rc = k.col_cols ? k.col_cols : k.rows;
  if (std::max(k.rows, std::max(Rr, Rc)) <= 0 || k.cols <= 0 || (!k.rowwise && !k.colwise && !k.dbias)) return;
  KILN_CHECK(Rr >= k.rows && Rc >= k.rows && (!k.dbias || (Rr == k.rows && Rc == k.rows)),
             "fp8 quantize_blocks: padded copies of ", Rr, " rows and ", Rc, " columns for ", k.rows, " rows",
             k.dbias ? " with dbias" : "");
  const Args a = args_of(k, rows_of(0, k.rows, Rr, Rc, k.rowwise, k.row_scale_inv, k.colwise, k.col_scale_inv, k.cols),
                         k.dbias ? k.partial : nullptr);
  dispatch(k, a, {}, s);
  if (k.dbias) bias_from_partials(k.dbias, k.partial, blocks_of(k.rows), k.cols, s);
}

void quantize_blocks_grouped(const BlockCast& k, std::span<const BlockCastGroup> groups, cudaStream_t s) {
  check_cast(k, "fp8 quantize_blocks_grouped");
  KILN_CHECK(!k.dbias, "fp8 quantize_blocks_grouped: no bias gradient");
  if (k.cols <= 0) return;
  const std::vector<Rows> parts = parts_of(k, groups, true, "fp8 quantize_blocks_grouped");
  if (parts.empty()) return;
  dispatch(k, args_of(k, {}, nullptr), parts, s);
}

}  // namespace kiln::fp8::cuda
