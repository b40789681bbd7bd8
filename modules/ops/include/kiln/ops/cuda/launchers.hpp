#pragma once
// CUDA launchers of kiln's kernels: host functions taking device pointers and an explicit stream.
// They are the CUDA backend's building blocks and can be called directly by other programs.
// Every launcher checks its launch (KILN_CUDA_LAUNCH_CHECK) and throws kiln::Error on failure.
// Semantics are those of the matching op in kiln/ops/backend.hpp; bf16 = __nv_bfloat16.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kiln/ops/backend.hpp"
#include "kiln/rng/philox.hpp"

namespace kiln::cuda {

using bf16 = __nv_bfloat16;

// ---- elementwise and utility ----
void convert_f32_to_bf16(bf16* dst, const float* src, std::int64_t n, cudaStream_t s);
void convert_bf16_to_f32(float* dst, const bf16* src, std::int64_t n, cudaStream_t s);
void fill_f32(float* dst, float value, std::int64_t n, cudaStream_t s);
void add_f32(float* dst, const float* src, std::int64_t n, cudaStream_t s);  // dst += src
// dst = round(float(dst) + float(src)): bf16 gradients, one rounding per element.
void add_bf16(bf16* dst, const bf16* src, std::int64_t n, cudaStream_t s);
// out[i] = gelu(x[i]) (tanh approximation, ops::gelu); out may alias x.
void gelu_forward(bf16* out, const bf16* x, std::int64_t n, cudaStream_t s);
// dx[i] = dout[i] * gelu'(x[i]) (ops::gelu_grad); dx may alias dout.
void gelu_backward(bf16* dx, const bf16* dout, const bf16* x, std::int64_t n, cudaStream_t s);
// dst[i] = std * philox_normal(rng.seed, rng.start(), global_offset + i), bit-identical to the CPU.
void init_normal_f32(float* dst, std::int64_t n, float std, rng::PhiloxArgs rng, std::int64_t global_offset,
                     cudaStream_t s);
// Per-block partial sums of squares (fixed blocking, deterministic) into `partials`, which must hold
// sum_squares_partials(n) floats; the caller adds them up.
std::int64_t sum_squares_partials(std::int64_t n);
void sum_squares_f32(float* partials, const float* x, std::int64_t n, cudaStream_t s);
// The same of a bf16 gradient (bf16 bits): the partials sum_squares_f32 writes for an f32 tensor of
// the same values (each element converted to f32 exactly, then the same arithmetic).
void sum_squares_bf16(float* partials, const std::uint16_t* x, std::int64_t n, cudaStream_t s);
// sum_squares_f32 (or _bf16, where bf16) of many tensors in one launch: segment i's partials (the
// same values) at [first, first + sum_squares_partials(n)) of `partials`; segments in ascending
// `first`, none empty; total_blocks = the last one's end.
struct SumSquaresSegment {
  const void* x = nullptr;  // float, or bf16 bits where bf16
  std::int64_t n = 0, first = 0;
  bool bf16 = false;
  bool operator==(const SumSquaresSegment&) const = default;
};
void sum_squares_many(float* partials, const SumSquaresSegment* segs, int n_segs, std::int64_t total_blocks,
                      cudaStream_t s);
// ops::GradClip on the device: the `count` partials of sum_squares_f32 added in double in order (as
// the host adds them), *norm = their square root, scalars[kAdamWGradScale] = grad_clip_scale.
void grad_clip_finish(const float* partials, std::int64_t count, double max_norm, float* scalars, double* norm,
                      cudaStream_t s);
// The same from a squared norm the ranks have summed (ops::GradClip::sum_squares): *norm =
// sqrt(double(*sum_squares)).
void grad_clip_from_sum(const float* sum_squares, double max_norm, float* scalars, double* norm, cudaStream_t s);
// ops::SumSquaresParts on the device: part i's sum_squares_f32 partials, [first, end) of `partials`,
// added in double in order and divided by its divisor (0: left out), the quotients added in order and
// the total rounded to f32 into *out: the host's arithmetic, in its order.
struct SumSquaresPart {
  std::int64_t first = 0, end = 0;
  std::int32_t divisor = 1;
  bool operator==(const SumSquaresPart&) const = default;
};
// `quotients`: scratch of n_parts doubles.
void sum_squares_parts_finish(const float* partials, const SumSquaresPart* parts, int n_parts, double* quotients,
                              float* out, cudaStream_t s);

// ---- embedding ----
// wte holds rows [vocab_begin, vocab_begin + V) of the table; other tokens contribute zero.
// positions: add wpe[n % T].
void embedding_forward(bf16* out, const std::int32_t* tokens, const bf16* wte, const bf16* wpe, int N, int T, int C,
                       std::int64_t vocab_begin, int V, bool positions, cudaStream_t s);
// The token buckets of embedding_backward, made on the device (no host copy of the tokens: a CUDA
// graph can replay it): `order` [N] the positions whose token lies in [vocab_begin, vocab_begin + V),
// stable-sorted by token (a radix sort), then the others; run u of `order` holds bucket_token[u]'s
// positions (a row of the table, token - vocab_begin, or V for the others) and ends at bucket_end[u];
// *runs counts the runs. Each array holds N entries. Scratch: embedding_buckets_scratch(N, V) bytes.
std::size_t embedding_buckets_scratch(int N, int V);
void embedding_buckets(std::int32_t* order, std::int32_t* bucket_end, std::int32_t* bucket_token, int* runs,
                       const std::int32_t* tokens, std::int64_t vocab_begin, int V, int N, void* scratch,
                       std::size_t scratch_bytes, cudaStream_t s);
// Deterministic (the buckets of embedding_buckets): dwte row t gets the rows of dout at its token's
// positions added in position order, dwpe[t] those of position t of every sequence in order.
void embedding_backward(float* dwte, float* dwpe, const bf16* dout, const std::int32_t* order,
                        const std::int32_t* bucket_end, const std::int32_t* bucket_token, const int* runs, int V,
                        int N, int T, int C, cudaStream_t s);
// The same into bf16 gradients (optim.grads = "bf16"): each element summed in f32 from its old value
// in the same order, then rounded once.
void embedding_backward(bf16* dwte, bf16* dwpe, const bf16* dout, const std::int32_t* order,
                        const std::int32_t* bucket_end, const std::int32_t* bucket_token, const int* runs, int V,
                        int N, int T, int C, cudaStream_t s);

// ---- zeroing many f32 pieces in one launch ----
// A piece: count floats at data; work: where it starts in the launch's work space (the pieces end
// to end, each rounded up to a multiple of 4).
struct ZeroRun {
  float* data = nullptr;
  std::int64_t count = 0, work = 0;
  bool operator==(const ZeroRun&) const = default;
};
// Zeroes every piece of the device table `runs` (n of them, sorted by work; `work` in all).
void zero_many(const ZeroRun* runs, int n, std::int64_t work, cudaStream_t s);

// ---- layernorm ----
void layernorm_forward(bf16* out, float* mean, float* rstd, const bf16* x, const bf16* weight, const bf16* bias, int N,
                       int C, float eps, cudaStream_t s);
// dx is accumulated (bf16). `scratch` holds layernorm_backward_scratch(N, C) floats.
std::int64_t layernorm_backward_scratch(int N, int C);
void layernorm_backward(bf16* dx, float* dweight, float* dbias, float* scratch, const bf16* dout, const bf16* x,
                        const bf16* weight, const float* mean, const float* rstd, int N, int C, cudaStream_t s);
// bf16 dweight and dbias: old + the f32 sum, rounded once.
void layernorm_backward(bf16* dx, bf16* dweight, bf16* dbias, float* scratch, const bf16* dout, const bf16* x,
                        const bf16* weight, const float* mean, const float* rstd, int N, int C, cudaStream_t s);

// ---- Llama's ops: RMSNorm, rotary embeddings, SwiGLU ----
void rmsnorm_forward(bf16* out, float* rstd, const bf16* x, const bf16* weight, int N, int C, float eps, cudaStream_t s);
// dx is accumulated (bf16). `scratch` holds rmsnorm_backward_scratch(N, C) floats.
std::int64_t rmsnorm_backward_scratch(int N, int C);
void rmsnorm_backward(bf16* dx, float* dweight, float* scratch, const bf16* dout, const bf16* x, const bf16* weight,
                      const float* rstd, int N, int C, cudaStream_t s);
void rmsnorm_backward(bf16* dx, bf16* dweight, float* scratch, const bf16* dout, const bf16* x, const bf16* weight,
                      const float* rstd, int N, int C, cudaStream_t s);  // bf16 dweight: one rounding
// In place on the first `rotated` heads of x [B, T, heads, D] (ops::Rope).
void rope(bf16* x, int B, int T, int heads, int rotated, int D, float theta, const ops::RopeScaling& scaling,
          std::int64_t pos_offset, bool inverse, cudaStream_t s);
// x [N, 2F] = gate | up; out [N, F]; dx [N, 2F] written.
void swiglu_forward(bf16* out, const bf16* x, std::int64_t N, int F, cudaStream_t s);
void swiglu_backward(bf16* dx, const bf16* dout, const bf16* x, std::int64_t N, int F, cudaStream_t s);

// ---- residual and dropout ----
void residual_forward(bf16* out, const bf16* residual, const bf16* x, int N, int C, const ops::DropoutArgs& d,
                      cudaStream_t s);
void dropout_backward(bf16* dx, const bf16* dout, int N, int C, const ops::DropoutArgs& d, cudaStream_t s);

// ---- linear helpers (the GEMMs themselves go through cuBLASLt, see gemm.hpp) ----
// dbias[o] += sum_n dout[n, o]; `scratch` holds bias_grad_scratch(N, OC) floats; `tickets` holds
// bias_grad_tickets(OC) counters that are zero on entry and left zero (keep one zeroed buffer).
std::int64_t bias_grad_scratch(int N, int OC);
std::int64_t bias_grad_tickets(int OC);
void bias_grad(float* dbias, float* scratch, unsigned* tickets, const bf16* dout, int N, int OC, cudaStream_t s);
// bf16 dbias (optim.grads = "bf16"): old + the f32 column sum, rounded once.
void bias_grad(bf16* dbias, float* scratch, unsigned* tickets, const bf16* dout, int N, int OC, cudaStream_t s);

// ---- attention (flash-style, causal, deterministic backward) ----
// q, k, v interleaved as qkv [B, T, 3, H, D] (kv_heads = 0), or grouped: [B, T, H + 2 kv_heads, D]
// (ops::AttentionForward); out [B, T, H, D]; lse [B, H, T]. D in {16, 32, 64, 128}. doc_start: [B, T]
// i32 on the device, or null (packed documents: query i reads keys [doc_start[b, i], i]).
void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int H, int D, float scale, float dropout,
                       rng::PhiloxArgs rng, int head_offset, int heads_total, std::int64_t seq_offset,
                       cudaStream_t s, int kv_heads = 0, const std::int32_t* doc_start = nullptr);
