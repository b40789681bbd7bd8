#pragma once
// CUDA launchers of the FP8 kernels: host functions taking device pointers and an explicit stream,
// usable without the rest of kiln::fp8. Each checks its launch and throws kiln::Error on failure.
// Inputs `x` are bf16 (DType::bf16) or f32 (DType::f32), contiguous, row-major.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "kiln/fp8/format.hpp"
#include "kiln/fp8/ops.hpp"
#include "kiln/tensor/dtype.hpp"

namespace kiln::fp8::cuda {

// The fused cast + transpose + amax: reads x [rows, cols] once and writes rowwise [rows, cols]
// and/or colwise [cols, rows] (either may be null) as encode(x * *scale) in `f`; max-accumulates
// max |x| into *amax unless null. 16-byte accesses when rows and cols are multiples of 16 and the
// pointers 16-byte aligned; a plain elementwise kernel otherwise.
void cast_transpose(const void* x, DType x_dtype, std::uint8_t* rowwise, std::uint8_t* colwise, Format f,
                    const float* scale, float* amax, std::int64_t rows, std::int64_t cols, cudaStream_t s);

// Block quantisation (kiln/fp8/block.hpp) in one read of x [rows, cols] (bf16 or f32): the codes of
// x and their scales (rowwise, BlockLayout{mode, rows, cols}) and/or those of its transpose
// (colwise [cols, rows], BlockLayout{mode, cols, rows}), bit for bit as quantize_blocks_reference.
// The values may be computed as they are loaded (`source`, from bf16 tensors, each rounded to bf16
// as the op that would store it rounds it):
//   layernorm  LayerNorm(x) from mean, rstd [rows] (f32) and weight, bias [cols]
//   gelu       gelu(x)
//   swiglu     swiglu of x [rows, 2 cols] (gate columns, then up columns)
//   dgelu      x * gelu'(aux), both [rows, cols]
//   dswiglu    swiglu_backward's values [rows, cols] from x = the output's gradient [rows, cols / 2]
//              and aux = the SwiGLU's input [rows, cols]
// With dbias: dbias[c] += the column sums of the values, through `partial` (f32 scratch of
// block_partials(rows, cols) floats): each 128-row tile's sums, then the tiles in a fixed order.
struct BlockCast {
  const void* x = nullptr;
  DType x_dtype = DType::bf16;
  std::int64_t rows = 0, cols = 0;
  ScalingMode mode = ScalingMode::block_1x128;
  Format format = Format::e4m3;
  bool pow2 = false;
  std::uint8_t* rowwise = nullptr;
  float* row_scale_inv = nullptr;
  std::uint8_t* colwise = nullptr;
  float* col_scale_inv = nullptr;
  ops::Prologue source = ops::Prologue::plain;
  const void* aux = nullptr;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  const void* ln_weight = nullptr;
  const void* ln_bias = nullptr;
  float* dbias = nullptr;
  float* partial = nullptr;
  // Padded copies: the rowwise codes' rows and the colwise codes' columns, >= rows (0: rows).
  std::int64_t row_rows = 0, col_cols = 0;
};
void quantize_blocks(const BlockCast& k, cudaStream_t s);
// Groups of rows quantised on their own in one launch (GroupedBlockQuantizeArgs): group g is rows
// [first, first + rows) of k's x (k.rows of them), written as quantize_blocks of those rows alone
// writes them into the group's copies (rowwise [row_rows, cols], colwise [cols, col_cols]; 0: rows);
// k's own copies, dbias and padding unused. Every group with rows has the same copies.
struct BlockCastGroup {
  std::int64_t first = 0, rows = 0, row_rows = 0, col_cols = 0;
  std::uint8_t* rowwise = nullptr;
  float* row_scale_inv = nullptr;
  std::uint8_t* colwise = nullptr;
  float* col_scale_inv = nullptr;
};
void quantize_blocks_grouped(const BlockCast& k, std::span<const BlockCastGroup> groups, cudaStream_t s);
std::int64_t block_partials(std::int64_t rows, std::int64_t cols);
// kiln/fp8/block.hpp's BlockPart functions on device pointers, bit for bit as their references: one CTA
// per 128 x 128 tile of the weight that the part touches.
void block_part_amax(const BlockPart& p, float* tile_amax, cudaStream_t s);
void block_scales(const float* tile_amax, std::int64_t rows, std::int64_t cols, Format f, bool pow2, float* scale,
                  float* row_scale_inv, float* col_scale_inv, cudaStream_t s);
void quantize_block_part(const BlockPart& p, const float* scale, Format f, std::uint8_t* codes, cudaStream_t s);
// dbias[c] += sum over t < row_tiles of partial[t * cols + c], in a fixed order.
void bias_from_partials(float* dbias, const float* partial, std::int64_t row_tiles, std::int64_t cols, cudaStream_t s);
// The same into a bf16 gradient: dbias[c] = round(float(dbias[c]) + the same f32 total).
void bias_from_partials(__nv_bfloat16* dbias, const float* partial, std::int64_t row_tiles, std::int64_t cols,
                        cudaStream_t s);

// cast_transpose of act(gelu(pre)) (bf16 pre), the GELU computed on load; with neither copy, the
// amax alone (scale must still point to a float).
void cast_transpose_gelu(const __nv_bfloat16* pre, std::uint8_t* rowwise, std::uint8_t* colwise, Format f,
                         const float* scale, float* amax, std::int64_t rows, std::int64_t cols, cudaStream_t s);

// cast_transpose of act(silu(gate) * up) (bf16 pre [rows, 2 cols]: the gate columns, then the up
// columns), the SwiGLU computed on load, as the SwiGLU kernel writes it; with neither copy, the amax
// alone (scale must still point to a float).
void cast_transpose_swiglu(const __nv_bfloat16* pre, std::uint8_t* rowwise, std::uint8_t* colwise, Format f,
                           const float* scale, float* amax, std::int64_t rows, std::int64_t cols, cudaStream_t s);

// cast_transpose of act(LayerNorm(x)) from the forward's statistics (bf16 x, weight, bias; f32
// mean, rstd per row): y = act(ops::layernorm_apply(x, mean[r], rstd[r], weight[c], bias[c])), the
// values the LayerNorm kernel writes, computed on load.
struct LayerNormOfDev {
  const __nv_bfloat16* x = nullptr;
  const __nv_bfloat16* weight = nullptr;
  const __nv_bfloat16* bias = nullptr;
  const float* mean = nullptr;
  const float* rstd = nullptr;
};
void cast_transpose_layernorm(const LayerNormOfDev& ln, std::uint8_t* rowwise, std::uint8_t* colwise, Format f,
                              const float* scale, float* amax, std::int64_t rows, std::int64_t cols, cudaStream_t s);

// LayerNorm statistics of ln.x [rows, cols] into mean, rstd (f32 [rows]), bit-identical to the ops
// backend's layernorm_forward (with a 16-byte aligned output); with amax, max |act(LayerNorm(x))|
// max-accumulated into it.
void layernorm_stats(const LayerNormOfDev& ln, float* mean, float* rstd, float* amax, std::int64_t rows,
                     std::int64_t cols, float eps, cudaStream_t s);

// The gradient quantisation of GradQuantizeArgs in one pass over bf16 dy (see there): optional
// dGELU, both copies, amax, and column sums into dbias through `partial` (f32 scratch of
// grad_partials(rows, cols) elements). Returns false, doing nothing, for shapes or alignments the
// tiled kernel does not take (rows or cols not multiples of 16, pointers not 16-byte aligned).
struct CastTransposeGrad {
  const __nv_bfloat16* dy = nullptr;
  const __nv_bfloat16* gelu_pre = nullptr;  // optional
  std::uint8_t* rowwise = nullptr;
  std::uint8_t* colwise = nullptr;
  Format format = Format::e5m2;
  const float* scale = nullptr;
  float* amax = nullptr;     // optional
  float* dbias = nullptr;    // optional, accumulated
  __nv_bfloat16* dbias_bf16 = nullptr;  // instead of dbias: a bf16 gradient (added in f32, rounded once)
  float* partial = nullptr;  // needed with dbias
  std::int64_t rows = 0, cols = 0;
  // Optional: dy is an LM head's logits, the values quantised their cross-entropy gradient
  // (ops::XentOnLoad; no gelu_pre, no dbias): each row's logsumexp and target, the logits' first
  // column's vocabulary index, the real columns among them, dloss.
  const float* lse = nullptr;
  const std::int32_t* targets = nullptr;
  std::int64_t vocab_begin = 0;
  std::int64_t real_cols = 0;
  float dloss = 1;
};
bool cast_transpose_grad(const CastTransposeGrad& a, cudaStream_t s);
// a.logits := their cross-entropy gradient in place (ops::XentOnLoad on device pointers).
void xent_grad(__nv_bfloat16* logits, const float* lse, const std::int32_t* targets, std::int64_t vocab_begin,
               std::int64_t real_cols, float dloss, std::int64_t rows, std::int64_t cols, cudaStream_t s);
std::int64_t grad_partials(std::int64_t rows, std::int64_t cols);

// The grouped cast + transpose (GroupedQuantizeArgs) on device pointers. A grouping's plan (host
// ints, uploaded by the caller): three arrays of experts + 1 entries, begin (expert e's first row of
// x; entry `experts`: the rows used), seg (its first padded row: its colwise block, a contiguous
// [cols, seg[e + 1] - seg[e]] one, starts at element cols * seg[e]; entry `experts`: the padded
// total) and tile (its first 64 x 64 tile of the padded rows; entry `experts`: the tiles).
//   grouped_cast_plan(offsets, experts, 0, cols): a mixture of experts' grouping (offsets: host,
//     experts + 1 entries), each expert's rows padded to a multiple of 16;
//   grouped_cast_plan(nullptr, experts, rows, cols): a stacked [experts, rows, cols] tensor, no
//     padding (the batched quantize of the experts' weights: colwise = [experts, cols, rows]).
std::vector<std::int32_t> grouped_cast_plan(const std::int32_t* offsets, int experts, std::int64_t rows_each,
                                            std::int64_t cols);
// rowwise [begin[experts], cols] gets encode(v * *scale) of the rows' values v, colwise the blocks,
// the padded rows' codes being encode(0 * *scale) (either copy may be null); max |v| over the rows
// used max-accumulated into *amax unless null. With neither copy, the amax alone. The values
// (GroupedSource, on device pointers): the rows of x as they are (bf16 or f32), or, from bf16
// tensors, gelu(x), swiglu(x) (x [rows, 2 cols]), grad * gelu'(x) (grad and x [rows, cols]), or
// swiglu_backward's values (grad [rows, cols / 2], x [rows, cols]), each rounded to bf16 as those ops
// store it. The plan's tiles cover the loaded columns: cols, or cols / 2 for dswiglu (both halves of
// a row come from one load). 16-byte accesses over 64 x 64 tiles when every padded count and the
// loaded columns are multiples of 16 and the pointers 16-byte aligned; one element per thread
// otherwise.
enum class CastSource { plain, gelu, swiglu, dgelu, dswiglu };
// A plan of up to kInlinePlanExperts experts travels in the kernel's parameters instead of device
// memory: no copy on the stream before the kernel (on moe-1b each such copy left the GPU idle for
// ~14 us while the copy engine took over and handed back, ~1.4 ms a step).
constexpr int kInlinePlanExperts = 64;
struct InlinePlan {
  std::int32_t v[3 * (kInlinePlanExperts + 1)];
};
struct GroupedCast {
  const void* x = nullptr;
  DType x_dtype = DType::bf16;
  CastSource source = CastSource::plain;
  const void* grad = nullptr;  // dgelu, dswiglu: the activation output's gradient (bf16)
  const std::int32_t* plan = nullptr;  // device: begin, seg, tile (grouped_cast_plan); or null and
  InlinePlan inline_plan{};            // the plan here (experts <= kInlinePlanExperts)
  int experts = 0;
  std::int64_t used_rows = 0, padded_rows = 0, tiles = 0;  // the plan's totals
  bool tiled = false;                                      // every padded count a multiple of 16
  std::int64_t cols = 0;
  std::uint8_t* rowwise = nullptr;
  std::uint8_t* colwise = nullptr;
  Format format = Format::e4m3;
  const float* scale = nullptr;
  float* amax = nullptr;
};
void cast_transpose_grouped(const GroupedCast& a, cudaStream_t s);

// *amax = max(*amax, max |x|) over n elements (NaN propagates).
void amax(const void* x, DType x_dtype, std::int64_t n, float* amax, cudaStream_t s);

// *scale = compute_scale(fp8_max, *amax, margin, *scale); *scale_inv = 1 / *scale (one thread).
void scale_from_amax(const float* amax, float* scale, float* scale_inv, float fp8_max, int margin, cudaStream_t s);

// out[i] = decode(q[i]) * *scale_inv.
void dequantize(float* out, const std::uint8_t* q, Format f, std::int64_t n, const float* scale_inv, cudaStream_t s);
// out [cols, rows] = in [rows, cols]^T, bytes.
void transpose_bytes(std::uint8_t* out, const std::uint8_t* in, std::int64_t rows, std::int64_t cols, cudaStream_t s);

// The delayed-scaling update of every slot (DelayedUpdateArgs): one kernel, one thread per slot.
void delayed_update(const DelayedUpdateArgs& a, cudaStream_t s);

// AdamWQuantizeArgs on device pointers: param, grad, m, v [rows, cols] (param f32; grad f32 or bf16
// bits where bf16_grad; m and v f32, or bf16 where bf16_moments); rowwise [rows, cols]
// and colwise [cols, rows] both or neither (neither: the update alone). 16-byte accesses over
// 64 x 64 tiles when rows and cols are multiples of 16 and the pointers 16-byte aligned.
struct AdamWQuantizeDev {
  float* param = nullptr;
  const void* grad = nullptr;  // f32, or bf16 where bf16_grad (ops::grad_load: read as f32 exactly)
  bool bf16_grad = false;
  void* m = nullptr;  // f32, or bf16 where bf16_moments (ops::moment_load / moment_store)
  void* v = nullptr;
  bool bf16_moments = false;
  std::uint8_t* rowwise = nullptr;
  std::uint8_t* colwise = nullptr;
  Format format = Format::e4m3;
  const float* scale = nullptr;
  float* amax = nullptr;  // optional
  std::int64_t rows = 0, cols = 0;
  std::int64_t batch = 1;  // rows are `batch` stacked matrices; colwise = each one's transpose
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, grad_scale = 1;
  std::int64_t step = 1;
  const float* scalars = nullptr;  // ops::AdamW::scalars (device), in place of lr, grad_scale and step
};
void adamw_quantize(const AdamWQuantizeDev& a, cudaStream_t s);
// The step of u (its param [rows, cols] f32, batch 1; its copies, scale and amax unused) and the block
// quantisation of the updated param into k's copies (k.x and the prologue unused) in one pass: the
// codes and scales quantize_blocks of the updated param writes.
void quantize_blocks_adamw(const BlockCast& k, const AdamWQuantizeDev& u, cudaStream_t s);
// quantize_blocks_adamw of stacked weights (u.param [rows, cols], batch 1) grouped: the step of every
// row, each group's rows quantised on their own into its copies (unpadded), in one launch. Every row
// of the param lies in exactly one group.
void quantize_blocks_adamw_grouped(const BlockCast& k, const AdamWQuantizeDev& u,
                                   std::span<const BlockCastGroup> groups, cudaStream_t s);

// The elementwise part of an epilogue cuBLASLt does not fuse with FP8 inputs, after a plain GEMM, on
// a row-major bf16 d [M, N] (aux bf16 [M, N]):
//   bias: d += bias[n];  gelu: d = gelu(aux) (the GEMM wrote aux);  dgelu: d *= gelu'(aux)
void gemm_epilogue(__nv_bfloat16* d, const __nv_bfloat16* aux, const __nv_bfloat16* bias, std::int64_t M,
                   std::int64_t N, ops::Epilogue epilogue, cudaStream_t s);

}  // namespace kiln::fp8::cuda
