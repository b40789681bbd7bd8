#pragma once
// One op interface, two backends: CUDA (fast) and CPU (plain fp32 reference loops). The model calls
// only these ops. Every CUDA op is tested against the CPU op on random data at awkward sizes.
//
// Conventions for every op below:
//  - "act" is the backend's activation dtype (act_dtype()): bf16 on CUDA, f32 on CPU. The CPU
//    backend can emulate bf16 by rounding every act output to bf16 (CpuOptions::round_bf16).
//  - Arithmetic is fp32; act outputs are rounded once, when stored.
//  - Gradients of parameters are ACCUMULATED (+=) and f32, or bf16 (the gradient dtype,
//    optim.grads = "bf16": the contribution computed in f32 as for f32, then stored once as
//    round_bf16(float(old) + contribution), or round(contribution) where written); all the parameter
//    gradients of one call have one dtype. Gradients of activations are written (=) unless the field
//    says "accumulated".
//  - Tensors are contiguous, row-major. N = number of tokens (B*T), C = channels.
//  - Ops are asynchronous on the backend's compute stream; only functions returning a host value
//    synchronise.
//  - Results are deterministic: the same inputs give the same bits, run after run (unless a CUDA
//    backend is made with attention_deterministic = false; see CudaOptions).
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <boost/describe/enum.hpp>

#include "kiln/ops/formulas.hpp"
#include "kiln/ops/moe.hpp"
#include "kiln/ops/prologue.hpp"
#include "kiln/rng/philox.hpp"
#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/tensor.hpp"