// `scratch` holds attention_backward_scratch(B, T, H, D, kv_heads) floats, 16-byte aligned.
std::int64_t attention_backward_scratch(int B, int T, int H, int D, int kv_heads = 0);
void attention_backward(bf16* dqkv, float* scratch, const bf16* dout, const bf16* out, const float* lse,
                        const bf16* qkv, int B, int T, int H, int D, float scale, float dropout, rng::PhiloxArgs rng,
                        int head_offset, int heads_total, std::int64_t seq_offset, cudaStream_t s, int kv_heads = 0,
                        const std::int32_t* doc_start = nullptr);

// ---- decode attention (generation with a KV cache; see ops::AttentionDecode) ----
// qkv [B, Tmax, 3, H, D] or [B, Tmax, H + 2 kv_heads, D], the query at row length - 1; out [B, H, D];
// any D <= 256. `scratch` holds attention_decode_scratch(B, H, D, length) floats (0: none needed).
std::int64_t attention_decode_scratch(int B, int H, int D, int length);
void attention_decode(bf16* out, float* scratch, const bf16* qkv, int B, int Tmax, int H, int D, int length,
                      float scale, cudaStream_t s, int kv_heads = 0);

// ---- loss and optimizer ----
// Softmax cross-entropy fused with its backward, one block per row (bench/cross_entropy_variants.cu
// keeps the kernels it was measured against).
void cross_entropy(float* losses, bf16* logits, const std::int32_t* targets, int N, int V, int vocab_real, float dloss,
                   cudaStream_t s);
