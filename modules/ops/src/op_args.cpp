#include "op_args.hpp"

#include <algorithm>
#include <cstdio>

namespace kiln::ops {

namespace {

constexpr DType f32 = DType::f32, i32 = DType::i32;

// Positions wpe[n % T]: T divides the N tokens and the table holds T rows.
void check_positions(const OpArgs& c, int T, std::int64_t N, std::int64_t Tmax) {
  c.check(T > 0 && N % T == 0 && Tmax >= T, "T = ", T, " must be positive, divide N = ", N,
          " and not exceed the position table's Tmax = ", Tmax);
}

// This table's rows [vocab_begin, vocab_begin + V) inside the whole vocabulary; returns its size.
std::int64_t check_vocab_rows(const OpArgs& c, std::int64_t vocab_begin, std::int64_t vocab_total, std::int64_t V) {
  const std::int64_t total = vocab_total ? vocab_total : V;
  c.check(vocab_begin >= 0 && vocab_begin + V <= total, "rows [", vocab_begin, ", ", vocab_begin + V,
          ") outside a vocabulary of ", total);
  return total;
}

// This rank's heads [head_offset, head_offset + H) of heads_total (0: H); returns the total.
std::int64_t check_heads(const OpArgs& c, int head_offset, int heads_total, std::int64_t H) {
  const std::int64_t total = heads_total ? heads_total : H;
  c.check(head_offset >= 0 && head_offset + H <= total, "heads [", head_offset, ", ", head_offset + H, ") outside ",
          total);
  return total;
}

// A grouped-query attention op's fused QKV `arg`: [B, T, H + 2 kv_heads, D] with H a multiple of
// kv_heads (H bound already, by the output). Returns kv_heads.
std::int64_t check_gqa(OpArgs& c, const char* arg, const TensorView& t, OpArgs::Dim B, OpArgs::Dim T, OpArgs::Dim H,
                       OpArgs::Dim D, int kv_heads) {
  c.check(kv_heads > 0 && c[H] % kv_heads == 0, "kv_heads = ", kv_heads, " must divide the ", c[H], " query heads");
  c.tensor(arg, t, Act, {B, T, c[H] + 2 * kv_heads, D});
  return kv_heads;
}

// The dtype of a call's parameter gradients (optim.grads: f32, or bf16), taken from `first`, the
// first one given (f32 where it is missing: the caller's check refuses or skips it); every other
// gradient of the call must have it. Any other dtype is refused here, by name, rather than as
// "expected f32" (bf16 is as valid).
ArgDType grad_dtype(const OpArgs& c, const char* arg, const TensorView& first) {
  if (!first) return f32;
  if (first.dtype != f32 && first.dtype != DType::bf16)
    KILN_THROW(c.op(), " ", arg, ": expected f32 or bf16 (the gradient dtype), got ", first.str());
  return first.dtype;
}

// A linear operand the backends take: the tensor itself (a prologue is for a LinearImpl that takes
// it, ops::LinearImpl::prologues).
template <class Operand>
TensorView plain_operand(const OpArgs& c, const char* arg, const Operand& operand) {
  const Prologue p = prologue_of(operand);
  c.check(p == Prologue::plain, arg, ": the backend takes the tensor itself, got a ", name_of(p),
          " prologue (for a LinearImpl that takes it)");
  return plain_tensor(operand);
}

}  // namespace

EmbeddingDims check_args(const EmbeddingForward& a, const ArgTarget& on) {
  OpArgs c("embedding_forward", on);
  const auto N = c.dim("N"), C = c.dim("C"), V = c.dim("V"), Tmax = c.dim("Tmax");
  c.tensor("tokens", a.tokens, i32, {N});
  c.tensor("wte", a.wte, Act, {V, C});
  c.tensor("out", a.out, Act, {N, C});
  if (!a.positions) {  // no position table (rotary positions come later): wpe unused, may be empty
    c.check(a.T > 0 && c[N] % a.T == 0, "T = ", a.T, " must be positive and divide N = ", c[N]);
    return {c[N], c[C], c[V], 0, check_vocab_rows(c, a.vocab_begin, a.vocab_total, c[V])};
  }
  c.tensor("wpe", a.wpe, Act, {Tmax, C});
  check_positions(c, a.T, c[N], c[Tmax]);
  return {c[N], c[C], c[V], c[Tmax], check_vocab_rows(c, a.vocab_begin, a.vocab_total, c[V])};
}

EmbeddingDims check_args(const EmbeddingBackward& a, const ArgTarget& on) {
  OpArgs c("embedding_backward", on);
  const auto N = c.dim("N"), C = c.dim("C"), V = c.dim("V"), Tmax = c.dim("Tmax");
  c.tensor("dout", a.dout, Act, {N, C});
  c.tensor("tokens", a.tokens, i32, {N});
  c.check(a.tokens_host != nullptr, "tokens_host: expected the ", c[N], " tokens on the host, got none");
  const ArgDType grad = grad_dtype(c, "dwte", a.dwte);
  c.tensor("dwte", a.dwte, grad, {V, C});
  if (!a.dwpe) {  // no position table
    c.check(a.T > 0 && c[N] % a.T == 0, "T = ", a.T, " must be positive and divide N = ", c[N]);
    return {c[N], c[C], c[V], 0, check_vocab_rows(c, a.vocab_begin, a.vocab_total, c[V])};
  }
  c.tensor("dwpe", a.dwpe, grad, {Tmax, C});
  check_positions(c, a.T, c[N], c[Tmax]);
  return {c[N], c[C], c[V], c[Tmax], check_vocab_rows(c, a.vocab_begin, a.vocab_total, c[V])};
}

RowDims check_args(const LayerNormForward& a, const ArgTarget& on) {
  OpArgs c("layernorm_forward", on);
  const auto N = c.dim("N"), C = c.dim("C");
  c.tensor("x", a.x, Act, {N, C});
  c.tensor("weight", a.weight, Act, {C});
  c.tensor("bias", a.bias, Act, {C});
  c.tensor("out", a.out, Act, {N, C});
  c.tensor("mean", a.mean, f32, {N});
  c.tensor("rstd", a.rstd, f32, {N});
  return {c[N], c[C]};
}

RowDims check_args(const LayerNormBackward& a, const ArgTarget& on) {
  OpArgs c("layernorm_backward", on);
  const auto N = c.dim("N"), C = c.dim("C");
  c.tensor("x", a.x, Act, {N, C});
  c.tensor("weight", a.weight, Act, {C});
  c.tensor("mean", a.mean, f32, {N});
  c.tensor("rstd", a.rstd, f32, {N});
  c.tensor("dout", a.dout, Act, {N, C});
  c.tensor("dx", a.dx, Act, {N, C});
  const ArgDType grad = grad_dtype(c, "dweight", a.dweight);
  c.tensor("dweight", a.dweight, grad, {C});
  c.tensor("dbias", a.dbias, grad, {C});
  return {c[N], c[C]};
}

RowDims check_args(const ResidualForward& a, const ArgTarget& on) {
  OpArgs c("residual_forward", on);
  const auto N = c.dim("N"), C = c.dim("C");
  c.tensor("x", a.x, Act, {N, C});
  c.tensor("residual", a.residual, Act, {N, C});
  c.tensor("out", a.out, Act, {N, C});
  return {c[N], c[C]};
}

RowDims check_args(const DropoutBackward& a, const ArgTarget& on) {
  OpArgs c("dropout_backward", on);
  const auto N = c.dim("N"), C = c.dim("C");
  c.tensor("dout", a.dout, Act, {N, C});
  c.tensor("dx", a.dx, Act, {N, C});
  return {c[N], c[C]};
}

LinearDims check_args(const LinearForward& a, const ArgTarget& on) {
  OpArgs c("linear_forward", on);
  const auto N = c.dim("N"), IC = c.dim("IC"), OC = c.dim("OC");
  const TensorView x = plain_operand(c, "x", a.x);
  c.tensor("x", x, Act, {N, IC});
  c.tensor("weight", a.weight, Act, {OC, IC});
  c.optional("bias", a.bias, Act, {OC});
  c.tensor("out", a.out, Act, {N, OC});
  c.optional("pre_gelu", a.pre_gelu, Act, {N, OC});
  return {c[N], c[IC], c[OC], x, {}};
}

LinearDims check_args(const LinearBackward& a, const ArgTarget& on) {
  OpArgs c("linear_backward", on);
  const auto N = c.dim("N"), IC = c.dim("IC"), OC = c.dim("OC");
  const TensorView x = plain_operand(c, "x", a.x), dout = plain_operand(c, "dout", a.dout);
  c.tensor("x", x, Act, {N, IC});
  c.tensor("weight", a.weight, Act, {OC, IC});
  c.tensor("dout", dout, Act, {N, OC});
  const ArgDType grad = grad_dtype(c, "dweight", a.dweight);
  c.optional("dweight", a.dweight, grad, {OC, IC});
  c.optional("dbias", a.dbias, grad, {OC});
  c.optional("dx", a.dx, Act, {N, IC});
  c.check(a.dweight || a.dx, "asks for nothing: neither dx nor dweight");
  c.check(a.dweight || !a.dbias, "dbias comes with dweight (a call without dweight computes dx alone)");
  c.optional("dx_gelu_pre", a.dx_gelu_pre, Act, {N, IC});
  return {c[N], c[IC], c[OC], x, dout};
}

std::int64_t check_args(const GeluForward& a, const ArgTarget& on) {
  OpArgs c("gelu_forward", on);
  const auto n = c.wide_dim("n");
  c.elements("x", a.x, Act, n);
  c.elements("out", a.out, Act, n);
  return c[n];
}

std::int64_t check_args(const GeluBackward& a, const ArgTarget& on) {
  OpArgs c("gelu_backward", on);
  const auto n = c.wide_dim("n");
  c.elements("x", a.x, Act, n);
  c.elements("dout", a.dout, Act, n);
  c.elements("dx", a.dx, Act, n);
  return c[n];
}

AttentionDims check_args(const AttentionForward& a, const ArgTarget& on) {
  OpArgs c("attention_forward", on);
  const auto B = c.dim("B"), T = c.dim("T"), H = c.dim("H"), D = c.dim("D");
  if (a.kv_heads == 0) c.tensor("qkv", a.qkv, Act, {B, T, 3, H, D});
  c.tensor("out", a.out, Act, {B, T, H, D});
  const std::int64_t K = a.kv_heads == 0 ? c[H] : check_gqa(c, "qkv", a.qkv, B, T, H, D, a.kv_heads);
  c.tensor("lse", a.lse, f32, {B, H, T});
  c.optional("doc_start", a.doc_start, DType::i32, {B, T});
  c.check(a.seq_offset >= 0, "seq_offset = ", a.seq_offset, " must not be negative");
  return {c[B], c[T], c[H], c[D], check_heads(c, a.head_offset, a.heads_total, c[H]), K};
}

AttentionDims check_args(const AttentionBackward& a, const ArgTarget& on) {
  OpArgs c("attention_backward", on);
  const auto B = c.dim("B"), T = c.dim("T"), H = c.dim("H"), D = c.dim("D");
  if (a.kv_heads == 0) c.tensor("qkv", a.qkv, Act, {B, T, 3, H, D});
  c.tensor("out", a.out, Act, {B, T, H, D});
  const std::int64_t K = a.kv_heads == 0 ? c[H] : check_gqa(c, "qkv", a.qkv, B, T, H, D, a.kv_heads);
  c.tensor("lse", a.lse, f32, {B, H, T});
  c.tensor("dout", a.dout, Act, {B, T, H, D});
  if (a.kv_heads == 0) c.tensor("dqkv", a.dqkv, Act, {B, T, 3, H, D});
  else check_gqa(c, "dqkv", a.dqkv, B, T, H, D, a.kv_heads);
  c.optional("doc_start", a.doc_start, DType::i32, {B, T});
  c.check(a.seq_offset >= 0, "seq_offset = ", a.seq_offset, " must not be negative");
  return {c[B], c[T], c[H], c[D], check_heads(c, a.head_offset, a.heads_total, c[H]), K};
}

AttentionDecodeDims check_args(const AttentionDecode& a, const ArgTarget& on) {
  OpArgs c("attention_decode", on);
  const auto B = c.dim("B"), Tmax = c.dim("Tmax"), H = c.dim("H"), D = c.dim("D");
  if (a.kv_heads == 0) c.tensor("qkv", a.qkv, Act, {B, Tmax, 3, H, D});
  c.tensor("out", a.out, Act, {B, H, D});
  const std::int64_t K = a.kv_heads == 0 ? c[H] : check_gqa(c, "qkv", a.qkv, B, Tmax, H, D, a.kv_heads);
  c.check(a.length >= 1 && a.length <= c[Tmax], "length = ", a.length, " must be in [1, Tmax = ", c[Tmax], "]");
  c.check(a.scale > 0 && a.scale < 3.0e38f, "scale must be positive and finite, got ", a.scale);
  return {c[B], c[Tmax], c[H], c[D], a.length, K};
}

RowDims check_args(const RmsNormForward& a, const ArgTarget& on) {
  OpArgs c("rmsnorm_forward", on);
  const auto N = c.dim("N"), C = c.dim("C");
  c.tensor("x", a.x, Act, {N, C});
  c.tensor("weight", a.weight, Act, {C});
  c.tensor("out", a.out, Act, {N, C});
  c.tensor("rstd", a.rstd, f32, {N});
  c.check(a.eps > 0, "eps = ", a.eps, " must be positive");
  return {c[N], c[C]};
}

RowDims check_args(const RmsNormBackward& a, const ArgTarget& on) {
  OpArgs c("rmsnorm_backward", on);
  const auto N = c.dim("N"), C = c.dim("C");
  c.tensor("x", a.x, Act, {N, C});
  c.tensor("weight", a.weight, Act, {C});
  c.tensor("dout", a.dout, Act, {N, C});
  c.tensor("dx", a.dx, Act, {N, C});
  c.tensor("dweight", a.dweight, grad_dtype(c, "dweight", a.dweight), {C});
  c.tensor("rstd", a.rstd, f32, {N});
  return {c[N], c[C]};
}

RopeDims check_args(const Rope& a, const ArgTarget& on) {
  OpArgs c("rope", on);
  const auto B = c.dim("B"), T = c.dim("T"), heads = c.dim("heads"), D = c.dim("D");
  c.tensor("x", a.x, Act, {B, T, heads, D});
  c.check(c[D] % 2 == 0, "the head dimension D = ", c[D], " must be even");
  c.check(a.rotated_heads >= 0 && a.rotated_heads <= c[heads], "rotated_heads = ", a.rotated_heads,
          " must be in [0, ", c[heads], "]");
  c.check(a.theta > 1.0f, "theta = ", a.theta, " must be above 1");
  if (a.scaling.enabled())
    c.check(a.scaling.factor >= 1.0f && a.scaling.low_freq_factor > 0 &&
                a.scaling.high_freq_factor > a.scaling.low_freq_factor && a.scaling.original_max_positions > 0,
            "scaling (factor ", a.scaling.factor, ", low_freq_factor ", a.scaling.low_freq_factor, ", high_freq_factor ",
            a.scaling.high_freq_factor, ", original_max_positions ", a.scaling.original_max_positions,
            ") needs factor >= 1, 0 < low_freq_factor < high_freq_factor and original_max_positions > 0");
  c.check(a.pos_offset >= 0, "pos_offset = ", a.pos_offset, " must not be negative");
  return {c[B], c[T], c[heads], c[D]};
}

RowDims check_args(const SwigluForward& a, const ArgTarget& on) {
  OpArgs c("swiglu_forward", on);
  const auto N = c.dim("N"), F = c.dim("F");
  c.tensor("out", a.out, Act, {N, F});
  c.tensor("x", a.x, Act, {N, 2 * c[F]});
  return {c[N], c[F]};
}

RowDims check_args(const SwigluBackward& a, const ArgTarget& on) {
  OpArgs c("swiglu_backward", on);
  const auto N = c.dim("N"), F = c.dim("F");
  c.tensor("dout", a.dout, Act, {N, F});
  c.tensor("x", a.x, Act, {N, 2 * c[F]});
  c.tensor("dx", a.dx, Act, {N, 2 * c[F]});
  c.check(a.dx.data != a.x.data, "dx must not alias x");
  return {c[N], c[F]};
}

CrossEntropyDims check_args(const CrossEntropy& a, const ArgTarget& on) {
  OpArgs c("cross_entropy", on);
  const auto N = c.dim("N"), V = c.dim("V");
  c.tensor("logits", a.logits, Act, {N, V});
  c.tensor("targets", a.targets, i32, {N});
  c.tensor("losses", a.losses, f32, {N});
  c.check(a.vocab_real > 0 && a.vocab_real <= c[V], "vocab_real ", a.vocab_real, " vs V ", c[V]);
  return {c[N], c[V], 1};
}

CrossEntropyDims check_args(const CrossEntropyStats& a, const ArgTarget& on) {
  OpArgs c("cross_entropy_stats", on);
  const auto N = c.dim("N"), V = c.dim("V");
  c.tensor("logits", a.logits, Act, {N, V});
  c.tensor("targets", a.targets, i32, {N});
  c.tensor("stats", a.stats, f32, {N, 3});
  c.check(a.vocab_begin >= 0 && a.vocab_real > 0, "columns from ", a.vocab_begin, ", vocab_real ", a.vocab_real);
  return {c[N], c[V], 1};
}

CrossEntropyDims check_args(const CrossEntropyFinish& a, const ArgTarget& on) {
  OpArgs c("cross_entropy_finish", on);
  const auto N = c.dim("N"), V = c.dim("V"), R = c.dim("ranks");
  c.tensor("logits", a.logits, Act, {N, V});
  c.tensor("targets", a.targets, i32, {N});
  c.tensor("all_stats", a.all_stats, f32, {R, N, 3});
  c.tensor("losses", a.losses, f32, {N});
  c.optional("lse", a.lse, f32, {N});
  c.check(a.vocab_begin >= 0 && a.vocab_real > 0, "columns from ", a.vocab_begin, ", vocab_real ", a.vocab_real);
  return {c[N], c[V], c[R]};
}

MoeDims check_args(const MoeRoute& a, const ArgTarget& on) {
  OpArgs c("moe_route", on);
  const auto N = c.dim("N"), E = c.dim("E"), k = c.dim("k");
  c.tensor("logits", a.logits, Act, {N, E});
  c.tensor("scores", a.scores, f32, {N, E});
  c.tensor("lse", a.lse, f32, {N});
  c.tensor("experts", a.experts, i32, {N, k});
  c.tensor("gates", a.gates, f32, {N, k});
  c.optional("bias", a.bias, f32, {E});
  c.optional("loss_terms", a.loss_terms, f32, {2});
  c.check(c[k] >= 1 && c[k] <= c[E], "k = ", c[k], " experts per token must be in [1, E = ", c[E], "]");
  c.check(!a.bias || a.score == MoeScore::sigmoid, "a selection bias is for sigmoid scoring");
  c.check(a.seq_len > 0 && c[N] % a.seq_len == 0, "seq_len = ", a.seq_len, " must be positive and divide N = ", c[N]);
  return {c[N], c[E], c[k], 0, c[N] * c[k]};
}

MoeDims check_args(const MoeRouteBackward& a, const ArgTarget& on) {
  OpArgs c("moe_route_backward", on);
  const auto N = c.dim("N"), E = c.dim("E"), k = c.dim("k");
  c.tensor("logits", a.logits, Act, {N, E});
  c.tensor("scores", a.scores, f32, {N, E});
  c.tensor("lse", a.lse, f32, {N});
  c.tensor("experts", a.experts, i32, {N, k});
  c.tensor("dgates", a.dgates, f32, {N, k});
  c.tensor("dlogits", a.dlogits, Act, {N, E});
  c.check(c[k] >= 1 && c[k] <= c[E], "k = ", c[k], " experts per token must be in [1, E = ", c[E], "]");
  c.check(a.seq_len > 0 && c[N] % a.seq_len == 0, "seq_len = ", a.seq_len, " must be positive and divide N = ", c[N]);
  return {c[N], c[E], c[k], 0, c[N] * c[k]};
}

MoeDims check_args(const MoePermute& a, const ArgTarget& on) {
  OpArgs c("moe_permute", on);
  const auto N = c.dim("N"), k = c.dim("k"), E1 = c.dim("E + 1"), R = c.dim("R"), C = c.dim("C");
  c.tensor("experts", a.experts, i32, {N, k});
  c.tensor("offsets", a.offsets, i32, {E1});
  c.tensor("row_of", a.row_of, i32, {N, k});
  c.tensor("source", a.source, i32, {R});
  c.check(c[R] == c[N] * c[k], "source holds ", c[R], " rows, but N k = ", c[N] * c[k]);
  c.check(a.n_experts >= 1 && c[E1] == a.n_experts + 1, "offsets must hold n_experts + 1 = ", a.n_experts + 1,
          " values, got ", c[E1]);
  c.check(a.capacity >= 0, "capacity = ", a.capacity, " must not be negative");
  c.check(a.capacity == 0 || (a.seq_len > 0 && c[N] % a.seq_len == 0), "seq_len = ", a.seq_len,
          " must be positive and divide N = ", c[N], " (a capacity is per sequence)");
  c.check(a.token_offset >= 0 && (a.token_offset + c[N]) * a.n_experts < (std::int64_t{1} << 31), "token_offset = ",
          a.token_offset, ": the (token, expert) ids up to (", a.token_offset + c[N], ") x ", a.n_experts,
          " must fit in 31 bits");
  std::int64_t channels = 0;
  if (c.optional("out", a.out, Act, {R, C})) {
    c.tensor("x", a.x, Act, {N, C});
    channels = c[C];
  }
  return {c[N], a.n_experts, c[k], channels, c[R]};
}

MoeDims check_args(const MoePermuteBackward& a, const ArgTarget& on) {
  OpArgs c("moe_permute_backward", on);
  const auto N = c.dim("N"), k = c.dim("k"), R = c.dim("R"), C = c.dim("C");
  c.tensor("row_of", a.row_of, i32, {N, k});
  c.tensor("dout", a.dout, Act, {R, C});
  c.tensor("dx", a.dx, Act, {N, C});
  c.check(c[R] == c[N] * c[k], "dout holds ", c[R], " rows, but N k = ", c[N] * c[k]);
  return {c[N], 0, c[k], c[C], c[R]};
}

MoeDims check_args(const MoeCombine& a, const ArgTarget& on) {
  OpArgs c("moe_combine", on);
  const auto N = c.dim("N"), k = c.dim("k"), R = c.dim("R"), C = c.dim("C");
  c.tensor("row_of", a.row_of, i32, {N, k});
  c.tensor("gates", a.gates, f32, {N, k});
  c.tensor("y", a.y, Act, {R, C});
  c.tensor("out", a.out, Act, {N, C});
  c.check(c[R] == c[N] * c[k], "y holds ", c[R], " rows, but N k = ", c[N] * c[k]);
  return {c[N], 0, c[k], c[C], c[R]};
}

MoeDims check_args(const MoeCombineBackward& a, const ArgTarget& on) {
  OpArgs c("moe_combine_backward", on);
  const auto N = c.dim("N"), k = c.dim("k"), R = c.dim("R"), C = c.dim("C");
  c.tensor("row_of", a.row_of, i32, {N, k});
  c.tensor("gates", a.gates, f32, {N, k});
  c.tensor("y", a.y, Act, {R, C});
  c.tensor("dout", a.dout, Act, {N, C});
  c.tensor("dy", a.dy, Act, {R, C});
  c.tensor("dgates", a.dgates, f32, {N, k});
  c.check(c[R] == c[N] * c[k], "y holds ", c[R], " rows, but N k = ", c[N] * c[k]);
  return {c[N], 0, c[k], c[C], c[R]};
}

namespace {
// Expert e's rows [offsets[e], offsets[e + 1]): 0 first, ascending, at most R.
void check_offsets(const OpArgs& c, const std::int32_t* offsets, std::int64_t E, std::int64_t R) {
  c.check(offsets != nullptr, "offsets_host: expected the ", E + 1, " expert offsets on the host, got none");
  c.check(offsets[0] == 0, "offsets_host[0] = ", offsets[0], " must be 0");
  for (std::int64_t e = 0; e < E; ++e)
    c.check(offsets[e] <= offsets[e + 1], "offsets_host must ascend: [", e, "] = ", offsets[e], " > [", e + 1, "] = ",
            offsets[e + 1]);
  c.check(offsets[E] <= R, "offsets_host[E] = ", offsets[E], " exceeds the ", R, " rows");
}
// The row groups (GroupedLinearForward::groups) of a grouped linear with E experts, each group's
// expert one of them: how many groups.
std::int64_t check_groups(const OpArgs& c, int groups, const std::int32_t* expert_of, std::int64_t E) {
  if (groups == 0) {
    c.check(expert_of == nullptr, "expert_of without groups");
    return E;
  }
  c.check(groups > 0 && expert_of != nullptr, "groups = ", groups, " needs expert_of, one expert a group");
  for (int g = 0; g < groups; ++g)
    c.check(expert_of[g] >= 0 && expert_of[g] < E, "expert_of[", g, "] = ", expert_of[g], " outside the ", E,
            " experts");
  return groups;
}
}  // namespace

namespace {
// A grouped linear's weight: [E, OC, IC], or [E, IC, OC] stored input-major.
void grouped_weight(OpArgs& c, const char* arg, const TensorView& w, ArgDType dtype, bool in_out, OpArgs::Dim E,
                    OpArgs::Dim IC, OpArgs::Dim OC) {
  if (in_out)
    c.tensor(arg, w, dtype, {E, IC, OC});
  else
    c.tensor(arg, w, dtype, {E, OC, IC});
}
}  // namespace

GroupedDims check_args(const GroupedLinearForward& a, const ArgTarget& on) {
  OpArgs c("grouped_linear_forward", on);
  const auto E = c.dim("E"), R = c.dim("R"), IC = c.dim("IC"), OC = c.dim("OC");
  const TensorView x = plain_operand(c, "x", a.x);
  c.tensor("x", x, Act, {R, IC});
  c.tensor("out", a.out, Act, {R, OC});
  grouped_weight(c, "weight", a.weight, Act, a.weight_in_out, E, IC, OC);
  const std::int64_t G = check_groups(c, a.groups, a.expert_of, c[E]);
  check_offsets(c, a.offsets_host, G, c[R]);
  return {c[E], c[R], c[IC], c[OC], x, {}, G};
}

GroupedDims check_args(const GroupedLinearBackward& a, const ArgTarget& on) {
  OpArgs c("grouped_linear_backward", on);
  const auto E = c.dim("E"), R = c.dim("R"), IC = c.dim("IC"), OC = c.dim("OC");
  const TensorView x = plain_operand(c, "x", a.x), dout = plain_operand(c, "dout", a.dout);
  c.tensor("x", x, Act, {R, IC});
  c.tensor("dout", dout, Act, {R, OC});
  grouped_weight(c, "weight", a.weight, Act, a.weight_in_out, E, IC, OC);
  c.check(a.dweight.dtype != DType::bf16, "dweight: a bf16 gradient (optim.grads = \"bf16\") is not supported by the grouped (mixture-of-experts) linears yet");
  grouped_weight(c, "dweight", a.dweight, f32, a.weight_in_out, E, IC, OC);
  c.optional("dx", a.dx, Act, {R, IC});
  if (c.optional("dx_gelu_pre", a.dx_gelu_pre, Act, {R, IC}))
    c.check(static_cast<bool>(a.dx), "dx_gelu_pre without dx: the GELU's derivative applies to dx");
  const std::int64_t G = check_groups(c, a.groups, a.expert_of, c[E]);
  check_offsets(c, a.offsets_host, G, c[R]);
  return {c[E], c[R], c[IC], c[OC], x, dout, G};
}

MoeDims check_args(const MoeDropout& a, const ArgTarget& on) {
  OpArgs c("moe_dropout", on);
  const auto R = c.dim("R"), F = c.dim("F");
  c.tensor("x", a.x, Act, {R, F});
  c.tensor("ids", a.ids, i32, {R});
  c.check(a.p > 0 && a.p < 1, "p = ", a.p, " must be in (0, 1) (no op to run otherwise)");
  c.check(a.rows >= 0 && a.rows <= c[R], "rows = ", a.rows, " outside [0, ", c[R], "]");
  const std::int64_t cols = a.cols_total > 0 ? a.cols_total : c[F];
  c.check(a.col_offset >= 0 && a.col_offset + c[F] <= cols, "columns [", a.col_offset, ", ", a.col_offset + c[F],
          ") outside cols_total = ", cols);
  return {0, 0, 0, c[F], c[R]};
}


AdamWPlan check_args(const AdamW& a, const ArgTarget& on) {
  OpArgs c("adamw", on);
  const auto P = c.wide_dim("P");
  c.tensor("params", a.params, f32, {P});
  c.tensor("grads", a.grads, grad_dtype(c, "grads", a.grads), {P});
  const ArgDType moments = a.m.dtype == DType::bf16 ? DType::bf16 : f32;  // f32 or bf16, both alike
  c.tensor("m", a.m, moments, {P});
  c.tensor("v", a.v, moments, {P});
  const auto A = c.wide_dim("A");
  const bool act = c.optional("params_act", a.params_act, Act, {A});
  // The segments must tile [0, P) exactly (in any order; empty ones aside).
  AdamWPlan plan{c[P], {}};
  for (const AdamWSegment& s : a.segments) {
    c.check(s.count >= 0, "a segment at ", s.offset, " has a negative count ", s.count);
    const std::int64_t at = s.act == AdamWSegment::kActAtOffset ? s.offset : s.act;
    c.check(!act || !s.update || s.count == 0 || s.act == AdamWSegment::kNoAct || (at >= 0 && at + s.count <= c[A]),
            "a segment's act copy [", at, ", ", at + s.count, ") outside params_act's ", act ? c[A] : 0, " elements");
    if (s.count > 0) plan.segments.push_back(s);
  }
  std::sort(plan.segments.begin(), plan.segments.end(), [](auto& x, auto& y) { return x.offset < y.offset; });
  std::int64_t covered = 0;
  for (const AdamWSegment& s : plan.segments) {
    c.check(s.offset == covered, "segments must tile [0, ", plan.P, "): a segment starts at ", s.offset, " where ",
            covered, " was expected");
    covered += s.count;
  }
  c.check(covered == plan.P, "segments cover ", covered, " of ", plan.P, " elements");
  return plan;
}

std::int64_t check_f32_tensor(const char* op, const char* arg, const TensorView& t, const ArgTarget& on) {
  OpArgs c(op, on);
  const auto n = c.wide_dim("n");
  c.elements(arg, t, f32, n);
  return c[n];
}

std::int64_t check_grad_tensor(const char* op, const char* arg, const TensorView& t, const ArgTarget& on) {
  OpArgs c(op, on);
  const auto n = c.wide_dim("n");
  c.elements(arg, t, grad_dtype(c, arg, t), n);
  return c[n];
}

void check_args(const SumSquaresParts& a, const ArgTarget& on) {
  OpArgs c("sum_squares_parts", on);
  c.check(a.parts.size() == a.divisors.size(), a.parts.size(), " parts but ", a.divisors.size(), " divisors");
  for (std::size_t i = 0; i < a.parts.size(); ++i) {
    char part[32];  // named without an allocation: the check runs every optimizer step
    std::snprintf(part, sizeof part, "parts[%zu]", i);
    check_grad_tensor("sum_squares_parts", part, a.parts[i], on);
    // One gradient, one dtype: a mix means a part was taken from some other buffer.
    c.check(a.parts[i].dtype == a.parts[0].dtype, part, " is ", name_of(a.parts[i].dtype), " but parts[0] is ",
            name_of(a.parts[0].dtype), " (the parts of one gradient share its dtype)");
    c.check(a.divisors[i] >= 0, "divisors[", i, "] = ", a.divisors[i], " (>= 0 expected)");
  }
  c.tensor("out", a.out, f32, {1});
}

std::int64_t check_add_args(const TensorView& dst, const TensorView& src, const ArgTarget& on) {
  OpArgs c("add", on);
  const auto n = c.wide_dim("n");
  const ArgDType grad = grad_dtype(c, "dst", dst);  // partial gradients: f32 + f32, or bf16 + bf16
  c.elements("dst", dst, grad, n);
  c.elements("src", src, grad, n);
  return c[n];
}

void check_zero_args(const TensorView& t, const ArgTarget& on) {
  OpArgs c("zero", on);
  c.elements("t", t, ArgDType::any(), c.wide_dim("n"));
}

void check_tokens(const char* op, const char* arg, const std::int32_t* tokens, std::int64_t n, std::int64_t vocab_total) {
  for (std::int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab_total)
      KILN_THROW(op, " ", arg, ": token ", tokens[i], " at position ", i, " outside the vocabulary of ", vocab_total);
}

void check_targets(const char* op, const std::int32_t* targets, std::int64_t n, std::int64_t vocab_real) {
  for (std::int64_t i = 0; i < n; ++i)
    if (targets[i] < -1 || targets[i] >= vocab_real)
      KILN_THROW(op, " targets: target ", targets[i], " at row ", i, " outside [0, ", vocab_real,
                 ") (or -1, an ignored row)");
}

}  // namespace kiln::ops
