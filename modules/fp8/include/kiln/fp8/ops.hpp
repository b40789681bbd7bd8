#pragma once
// The FP8 operations, with two implementations like the compute backends: CUDA (kernels and
// cuBLASLt FP8 GEMMs on one stream) and CPU (the emulation: bit-exact casts, GEMMs of the
// dequantised values in fp32). Everything above this interface (Fp8Linear, the scaling update,
// the engine module) is shared by both.
//
// Conventions: "act" is the activation dtype of the device (bf16 on CUDA, f32 on the CPU);
// tensors are contiguous and row-major; scale pointers (scale, scale_inv, amax) point to single
// floats in the device's memory; operations are asynchronous on the CUDA stream and deterministic.
#include <cstdint>
#include <memory>
#include <span>
#include <variant>

#include "kiln/fp8/block.hpp"
#include "kiln/fp8/recipe.hpp"
#include "kiln/fp8/tensor.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/ops/epilogue.hpp"
#include "kiln/ops/prologue.hpp"
#include "kiln/tensor/buffer.hpp"

namespace kiln::fp8 {

// D[M, N] = deq(X)[M, K] @ deq(Y)[N, K]^T with deq(q) = decode(q) * scale_inv. Both operands have K
// contiguous, as Hopper's FP8 tensor cores require (and N and K multiples of 16 on CUDA). Epilogues:
// ops::Epilogue (D act, written).
struct GemmArgs {
  TensorView x;                         // [M, K] e4m3/e5m2
  const float* x_scale_inv = nullptr;
  TensorView y;                         // [N, K] e4m3/e5m2 (not both e5m2)
  const float* y_scale_inv = nullptr;
  // [M, N] act (written), or with f32_result f32 or bf16 (the gradient dtype; written, or D += result)
  TensorView d;
  bool accumulate = false;              // D += result (needs f32_result)
  // D a weight gradient, never rounded to act: f32, or bf16 (optim.grads = "bf16": the product in
  // f32, rounded once where written; where accumulating, cuBLASLt's kernel on an H200 rounds as if the
  // product were rounded before the old value is added, docs/PERF.md "bf16 gradients")
  bool f32_result = false;
  ops::Epilogue epilogue = ops::Epilogue::none;
  TensorView bias;                      // [N] act: bias, or gelu with bias
  TensorView aux;                       // [M, N] act: gelu (written) and dgelu (read)
  bool fast_accum = false;              // FP8 fast accumulation (forward only)
  const char* what = "fp8_gemm";        // the name profiling reports it under
  // Block scaling (kiln/fp8/block.hpp): x_scale_inv / y_scale_inv are then the operands' block
  // scales in BlockLayout{mode, rows, K}. Block-scaled products take no fast accumulation, and
  // their epilogues run after the product (cuBLASLt has neither fused for them on Hopper).
  ScalingMode x_mode = ScalingMode::per_tensor, y_mode = ScalingMode::per_tensor;
};

// The delayed-scaling update of every slot at once: per slot i,
//   amax = max over the history rows (algo max) or row 0 (most_recent);
//   scale[i] = compute_scale(fp8_max[i], amax, margin, scale[i]); scale_inv[i] = 1 / scale[i];
// then the history rolls: row h <- row h-1, row 0 <- 0 (row 0 is the step being recorded).
struct DelayedUpdateArgs {
  float* history = nullptr;    // [len, n]
  float* scale = nullptr;      // [n]
  float* scale_inv = nullptr;  // [n], element i at scale_inv[i * scale_inv_stride]
  const float* fp8_max = nullptr;  // [n]
  int len = 0, n = 0;
  AmaxAlgo algo = AmaxAlgo::max;
  int margin = 0;
  int scale_inv_stride = 1;
};

// The gradient side of a linear layer's backward pass in one read of dy ([rows, cols], act):
//   g = dy, or with gelu_pre: g = act(dy * gelu'(gelu_pre)) (rounded to act exactly as the unfused
//   dGELU stores it, so both paths quantise the same values), or with xent (dy its logits): the
//   cross-entropy's gradient, the values Fp8Ops::xent_grad writes (no gelu_pre, no dbias then);
//   out.rowwise and out.colwise = encode(g * *out.scale) (both copies are written);
//   *amax = max(*amax, max |g|) unless amax is null;
//   dbias[c] += sum over rows of g[r, c] (f32 or bf16 (the gradient dtype) [cols]) unless dbias is empty.
// The implementation may overwrite dy with g (its fallback for shapes the fused kernel does not take).
struct GradQuantizeArgs {
  TensorView dy;
  TensorView gelu_pre;   // optional, act, same shape as dy
  Fp8TensorView out;
  float* amax = nullptr;
  TensorView dbias;      // optional
  const ops::XentOnLoad* xent = nullptr;  // optional: dy is xent->logits
};

// One AdamW step of an f32 master weight and, given out's copies, its quantisation in the same pass
// (the fp8 module's fused weight update, see Fp8Linear::update_weight): per element
// ops::adamw_update(param, m, v, grad * grad_scale, ...) with the bias corrections of `step`
// (ops::adamw_bias_corrections), exactly as the optimizer's AdamW; then, with out.rowwise (and
// out.colwise), the copies of the updated param encoded with *out.scale and max |param|
// max-accumulated into *amax (unless null), exactly as quantize(param, out, amax) after the update.
struct AdamWQuantizeArgs {
  // [rows, cols] f32, or [batch, rows, cols] (stacked matrices, e.g. a mixture of experts' weights:
  // their colwise copy is each one's transpose, [batch, cols, rows], as quantize() of them writes);
  // param, m, v updated in place; param f32; grad f32 or bf16 (the gradient dtype, optim.grads: read
  // as f32 exactly, ops::grad_load); m and v f32, or both bf16 (optim.moments: ops::moment_load /
  // moment_store)
  TensorView param, grad, m, v;
  Fp8TensorView out;             // both copies, the rowwise one (a part of a weight), or neither
  float* amax = nullptr;
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0, grad_scale = 1;
  std::int64_t step = 1;
  // As ops::AdamW::scalars: the step's lr, gradient scale and bias corrections from device memory
  // when the update runs (in place of lr, grad_scale and step); a NaN gradient scale writes nothing.
  const float* scalars = nullptr;
};

// A grouped tensor's rows (a mixture of experts: expert e's are rows [offsets[e], offsets[e + 1]) of
// x) quantised with *out.scale as the operands of one FP8 GEMM per expert:
//   out.rowwise [offsets[experts], cols]: the rows as they are (as quantize() of them writes);
//   out.colwise [segment_row(offsets, experts) * cols] (1-D): expert e's transpose as one contiguous
//     [cols, segment_rows(offsets, e)] block starting at element cols * segment_row(offsets, e), its
//     columns past the expert's rows holding the code of 0 (segment_rows rounds the rows up to a
//     multiple of 16: the weight gradient's K, which Hopper's FP8 GEMMs want a multiple of 16);
// max |x| over the experts' rows max-accumulated into *amax unless null; with neither copy, the
// amax alone.
//
// x is the rows themselves, or the values an activation's forward or backward pass would store,
// computed as they are loaded (rounded to act exactly as those ops round them, so the codes are the
// unfused path's): the input of an FC2 whose activation is not stored, the output gradient of an FC1
// whose activation's backward is not run on its own.
//   TensorView [R, cols]                   the rows
//   ops::GeluOnLoad{pre [R, cols]}         gelu_forward's values
//   ops::SwigluOnLoad{gate_up [R, 2 cols]} swiglu_forward's values
//   ops::DgeluOnLoad{dgelu, pre [R, cols]} gelu_backward's values (dgelu * gelu'(pre))
//   ops::DswigluOnLoad{dswiglu [R, cols / 2], gate_up [R, cols]}  swiglu_backward's values
using GroupedSource =
    std::variant<TensorView, ops::GeluOnLoad, ops::SwigluOnLoad, ops::DgeluOnLoad, ops::DswigluOnLoad>;
// A source's [R, cols]; throws where its tensors do not fit together (naming `what`).
Shape grouped_source_shape(const GroupedSource& x, const char* what);
struct GroupedQuantizeArgs {
  GroupedSource x;                             // [R, cols] act
  const std::int32_t* offsets_host = nullptr;  // [experts + 1], host memory
  int experts = 0;
  Fp8TensorView out;
  float* amax = nullptr;
};
// Expert e's rows rounded up to a multiple of 16, and the first of its padded rows (e = experts:
// the padded total), as GroupedQuantizeArgs lays out its colwise copy.
constexpr std::int64_t segment_rows(const std::int32_t* offsets, int e) {
  return (static_cast<std::int64_t>(offsets[e + 1]) - offsets[e] + 15) / 16 * 16;
}
constexpr std::int64_t segment_row(const std::int32_t* offsets, int e) {
  std::int64_t r = 0;
  for (int j = 0; j < e; ++j) r += segment_rows(offsets, j);
  return r;
}

// The values a block quantisation reads: GroupedSource's forms and a LayerNorm's output, computed on
// load from its forward's statistics (ops::LayerNormOnLoad with mean and rstd filled in, e.g. by
// Fp8Ops::layernorm_stats), each rounded to act as the op that would store it rounds it.
using QuantizeSource = std::variant<TensorView, ops::LayerNormOnLoad, ops::GeluOnLoad, ops::SwigluOnLoad,
                                    ops::DgeluOnLoad, ops::DswigluOnLoad>;
QuantizeSource to_source(const GroupedSource& x);
// A linear layer's input or output gradient (the tensor, or the prologue it is computed through).
QuantizeSource to_source(const ops::LinearInput& x);
QuantizeSource to_source(const ops::OutputGrad& dout);
// Rows [r0, r0 + n) of a source: each of its row-indexed tensors (and statistics) sliced.
QuantizeSource source_rows(const QuantizeSource& x, std::int64_t r0, std::int64_t n);
// A source's [R, cols]; throws where its tensors do not fit together (naming `what`).
Shape source_shape(const QuantizeSource& x, const char* what);

// Block quantisation (kiln/fp8/block.hpp) of x [rows, cols] (act or f32, or computed on load): the
// codes of x (rowwise [rows, cols], scales in BlockLayout{mode, rows, cols}) and/or of its transpose
// (colwise [cols, rows], scales in BlockLayout{mode, cols, rows}: the operand of a weight or data
// gradient; the transpose's 128x128 tiles are x's transposed, so their scales are the same values),
// each block's scale from its own amax (rounded down to a power of two with pow2). The codes' dtype
// (e4m3 or e5m2, the same for both) is the format. With dbias (f32 [cols]): dbias[c] += the sum over
// the rows of x[r, c] (a bias gradient, in the same read; a fixed order on every device, not
// necessarily the backends' bias_grad order).
// Padded outputs: rowwise may have more rows than x ([Rr, cols], Rr >= rows) and colwise more columns
// ([cols, Rc], Rc >= rows): they are the codes of x with zero rows appended (zero codes, the zero
// blocks' scale_inv 1, the other blocks' scales unchanged; scales in BlockLayout{mode, Rr, cols} and
// {mode, cols, Rc}), the operands of products whose rows or K must be multiples of 4 or 16 (a mixture
// of experts' groups). Not with dbias.
struct BlockQuantizeArgs {
  QuantizeSource x;
  ScalingMode mode = ScalingMode::block_1x128;
  bool pow2 = false;
  TensorView rowwise;
  float* row_scale_inv = nullptr;
  TensorView colwise;
  float* col_scale_inv = nullptr;
  TensorView dbias;
};

// A grouped block quantisation (a mixture of experts' rows, one group per expert): group g is rows
// [first, first + rows) of x, quantised exactly as quantize_blocks of source_rows(x, first, rows)
// into its own copies (padded as BlockQuantizeArgs allows; no dbias). Every group with rows has the
// same copies (rowwise, colwise or both) in one format.
struct BlockGroup {
  std::int64_t first = 0, rows = 0;
  TensorView rowwise;
  float* row_scale_inv = nullptr;
  TensorView colwise;
  float* col_scale_inv = nullptr;
};
struct GroupedBlockQuantizeArgs {
  QuantizeSource x;  // [R, cols]
  ScalingMode mode = ScalingMode::block_1x128;
  bool pow2 = false;
  std::span<const BlockGroup> groups;
};

class Fp8Ops {
 public:
  virtual ~Fp8Ops() = default;
  virtual Device device() const = 0;
  virtual DType act_dtype() const = 0;
  virtual Buffer alloc(std::size_t bytes) = 0;
  // Copies bytes between any two devices (synchronises when the destination is host memory).
  virtual void copy(void* dst, const void* src, std::size_t bytes) = 0;
  // Copies bytes within this device's memory, in order with the other work and without waiting for
  // it (copy() where the device has no queue, which is this default).
  virtual void copy_on_device(void* dst, const void* src, std::size_t bytes) { copy(dst, src, bytes); }
  virtual void zero(void* dst, std::size_t bytes) = 0;
  virtual void synchronize() = 0;