namespace kiln::ops {

// Dropout on a [rows, cols] view that is part of a logical [*, cols_total] tensor: element
// (r, c) draws Philox element (row_offset + r) * cols_total + col_offset + c of `rng`, and is kept
// (scaled by 1/(1-p)) when dropout_keep() says so. p == 0 means no dropout and no draw.
struct DropoutArgs {
  float p = 0;
  rng::PhiloxArgs rng;
  std::int64_t row_offset = 0;
  std::int64_t col_offset = 0;
  std::int64_t cols_total = 0;  // 0: the view's own column count
};

// Vocabulary-parallel tables: `wte` holds rows [vocab_begin, vocab_begin + V) of a table of
// vocab_total rows (0: V, the whole table). Tokens outside this rank's rows contribute zero, so the
// sum over the ranks (an all-reduce or reduce-scatter) is the lookup in the whole table.
struct EmbeddingForward {
  TensorView out;     // [N, C] act = wte[tokens[n] - vocab_begin] (or 0) + (positions ? wpe[n % T] : 0)
  TensorView tokens;  // [N] i32, on the backend's device
  TensorView wte;     // [V, C] act
  TensorView wpe;     // [Tmax, C] act, Tmax >= T (unused, may be empty, without positions)
  int T = 0;
  std::int64_t vocab_begin = 0;
  std::int64_t vocab_total = 0;
  bool positions = true;
};
struct EmbeddingBackward {
  TensorView dwte;    // [V, C] f32 or bf16 (the gradient dtype), accumulated (tokens of this rank's rows only)
  TensorView dwpe;    // [Tmax, C] f32 or bf16 (the gradient dtype), accumulated; optional (no position table)
  TensorView dout;    // [N, C] act
  TensorView tokens;  // [N] i32 on the device
  const std::int32_t* tokens_host = nullptr;  // the same N tokens on the host
  int T = 0;
  std::int64_t vocab_begin = 0;
  std::int64_t vocab_total = 0;
};

struct LayerNormForward {
  TensorView out;     // [N, C] act = (x - mean) * rstd * weight + bias
  TensorView mean;    // [N] f32
  TensorView rstd;    // [N] f32 = 1 / sqrt(var + eps), biased variance
  TensorView x;       // [N, C] act
  TensorView weight;  // [C] act
  TensorView bias;    // [C] act
  float eps = 1e-5f;
};
struct LayerNormBackward {
  TensorView dx;       // [N, C] act, ACCUMULATED (the residual stream's gradient)
  TensorView dweight;  // [C] f32 or bf16 (the gradient dtype), accumulated
  TensorView dbias;    // [C] f32 or bf16 (the gradient dtype), accumulated
  TensorView dout;     // [N, C] act
  TensorView x;        // [N, C] act (forward input)
  TensorView weight;   // [C] act
  TensorView mean;     // [N] f32
  TensorView rstd;     // [N] f32
};

// y = x @ weight^T + bias; with pre_gelu given: pre_gelu = y and out = gelu(y), GELU with the tanh
// approximation: 0.5 y (1 + tanh(sqrt(2/pi) (y + 0.044715 y^3))).
struct LinearForward {
  TensorView out;       // [N, OC] act
  TensorView pre_gelu;  // [N, OC] act, optional
  // [N, IC] act; or, for a LinearImpl that takes it, a prologue the input is computed from
  // (prologue.hpp: the backends take the tensor itself).
  LinearInput x;
  TensorView weight;  // [OC, IC] act
  TensorView bias;    // [OC] act, optional
};
struct LinearBackward {
  TensorView dx;       // [N, IC] act = dout @ weight; optional (skipped when empty)
  // [OC, IC] f32 or bf16 (the gradient dtype), accumulated: += dout^T @ x (written: = with
  // dweight_overwrite). Optional: without it
  // (and without dbias) the call computes dx alone, and may be given any consecutive rows of dout, x
  // and dx (tensor-parallel communication overlapped with the GEMMs: parallel/comm_overlap).
  TensorView dweight;
  TensorView dbias;  // [OC] f32 or bf16 (dweight's dtype), accumulated: += column sums of dout; optional (only with dweight)
  // [N, OC] act; or, for a LinearImpl that takes it, DgeluOnLoad (prologue.hpp).
  OutputGrad dout;
  // The forward's input, as it was given to the forward (an implementation that keeps its own copy
  // of the input, LinearImpl::keeps_input, reads none of it).
  LinearInput x;
  TensorView weight;       // [OC, IC] act
  TensorView dx_gelu_pre;  // [N, IC] act, optional: x was gelu(pre); then dx = (dout @ weight) * gelu'(pre)
  // dweight = dout^T @ x instead of +=: the step's first contribution to a gradient nothing else
  // adds to (nn::GradWrittenFirst), which then needs no zeroing and no read.
  bool dweight_overwrite = false;
  // Called, when given, once dx's work is queued and before the weight gradient's: what the caller
  // queues then (a sum of dx over a tensor-parallel group on a side stream) runs beside it. Every
  // implementation calls it where it computes dx (parallel/comm_overlap relies on it); the bias
  // gradient may come before or after (an FP8 layer sums it while quantising dout).
  std::function<void()> dgrad_queued;
};

// out = gelu(x), elementwise (recomputes a GELU output in the backward pass instead of storing it).
struct GeluForward {
  TensorView out;  // act, any shape
  TensorView x;    // act, same element count
};
// dx = dout * gelu'(x), elementwise (where something sits between a GELU and the GEMM that would
// otherwise apply gelu'() as its epilogue: a mixture of experts' expert dropout).
struct GeluBackward {
  TensorView dx;    // act, any shape
  TensorView dout;  // act, same element count
  TensorView x;     // act, same element count: the GELU's input
};

// RMSNorm (Llama): out = x * rstd * weight, rstd = 1 / sqrt(mean over the row of x^2 + eps).
struct RmsNormForward {
  TensorView out;     // [N, C] act
  TensorView rstd;    // [N] f32
  TensorView x;       // [N, C] act
  TensorView weight;  // [C] act
  float eps = 1e-5f;
};
struct RmsNormBackward {
  TensorView dx;       // [N, C] act, ACCUMULATED (the residual stream's gradient)
  TensorView dweight;  // [C] f32 or bf16 (the gradient dtype), accumulated
  TensorView dout;     // [N, C] act
  TensorView x;        // [N, C] act (forward input)
  TensorView weight;   // [C] act
  TensorView rstd;     // [N] f32
};

// Rotary position embedding, in place, on the first `rotated_heads` heads of every position of
// x = [B, T, heads, D] (the fused QKV: its query and key heads). For i < D/2 the pair (x[i],
// x[i + D/2]) rotates by the angle (pos_offset + t) * theta^(-2i/D), t the position in its sequence
// (rotate_half, the layout of Hugging Face's Llama), or its Llama 3.1 scaled frequency (`scaling`).
// inverse: by minus the angle, which is the backward pass (the rotation's transpose) applied to the
// gradient.
struct Rope {
  TensorView x;  // [B, T, heads, D] act, rotated in place
  int rotated_heads = 0;
  float theta = 10000.0f;
  std::int64_t pos_offset = 0;
  bool inverse = false;
  RopeScaling scaling = {};
};

// SwiGLU (Llama's MLP): out[n, f] = silu(x[n, f]) * x[n, F + f], silu(g) = g / (1 + exp(-g)): x
// holds the gate projection's F columns, then the up projection's (FC1's output).
struct SwigluForward {
  TensorView out;  // [N, F] act
  TensorView x;    // [N, 2F] act
};
struct SwigluBackward {
  TensorView dx;    // [N, 2F] act (written; may not alias x)
  TensorView dout;  // [N, F] act
  TensorView x;     // [N, 2F] act (forward input)
};

// Causal multi-head attention on the fused QKV projection, softmax(q k^T * scale) v, with dropout p
// on the attention probabilities: probability (b, h, i, j) draws Philox element
// (((seq_offset + b) * heads_total + head_offset + h) * T + i) * T + j, so a tensor-parallel shard
// of the heads, or a data-parallel rank's (or micro-batch's) sequences, draws what the whole
// step's batch would.
// Grouped-query attention (kv_heads = K > 0, H a multiple of K): qkv is [B, T, H + 2K, D], the H
// query heads, then K key heads, then K value heads of each position; query head h reads key and
// value head h / (H / K) (K = 1: multi-query). kv_heads = 0 is the [B, T, 3, H, D] layout of
// multi-head attention (the same bytes as kv_heads = H).
struct AttentionForward {
  TensorView out;  // [B, T, H, D] act
  TensorView lse;  // [B, H, T] f32: log-sum-exp of each row of the scaled scores
  TensorView qkv;  // [B, T, 3, H, D] act, or [B, T, H + 2 kv_heads, D]
  float scale = 0;
  float dropout = 0;
  rng::PhiloxArgs rng;
  int head_offset = 0;
  int heads_total = 0;  // 0: H
  std::int64_t seq_offset = 0;  // the global index of sequence 0 (dropout)
  int kv_heads = 0;             // 0: multi-head attention
  // [B, T] i32, optional: packed documents. Position i attends to positions [doc_start[b, i], i] of
  // its sequence only (the first position of its document); empty: to [0, i].
  TensorView doc_start;
};
struct AttentionBackward {
  TensorView dqkv;  // qkv's shape, act; a key or value head's gradient sums over its query heads
  TensorView dout;  // [B, T, H, D] act
  TensorView out;   // [B, T, H, D] act (forward output)
  TensorView lse;   // [B, H, T] f32
  TensorView qkv;   // [B, T, 3, H, D] act, or [B, T, H + 2 kv_heads, D]
  float scale = 0;
  float dropout = 0;
  rng::PhiloxArgs rng;
  int head_offset = 0;
  int heads_total = 0;
  std::int64_t seq_offset = 0;
  int kv_heads = 0;
  TensorView doc_start;  // as AttentionForward's
};

// Attention of the newest position of each sequence over every position so far (generation with a
// KV cache), no dropout: out[b, h] = softmax(q k^T * scale) v with q = qkv[b, length - 1, 0, h] and
// k, v = qkv[b, 0..length-1, 1 and 2, h]; row length - 1 of attention_forward on qkv[:, :length].
// The cache is the fused QKV projection of every position, the layout attention_forward reads: the
// QKV linear writes each new row straight into it, and a prompt's rows are attention_forward's input.
struct AttentionDecode {
  TensorView out;  // [B, H, D] act
  TensorView qkv;  // [B, Tmax, 3, H, D] act, or [B, Tmax, H + 2 kv_heads, D]; rows [0, length) are read
  int length = 0;  // 1 <= length <= Tmax
  float scale = 0;
  int kv_heads = 0;  // as AttentionForward
};

// out = residual + dropout(x)
struct ResidualForward {
  TensorView out;       // [N, C] act (may alias residual)
  TensorView residual;  // [N, C] act
  TensorView x;         // [N, C] act
  DropoutArgs dropout;
};
// dx = dout * mask / (1 - p), the backward of dropout(x) with the same DropoutArgs.
struct DropoutBackward {
  TensorView dx;    // [N, C] act (may alias dout)
  TensorView dout;  // [N, C] act
  DropoutArgs dropout;
};

// Softmax cross-entropy over the first vocab_real logits of each row, fused with its backward:
// losses[n] = logsumexp(logits[n, :V']) - logits[n, target]; logits is overwritten with
// dlogits = (softmax - onehot(target)) * dloss, and 0 in the padded columns [V', V).
// Rows whose target is -1 are ignored: loss 0, gradient 0.
struct CrossEntropy {
  TensorView losses;   // [N] f32
  TensorView logits;   // [N, V] act, in: logits, out: dlogits
  TensorView targets;  // [N] i32 on the device
  int vocab_real = 0;
  float dloss = 1;
};

// Vocabulary-parallel cross-entropy (the logits' columns split over ranks: this rank holds columns
// [vocab_begin, vocab_begin + V) of the padded vocabulary, of which those below vocab_real count).
// Two steps around one all-gather of the statistics:
//   stats:  stats[n] = {max over this rank's real columns (-inf if none), sum of exp(logit - max)
//           over them, the target's logit if this rank holds it else 0}
//   finish: from every rank's stats ([ranks, N, 3], in rank order) the row's logsumexp L and target
//           logit; losses[n] = L - logit[target] (identical on every rank), logits overwritten with
//           dlogits = (exp(logit - L) - onehot(target)) * dloss, 0 in padded columns.
// Rows whose target is -1 are ignored: loss 0, gradient 0.
struct CrossEntropyStats {
  TensorView stats;    // [N, 3] f32
  TensorView logits;   // [N, V] act
  TensorView targets;  // [N] i32 on the device
  std::int64_t vocab_begin = 0;
  int vocab_real = 0;  // real (unpadded) size of the whole vocabulary
};
// With write_dlogits false the logits stay as they are and each row's logsumexp L goes to `lse`:
// the gradient is then made where it is read (ops::XentOnLoad, by formulas.hpp's xent_grad).
struct CrossEntropyFinish {
  TensorView losses;     // [N] f32
  TensorView logits;     // [N, V] act, in: logits, out: dlogits (unless !write_dlogits)
  TensorView targets;    // [N] i32 on the device
  TensorView all_stats;  // [ranks, N, 3] f32
  std::int64_t vocab_begin = 0;
  int vocab_real = 0;
  float dloss = 1;
  TensorView lse;            // [N] f32, optional: each row's logsumexp (0 for an ignored row)
  bool write_dlogits = true;
};

// AdamW over flat f32 buffers (one launch for all parameters). Segments say which elements get
// weight decay, and which are left alone (update = false: another module applies their update,
// e.g. fused with its own pass over them; neither params, params_act, m nor v is touched there). With grad_scale s (clipping), the gradient used is s * g. Bias correction uses
// `step` (counted from 1). Writes params (f32 master) and, if given, params_act = round(params):
// element offset + k of a segment at element act + k of params_act (kActAtOffset: the same index;
// kNoAct: none; a parameter store whose one-byte compute copies are apart, nn::ParamStore).
struct AdamWSegment {
  static constexpr std::int64_t kActAtOffset = -1, kNoAct = -2;
  std::int64_t offset = 0;
  std::int64_t count = 0;
  bool decay = true;
  bool update = true;
  std::int64_t act = kActAtOffset;
};
struct AdamW {
  TensorView params;      // [P] f32
  TensorView params_act;  // act, optional: [P], or holding every segment's act range
  TensorView grads;       // [P] f32 or bf16 (the gradient dtype; read as f32: ops::grad_load)
  TensorView m;           // [P] f32, or bf16 (both the same dtype: ops::moment_load / moment_store)
  TensorView v;           // [P] as m
  std::vector<AdamWSegment> segments;  // cover [0, P)
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  float grad_scale = 1;
  std::int64_t step = 1;
  // Optional, device memory of kAdamWScalars floats (formulas.hpp): the learning rate, gradient scale
  // and bias corrections read when the update runs, in place of lr, grad_scale and step (the
  // optimizer writes them on the stream before the step: no host value is baked into the launch). A
  // NaN gradient scale (grad_clip of a non-finite gradient) skips the update: nothing is written.
  const float* scalars = nullptr;
};

// The gradient's global norm and clipping scale without the host: norm = sqrt of the sum of the
// squares of `grads` (f32 partial sums added in double in order, as sum_squares) into *norm, and
// scalars[kAdamWGradScale] = grad_clip_scale(norm, max_norm). Where ranks share the gradient, the
// sum of squares is theirs instead (`sum_squares`: SumSquaresParts on each, then summed over them).
struct GradClip {
  TensorView grads;                    // [P] f32 or bf16 (the gradient dtype); unused where sum_squares is given
  double max_norm = 0;                 // 0: no clipping (the scale is 1)
  float* scalars = nullptr;            // device: AdamW::scalars
  double* norm = nullptr;              // device
  const float* sum_squares = nullptr;  // device, optional: the squared norm, norm = sqrt(double(*sum_squares))
};

// One rank's share of the squared norm of a gradient that ranks hold in parts, on the stream (no host
// value; the ranks then all-reduce `out` and GradClip takes it): out = the sum over i of
// sum_squares(parts[i]) / divisors[i] (each part's sum as sum_squares makes it, the quotients added
// in double in order; a divisor of 0 leaves its part out), rounded to f32.
struct SumSquaresParts {
  std::span<const TensorView> parts;  // f32 or bf16 (the gradient dtype), all parts the same
  std::span<const int> divisors;      // one per part, >= 0
  TensorView out;                     // [1] f32
};

class CapturedWork;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual DType act_dtype() const = 0;
  virtual std::string name() const = 0;  // "cpu" or e.g. "cuda:0 NVIDIA H200"
  virtual double peak_bf16_flops() const = 0;  // dense, per second; 0 if unknown

