#pragma once
// The arguments of every op of ops::Backend, described once (the contracts of backend.hpp) and
// checked by both backends with their own ArgTarget: the CPU reference (host tensors, act = f32)
// and CUDA (device tensors, act = bf16, dimensions that fit the kernels' 32-bit ints). Each check
// returns the dimensions the backend's loops or kernels then take.
//
// Values that need the data itself (token ids, targets) are checked where the data is read, with
// check_tokens / check_targets.
#include <cstdint>
#include <vector>

#include "kiln/ops/arg_check.hpp"
#include "kiln/ops/backend.hpp"

namespace kiln::ops {

struct EmbeddingDims {
  std::int64_t N, C, V, Tmax;
  std::int64_t vocab_total;  // the whole table's rows (vocab_total, or V)
};
EmbeddingDims check_args(const EmbeddingForward& a, const ArgTarget& on);
EmbeddingDims check_args(const EmbeddingBackward& a, const ArgTarget& on);

// The [N, C] row ops: LayerNorm, residual, dropout.
struct RowDims {
  std::int64_t N, C;
};
RowDims check_args(const LayerNormForward& a, const ArgTarget& on);
RowDims check_args(const LayerNormBackward& a, const ArgTarget& on);
RowDims check_args(const ResidualForward& a, const ArgTarget& on);
RowDims check_args(const DropoutBackward& a, const ArgTarget& on);
RowDims check_args(const RmsNormForward& a, const ArgTarget& on);
RowDims check_args(const RmsNormBackward& a, const ArgTarget& on);
// SwiGLU: N and F (the output's columns; C = F).
RowDims check_args(const SwigluForward& a, const ArgTarget& on);
RowDims check_args(const SwigluBackward& a, const ArgTarget& on);

struct RopeDims {
  std::int64_t B, T, heads, D;
};
RopeDims check_args(const Rope& a, const ArgTarget& on);

struct LinearDims {
  std::int64_t N, IC, OC;
  TensorView x, dout;  // the plain operands (dout: backward only)
};
LinearDims check_args(const LinearForward& a, const ArgTarget& on);
LinearDims check_args(const LinearBackward& a, const ArgTarget& on);

// Returns the element count.
std::int64_t check_args(const GeluForward& a, const ArgTarget& on);
std::int64_t check_args(const GeluBackward& a, const ArgTarget& on);

struct AttentionDims {
  std::int64_t B, T, H, D;
  std::int64_t heads_total;  // heads_total, or H
  std::int64_t K;            // key/value heads: kv_heads, or H
};
AttentionDims check_args(const AttentionForward& a, const ArgTarget& on);
AttentionDims check_args(const AttentionBackward& a, const ArgTarget& on);

struct AttentionDecodeDims {
  std::int64_t B, Tmax, H, D, length;
  std::int64_t K;  // key/value heads: kv_heads, or H
};
AttentionDecodeDims check_args(const AttentionDecode& a, const ArgTarget& on);

struct CrossEntropyDims {
  std::int64_t N, V;
  std::int64_t ranks;  // CrossEntropyFinish's all_stats rows; 1 for the others
};
CrossEntropyDims check_args(const CrossEntropy& a, const ArgTarget& on);
CrossEntropyDims check_args(const CrossEntropyStats& a, const ArgTarget& on);
CrossEntropyDims check_args(const CrossEntropyFinish& a, const ArgTarget& on);

// Mixture of experts: tokens, experts, experts per token, channels (0 where no [.., C] tensor is
// given), grouped rows R = N k.
struct MoeDims {
  std::int64_t N, E, k, C, R;
};
MoeDims check_args(const MoeRoute& a, const ArgTarget& on);
MoeDims check_args(const MoeRouteBackward& a, const ArgTarget& on);
MoeDims check_args(const MoePermute& a, const ArgTarget& on);
MoeDims check_args(const MoePermuteBackward& a, const ArgTarget& on);
MoeDims check_args(const MoeCombine& a, const ArgTarget& on);
MoeDims check_args(const MoeCombineBackward& a, const ArgTarget& on);
// Dropout on grouped rows: R, and C = the rows' width F.
MoeDims check_args(const MoeDropout& a, const ArgTarget& on);
// Experts, rows, in and out features; the host offsets checked (0 first, ascending, at most R).
struct GroupedDims {
  std::int64_t E, R, IC, OC;
  TensorView x, dout;  // the plain operands (dout: backward only)
  std::int64_t G;      // row groups (E unless GroupedLinearForward::groups says)
};
GroupedDims check_args(const GroupedLinearForward& a, const ArgTarget& on);
GroupedDims check_args(const GroupedLinearBackward& a, const ArgTarget& on);

// AdamW's P and its segments, sorted by offset and without the empty ones: they tile [0, P).
struct AdamWPlan {
  std::int64_t P;
  std::vector<AdamWSegment> segments;
};
AdamWPlan check_args(const AdamW& a, const ArgTarget& on);

// sum_squares, init_normal, fill: one f32 tensor of any shape (`arg` of `op`); returns its element count.
std::int64_t check_f32_tensor(const char* op, const char* arg, const TensorView& t, const ArgTarget& on);
// sum_squares, grad_clip: one parameter gradient, f32 or bf16, of any shape; returns its element count.
std::int64_t check_grad_tensor(const char* op, const char* arg, const TensorView& t, const ArgTarget& on);
// sum_squares_parts: parts of one gradient, all f32 or all bf16 (each of any shape), one divisor >= 0
// each, out one f32.
void check_args(const SumSquaresParts& a, const ArgTarget& on);
// add: two tensors of the same element count, both f32 or both bf16 (gradients); returns it.
std::int64_t check_add_args(const TensorView& dst, const TensorView& src, const ArgTarget& on);
// zero: a tensor of any dtype and shape.
void check_zero_args(const TensorView& t, const ArgTarget& on);

// Token ids in [0, vocab_total) (n of them, on the host).
void check_tokens(const char* op, const char* arg, const std::int32_t* tokens, std::int64_t n, std::int64_t vocab_total);
// Targets in [0, vocab_real) or -1 (ignored rows), n of them, on the host.
void check_targets(const char* op, const std::int32_t* targets, std::int64_t n, std::int64_t vocab_real);

}  // namespace kiln::ops