  // *amax = max(*amax, max |x|) over an act or f32 tensor (NaN propagates).
  virtual void amax(const TensorView& x, float* amax) = 0;
  // Current scaling: *scale = compute_scale(fp8_max, *amax, margin, *scale), *scale_inv = 1 / *scale.
  virtual void scale_from_amax(const float* amax, float* scale, float* scale_inv, float fp8_max, int margin) = 0;
  // Quantises x ([rows, cols], act or f32) with *out.scale into out.rowwise and/or out.colwise (the
  // transpose), reading x once; max-accumulates max |x| into *amax unless it is null. Batched: x
  // [B, rows, cols] into rowwise [B, rows, cols] and/or colwise [B, cols, rows] (each slice
  // transposed on its own: a mixture of experts' stacked weights).
  virtual void quantize(const TensorView& x, const Fp8TensorView& out, float* amax) = 0;
  virtual void quantize_grouped(const GroupedQuantizeArgs& a) = 0;
  // Block quantisation (kiln/fp8/block.hpp) in one read of x (BlockQuantizeArgs).
  virtual void quantize_blocks(const BlockQuantizeArgs& a) = 0;
  // Every group's quantize_blocks (GroupedBlockQuantizeArgs), which is what this default does; CUDA
  // runs them in one launch.
  virtual void quantize_blocks_grouped(const GroupedBlockQuantizeArgs& a);
  // quantize() and amax() of act(gelu(pre)) (the values gelu_forward would store), computed on load.
  virtual void quantize_gelu(const TensorView& pre, const Fp8TensorView& out, float* amax) = 0;
  virtual void amax_gelu(const TensorView& pre, float* amax) = 0;
  // quantize() and amax() of act(swiglu(pre)) (pre [rows, 2 cols]: gate columns, then up columns;
  // the values swiglu_forward would store, [rows, cols]), computed on load.
  virtual void quantize_swiglu(const TensorView& pre, const Fp8TensorView& out, float* amax) = 0;
  virtual void amax_swiglu(const TensorView& pre, float* amax) = 0;
  // quantize() of the LayerNorm output ln describes (ops::LayerNormOnLoad: the values layernorm_forward
  // stores, from the forward's statistics), computed on load.
  virtual void quantize_layernorm(const ops::LayerNormOnLoad& ln, const Fp8TensorView& out, float* amax) = 0;
  // The statistics of LayerNorm(ln.x) into ln.mean and ln.rstd, exactly as the backend's
  // layernorm_forward computes them, and, unless amax is null, max |output| max-accumulated into it.
  virtual void layernorm_stats(const ops::LayerNormOnLoad& ln, float* amax) = 0;
  virtual void quantize_grad(const GradQuantizeArgs& a) = 0;
  // dy := act(dy * gelu'(pre)) in place (the unfused dGELU; act tensors of the same shape).
  virtual void dgelu(const TensorView& dy, const TensorView& pre) = 0;
  // x.logits := the cross-entropy's gradient (ops::XentOnLoad) in place: the values the backend's
  // cross_entropy_finish would have written over them (the unfused path of an FP8 LM head).
  virtual void xent_grad(const ops::XentOnLoad& x) = 0;
  // out (f32, same shape) = decode(q) * *scale_inv.
  virtual void dequantize(const TensorView& out, const TensorView& q, const float* scale_inv) = 0;
  // out [cols, rows] = in [rows, cols] transposed: one-byte codes (an FP8 tensor's, or u8), copied
  // as they are (the colwise copy of a weight whose rowwise copy was gathered).
  virtual void transpose(const TensorView& out, const TensorView& in) = 0;
  virtual void gemm(const GemmArgs& g) = 0;
  // Independent products, each as gemm() takes it (per-tensor or block scaling) but 2-D without
  // epilogue, no two writing the same D and none reading another's: a mixture of experts' experts,
  // whose rows (M, or K for a weight gradient) change from call to call. CUDA runs them concurrently
  // over several streams (see kiln/fp8/cuda/gemm.hpp), per-tensor ones with the algorithm cached for
  // their rounded shape (the same product as gemm(), deterministic, though not necessarily gemm()'s
  // kernel), block-scaled ones as gemm() plans them.
  virtual void gemm_grouped(std::span<const GemmArgs> gs) = 0;
  // dbias[n] += sum over m of dy[m, n] (dy act, dbias f32 or bf16 (the gradient dtype): summed in f32,
  // rounded once).
  virtual void bias_grad(const TensorView& dbias, const TensorView& dy) = 0;
  virtual void update_delayed(const DelayedUpdateArgs& a) = 0;
  virtual void adamw_quantize(const AdamWQuantizeArgs& a) = 0;
  // A part of a 128x128-scaled weight (kiln/fp8/block.hpp's BlockPart, on this device; the tile
  // arrays in BlockLayout{128x128, rows, cols}, the transposed scales in {128x128, cols, rows}), bit
  // for bit as its references: the part's tile amaxes max-accumulated, the scales from the ranks'
  // agreed amaxes, and the part's codes.
  virtual void block_part_amax(const BlockPart& p, float* tile_amax) = 0;
  virtual void block_scales(const float* tile_amax, std::int64_t rows, std::int64_t cols, Format f, bool pow2,
                            float* scale, float* row_scale_inv, float* col_scale_inv) = 0;
  virtual void quantize_block_part(const BlockPart& p, const float* scale, Format f, std::uint8_t* codes) = 0;
  // The AdamW step of u (a whole weight: param [rows, cols] f32; u.out and u.amax unused) and the block
  // quantisation of the updated weight into `out` (out.x unused; no dbias): exactly
  // adamw_quantize(u) then quantize_blocks(out with x = u.param), which is what this default does;
  // CUDA runs both in one pass.
  virtual void adamw_quantize_blocks(const AdamWQuantizeArgs& u, const BlockQuantizeArgs& out);
  // The AdamW step of stacked weights (u.param [rows, cols] or [batch, rows, cols] f32, a mixture of
  // experts' whole weights) and each group's block quantisation (out.x unused; group g is rows
  // [first, first + rows) of the param seen as [R, cols], unpadded; the groups cover the R rows in
  // order): exactly adamw_quantize_blocks of each group's rows with its outputs, which is what this
  // default does; CUDA runs all in one pass.
  virtual void adamw_quantize_blocks_grouped(const AdamWQuantizeArgs& u, const GroupedBlockQuantizeArgs& out);
};

struct CpuOpsOptions {
  bool round_bf16 = false;  // round act outputs to bf16, as the CUDA side stores them
  int threads = 0;          // 0: all hardware threads
};
std::unique_ptr<Fp8Ops> make_cpu_ops(const CpuOpsOptions& options = {});
// FP8 operations on the current CUDA device, on `stream` (a cudaStream_t; nullptr = the legacy
// default stream). Throws in a build without CUDA.
// Which kernels run the block-scaled products (fp8.block_gemm): cuBLASLt's throughout, kiln's own
// (kiln/fp8/cuda/block_gemm.hpp) throughout, or kiln's for the 1x128 x 1x128 products (the weight
// gradients) and cuBLASLt's for the rest.
enum class BlockGemmKernel { cublaslt, kiln, kiln_wgrad };
struct CudaOpsOptions {
  bool tune_grouped = false;  // the experts' GEMM algorithms tuned among bit-identical candidates
                              // (ops::BackendConfig::grouped_gemm_tune)
  BlockGemmKernel block_gemm = BlockGemmKernel::cublaslt;
};
std::unique_ptr<Fp8Ops> make_cuda_ops(void* stream, const CudaOpsOptions& options = {});

}  // namespace kiln::fp8