  // ---- memory ----
  virtual Buffer alloc(std::size_t bytes) = 0;
  // Host memory the device copies to and from fastest (pinned on CUDA), for staging.
  virtual Buffer alloc_host(std::size_t bytes) = 0;
  // Copies between any two devices; same dtype and element count.
  virtual void copy(const TensorView& dst, const TensorView& src) = 0;
  // Queues a copy of `src` into host memory from alloc_host on the stream, without waiting: the
  // values are there once synchronize() has returned (a step's reads queued behind its work, read
  // after its one synchronisation). By default a copy.
  virtual void copy_to_host_async(const TensorView& host_dst, const TensorView& src) { copy(host_dst, src); }
  // Converts between f32 and act, or f32 and bf16 (bf16 rounding is round-to-nearest-even); same
  // element count.
  virtual void convert(const TensorView& dst, const TensorView& src) = 0;
  // convert, queued on `stream` (a cudaStream_t of this backend's device) instead of the compute
  // stream, for a module that orders it with its own work there (FSDP casting a unit's weights
  // before its all-gather on the communication stream). Backends without streams convert at once.
  virtual void convert_on(void* stream, const TensorView& dst, const TensorView& src) {
    (void)stream;
    convert(dst, src);
  }
  // Copies between device memory and host memory from alloc_host (either way), queued on `stream` (a
  // cudaStream_t of this backend's device) without waiting, for a module that orders it with its own
  // events (the activation_offload module moving a block's saved activations beside the compute).
  // Backends without streams copy at once.
  virtual void copy_on(void* stream, const TensorView& dst, const TensorView& src) {
    (void)stream;
    copy(dst, src);
  }
  virtual void zero(const TensorView& t) = 0;
  // Zeroes contiguous f32 or bf16 tensors (a gradient buffer's pieces each step): as one launch where
  // the backend can (the CUDA backend: one kernel over a table it keeps while the pieces stay the same).
  virtual void zero_many(std::span<const TensorView> ts);
  virtual void grad_clip(const GradClip& a) = 0;
  virtual void sum_squares_parts(const SumSquaresParts& a) = 0;
  virtual void synchronize() = 0;
  // Sum of squares of an f32 or bf16 tensor (a gradient; of its elements' f32 values, the same
  // arithmetic for both), in double on the host (synchronises).
  virtual double sum_squares(const TensorView& x) = 0;
  // The same for several tensors (each f32 or bf16) at once, with one synchronisation; out[i] equals
  // sum_squares(xs[i]) bit for bit. (The optimizer's per-parameter sums under tensor parallelism.)
  virtual std::vector<double> sum_squares_each(std::span<const TensorView> xs) = 0;
  // Writes standard normals * std (or a constant, if std == 0 and `constant` is used) into an f32
  // view that is elements [global_offset, global_offset + numel) of a logical tensor.
  virtual void init_normal(const TensorView& dst, float std, rng::PhiloxArgs rng, std::int64_t global_offset) = 0;
  virtual void fill(const TensorView& dst, float value) = 0;
  // dst += src, elementwise over two tensors of the same element count, both f32 or both bf16 (the
  // gradient dtype: the sum in f32, rounded once) (partial gradients added into an accumulated one).
  virtual void add(const TensorView& dst, const TensorView& src) = 0;