// Vocabulary-parallel cross-entropy (see ops::CrossEntropyStats / CrossEntropyFinish): logits hold
// columns [begin, begin + V) of the padded vocabulary.
void cross_entropy_stats(float* stats, const bf16* logits, const std::int32_t* targets, int N, int V, int vocab_real,
                         std::int64_t begin, cudaStream_t s);
void cross_entropy_finish(float* losses, float* lse, bf16* logits, const std::int32_t* targets, const float* all_stats,
                          int R, int N, int V, int vocab_real, std::int64_t begin, float dloss, bool write_dlogits,
                          cudaStream_t s);
struct AdamWSegmentDev {
  std::int64_t offset;  // first element in the flat buffers
  std::int64_t count;
  float weight_decay;
  std::int64_t work;    // where the segment starts in the work space: the segments before it, each
                        // rounded up to a multiple of 4
  std::int64_t act;     // where its act copy starts in params_bf16; -1: none
  bool operator==(const AdamWSegmentDev&) const = default;
};
// segments: device array of n_segments entries, sorted by `work`, the elements to update (other
// elements are not touched); `work`: the end of the last one.
// With `scalars` (ops::AdamW::scalars, device) lr, grad_scale, bc1 and bc2 are read from there when
// the kernel runs, and a NaN gradient scale leaves everything as it was. grads: f32, or bf16 bits
// where bf16_grads (ops::grad_load). m and v: f32, or bf16 where bf16_moments (ops::moment_load /
// moment_store).
void adamw(float* params, bf16* params_bf16, const void* grads, bool bf16_grads, void* m, void* v, bool bf16_moments,
           const AdamWSegmentDev* segments, int n_segments, std::int64_t work, float lr, float beta1, float beta2,
           float eps, float grad_scale, float bc1, float bc2, const float* scalars, cudaStream_t s);

}  // namespace kiln::cuda