  // ---- ops ----
  virtual void embedding_forward(const EmbeddingForward& a) = 0;
  virtual void embedding_backward(const EmbeddingBackward& a) = 0;
  virtual void layernorm_forward(const LayerNormForward& a) = 0;
  virtual void layernorm_backward(const LayerNormBackward& a) = 0;
  virtual void linear_forward(const LinearForward& a) = 0;
  virtual void linear_backward(const LinearBackward& a) = 0;
  virtual void gelu_forward(const GeluForward& a) = 0;
  virtual void gelu_backward(const GeluBackward& a) = 0;
  virtual void rmsnorm_forward(const RmsNormForward& a) = 0;
  virtual void rmsnorm_backward(const RmsNormBackward& a) = 0;
  virtual void rope(const Rope& a) = 0;
  virtual void swiglu_forward(const SwigluForward& a) = 0;
  virtual void swiglu_backward(const SwigluBackward& a) = 0;
  virtual void attention_forward(const AttentionForward& a) = 0;
  virtual void attention_backward(const AttentionBackward& a) = 0;
  virtual void attention_decode(const AttentionDecode& a) = 0;
  virtual void residual_forward(const ResidualForward& a) = 0;
  virtual void dropout_backward(const DropoutBackward& a) = 0;
  virtual void cross_entropy(const CrossEntropy& a) = 0;
  virtual void cross_entropy_stats(const CrossEntropyStats& a) = 0;
  virtual void cross_entropy_finish(const CrossEntropyFinish& a) = 0;
  virtual void adamw(const AdamW& a) = 0;
  // Mixture of experts (moe.hpp).
  virtual void moe_route(const MoeRoute& a) = 0;
  virtual void moe_route_backward(const MoeRouteBackward& a) = 0;
  virtual void moe_permute(const MoePermute& a) = 0;
  virtual void moe_permute_backward(const MoePermuteBackward& a) = 0;
  virtual void moe_combine(const MoeCombine& a) = 0;
  virtual void moe_combine_backward(const MoeCombineBackward& a) = 0;
  virtual void grouped_linear_forward(const GroupedLinearForward& a) = 0;
  virtual void grouped_linear_backward(const GroupedLinearBackward& a) = 0;
  virtual void moe_dropout(const MoeDropout& a) = 0;

  // ---- profiling (CUDA events around each op when enabled) ----
  struct OpTime {
    std::string op;
    double ms = 0;
    std::int64_t calls = 0;
  };
  virtual void set_profiling(bool on) = 0;
  // Times work a module queues itself on the compute stream (e.g. the fp8 module's kernels) under
  // `op`, a string that outlives the backend; it then appears in op_times(). begin_op returns the
  // token for end_op (-1 when not profiling).
  virtual int begin_op(const char* op) = 0;
  virtual void end_op(int token) = 0;
  // Accumulated times since the last reset, largest first (synchronises).
  virtual std::vector<OpTime> op_times() = 0;
  virtual void reset_op_times() = 0;
  // The CUDA stream of the compute work (cudaStream_t), or nullptr on CPU.
  virtual void* stream() const = 0;
  // The linear ops' GEMMs from now on leave `sms` streaming multiprocessors to kernels of other
  // streams (communication overlapped with them: parallel/comm_overlap); 0, all of them again. A
  // hint: backends without such a knob ignore it.
  virtual void set_gemm_sm_margin(int sms) { (void)sms; }
  // Capture: the device work queued between begin_capture and end_capture is recorded instead of run
  // (a CUDA graph) and runs on each CapturedWork::launch, in stream order with the work around it.
  // Nothing captured may wait for the device or allocate. Backends that cannot capture say so.
  virtual bool can_capture() const { return false; }
  virtual void begin_capture();
  virtual std::unique_ptr<CapturedWork> end_capture();
  // Device memory this backend's process has taken since the backend was made (bytes); 0 on CPU.
  virtual std::size_t device_memory_in_use() const = 0;
};

// Device work recorded by Backend::end_capture.
class CapturedWork {
 public:
  virtual ~CapturedWork() = default;
  virtual void launch() = 0;
};

struct CpuOptions {
  bool round_bf16 = false;  // emulate the CUDA backend's bf16 storage rounding
  int threads = 0;          // 0: all hardware threads
};
std::unique_ptr<Backend> make_cpu_backend(const CpuOptions& options = {});

// Whether this build has CUDA and a GPU is visible.
bool cuda_available();
// Which kernels run causal attention on CUDA: kiln's own flash kernels, or cuDNN's fused flash
// attention (its runtime-fusion SDPA graphs, libcudnn.so.9 opened at run time). cuDNN draws no
// dropout masks from kiln's Philox streams, so attention with dropout always runs kiln's kernels.
// auto_: cuDNN where it loads and accepts the shape, else kiln's kernels.
enum class AttentionImpl { auto_, kiln, cudnn };
BOOST_DESCRIBE_ENUM(AttentionImpl, auto_, kiln, cudnn)
// How the CUDA backend runs a mixture of experts' grouped linears (ops::GroupedLinearForward/Backward):
// per_expert, one cuBLASLt matmul per expert that has rows (over four streams); grouped, the data
// GEMMs as one call of cuBLAS's grouped batched GEMM (cublasGemmGroupedBatchedEx; weight gradients
// per expert either way: it cannot write f32). Measured on an H200 at moe-1b's shapes: ~700 TFLOP/s
// per expert, 310 grouped.
enum class GroupedGemmImpl { per_expert, grouped };
BOOST_DESCRIBE_ENUM(GroupedGemmImpl, per_expert, grouped)

struct CudaOptions {
  bool gemm_autotune = false;  // time cuBLASLt's candidate algorithms per GEMM shape (see GemmRunner)
  bool gemm_autotune_any_order = false;  // ... and keep the fastest even where it sums in another order
  AttentionImpl attention = AttentionImpl::auto_;
  // cuDNN attention: true keeps results bitwise reproducible (the backward writes dQ from one
  // product per tile instead of accumulating it with atomics); false takes cuDNN's fastest graph.
  bool attention_deterministic = true;
  GroupedGemmImpl grouped_gemm = GroupedGemmImpl::per_expert;
  // The experts' GEMMs: algorithms tuned among the bit-identical candidates (kiln::cuda::LtRaggedAlgos).
  bool grouped_gemm_tune = true;
};
// The CUDA backend on device `device_index` (throws if unavailable).
std::unique_ptr<Backend> make_cuda_backend(int device_index = 0, const CudaOptions& options = {});

}  // namespace kiln::ops
