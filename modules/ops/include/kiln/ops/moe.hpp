#pragma once
// The ops of a mixture-of-experts MLP (backend.hpp's conventions hold: "act" is the backend's
// activation dtype, parameter gradients f32 and accumulated unless said otherwise). N tokens, E
// experts, k experts per token, R = N k grouped rows in expert order (the experts' inputs, one
// expert after the other), C channels.
//
//   route       the router's logits -> each token's k experts and their gates
//   permute     the tokens' rows grouped by expert (a stable counting sort of the N k choices)
//   grouped     one linear per expert over its rows (the experts' FC1 and FC2)
//   combine     each token's output: its experts' rows weighted by its gates
//   dropout     dropout on grouped rows, each row's mask a function of the choice it came from
// and the backward of each. All deterministic: ties, sums and orders are fixed, so a CUDA kernel
// matches the CPU reference and reruns match bit for bit.
#include <cstdint>
#include <functional>
#include <vector>

#include "kiln/ops/prologue.hpp"
#include "kiln/rng/philox.hpp"
#include "kiln/tensor/tensor.hpp"

namespace kiln::ops {

// How the router scores experts: softmax over the experts (Mixtral, Qwen-MoE), or a sigmoid per
// expert with a bias that steers the choice and nothing else (DeepSeek-V3's aux-loss-free balancing).
enum class MoeScore { softmax, sigmoid };

// Each token's k experts, from the router's logits l [N, E] (f32 arithmetic):
//   scores = softmax(l) or sigmoid(l)           (f32)
//   experts = the k largest scores (+ bias[e]: sigmoid only), best first; ties go to the lower expert
//   gates = their scores, divided by the scores' sum with `normalize`
// and lse[t] = log sum_e exp(l[t, e]) (the z-loss's). With `loss_terms`: [0] = the load-balancing loss
// and [1] = the z-loss of these tokens (MoeRouteBackward's formulas, with its coefficients), written.
struct MoeRoute {
  TensorView scores;      // [N, E] f32 (written)
  TensorView lse;         // [N] f32 (written)
  TensorView experts;     // [N, k] i32 (written)
  TensorView gates;       // [N, k] f32 (written)
  TensorView logits;      // [N, E] act
  TensorView bias;        // [E] f32, optional (sigmoid scoring only)
  TensorView loss_terms;  // [2] f32, optional (written)
  MoeScore score = MoeScore::softmax;
  bool normalize = true;
  int seq_len = 0;        // tokens per sequence: rows [s T, (s + 1) T) are sequence s (N a multiple)
  float aux_coeff = 0;    // as MoeRouteBackward
  float z_coeff = 0;
};

// The router's backward: dlogits [N, E] (act, written) from the gates' gradient, plus the gradients of
//   the load-balancing loss  aux_coeff * sum over sequences s of E * sum_e f[s, e] * P[s, e]
//     f[s, e] = the share of sequence s's T k choices that chose expert e (a constant; choices a
//     capacity dropped count too: the router chose them),
//     P[s, e] = the mean over its T tokens of p[t, e] (p: the softmax scores; for sigmoid scoring the
//     scores divided by their sum over the experts): Switch Transformer's loss taken per sequence
//     (Megatron-Core's seq_aux_loss), so any split of a batch into whole sequences (ranks,
//     micro-batches) gives the same loss;
//   the z-loss  z_coeff * sum over tokens of lse[t]^2 (ST-MoE's router z-loss).
// The callers fold the means into the coefficients (1 / sequences, 1 / tokens of the global batch).
struct MoeRouteBackward {
  TensorView dlogits;  // [N, E] act (written)
  TensorView dgates;   // [N, k] f32
  TensorView scores;   // [N, E] f32 (forward's)
  TensorView lse;      // [N] f32 (forward's)
  TensorView experts;  // [N, k] i32 (forward's)
  TensorView logits;   // [N, E] act (forward's)
  MoeScore score = MoeScore::softmax;
  bool normalize = true;
  int seq_len = 0;
  float aux_coeff = 0;
  float z_coeff = 0;
};

// The N k choices (choice i = t k + j: token t's j-th expert) grouped by expert, each expert's in
// choice order:
//   offsets [E + 1]: expert e's rows are [offsets[e], offsets[e + 1]) of the R grouped rows
//   row_of [N, k]: the grouped row of choice (t, j), or -1 where the capacity dropped it
//   source [R]: each grouped row's (token, expert) as an id in the step's global batch,
//   (token_offset + t) E + e (rows from offsets[E] on: -1); what expert dropout draws its masks by
//   (MoeDropout::ids: the same whichever rank holds the row, and whatever rank the expert had among
//   the token's choices)
//   out [R, C] (optional): x's rows in grouped order (out[r] = x[t] for the row of token t; rows
//   from offsets[E] on: zero)
// capacity > 0: each expert takes at most `capacity` of each sequence's choices (seq_len tokens),
// the earliest first; the rest are dropped (their gates then count for nothing). 0: dropless.
// Capacity per sequence keeps the drops independent of how a batch is split over ranks.
struct MoePermute {
  TensorView offsets;  // [E + 1] i32 (written)
  TensorView row_of;   // [N, k] i32 (written)
  TensorView source;   // [R] i32 (written)
  TensorView out;      // [R, C] act (written), optional
  TensorView x;        // [N, C] act (with out)
  TensorView experts;  // [N, k] i32
  int n_experts = 0;
  int seq_len = 0;     // tokens per sequence (with a capacity)
  std::int64_t capacity = 0;
  std::int64_t token_offset = 0;  // token 0's index in the step's global batch ((token_offset + N) E < 2^31)
  // Optional, host memory of E + 1 ints: the offsets, there when the call returns (the grouped
  // linears' sizes). The rows' gather may still be running then: a device backend copies the
  // offsets out as soon as they are known, so the host plans the experts' work while it runs.
  std::int32_t* offsets_host = nullptr;
};
// The permutation's backward: dx[t] = sum over j of dout[row_of[t, j]], in j order (dropped
// choices: nothing).
struct MoePermuteBackward {
  TensorView dx;      // [N, C] act (written)
  TensorView dout;    // [R, C] act
  TensorView row_of;  // [N, k] i32
};

// out[t] = sum over j of gates[t, j] * y[row_of[t, j]], in j order (dropped choices add nothing).
struct MoeCombine {
  TensorView out;     // [N, C] act (written)
  TensorView y;       // [R, C] act: the experts' outputs in grouped order
  TensorView gates;   // [N, k] f32
  TensorView row_of;  // [N, k] i32
};
// dy[row_of[t, j]] = gates[t, j] * dout[t] (rows no choice maps to: zero), dgates[t, j] = dout[t] .
// y[row_of[t, j]] (0 for dropped choices).
struct MoeCombineBackward {
  TensorView dy;      // [R, C] act (written)
  TensorView dgates;  // [N, k] f32 (written)
  TensorView dout;    // [N, C] act
  TensorView y;       // [R, C] act
  TensorView gates;   // [N, k] f32
  TensorView row_of;  // [N, k] i32
};

// One linear per expert, without bias, over rows [offsets[e], offsets[e + 1]) for expert e (rows from
// offsets[E] on are left alone):
//   weight [E, OC, IC]:                  out[r] = x[r] @ weight[e]^T   (an FC1: [out, in] per expert)
//   weight [E, IC, OC] (weight_in_out):  out[r] = x[r] @ weight[e]     (an FC2 stored [in, out])
// offsets_host: the same E + 1 offsets on the host (the group sizes a grouped GEMM is launched with).
// Row groups other than one per expert (expert parallelism's received rows: one group per source rank
// and expert, so that each source's rows arrive in one piece): `groups` groups, offsets_host
// [groups + 1], group g's rows through expert expert_of[g] (host memory); groups = 0: one per expert.
struct GroupedLinearForward {
  TensorView out;     // [R, OC] act
  // [R, IC] act; or, for a GroupedLinearImpl that takes it, the GELU or SwiGLU prologue the input is
  // computed from (prologue.hpp: the backends take the tensor itself).
  LinearInput x;
  TensorView weight;  // [E, OC, IC] or [E, IC, OC] act
  const std::int32_t* offsets_host = nullptr;
  bool weight_in_out = false;
  int groups = 0;
  const std::int32_t* expert_of = nullptr;
};
// dx = dout @ weight[e] (weight_in_out: dout @ weight[e]^T), rows from offsets[E] on zero; with
// dx_gelu_pre (x was gelu(pre)) dx = that * gelu'(pre). dweight [E, OC, IC] += dout^T @ x per expert
// (weight_in_out: [E, IC, OC] += x^T @ dout); written with dweight_overwrite. Experts without rows
// get a zero gradient added (or written). dgrad_queued, when given, is called once dx's work is queued
// and before the weight gradient's: what the caller queues on the stream then may read dx and runs
// beside the weight gradient (an implementation that does not call it leaves that to the caller).
struct GroupedLinearBackward {
  TensorView dx;           // [R, IC] act, optional
  TensorView dweight;      // [E, OC, IC] or [E, IC, OC] f32 (a bf16 gradient is refused, not supported yet)
  OutputGrad dout;         // [R, OC] act; or, for a GroupedLinearImpl that takes it, DgeluOnLoad or DswigluOnLoad
  LinearInput x;           // as the forward was given it (GroupedLinearImpl::keeps_input: not read)
  TensorView weight;       // [E, OC, IC] or [E, IC, OC] act
  TensorView dx_gelu_pre;  // [R, IC] act, optional
  const std::int32_t* offsets_host = nullptr;
  bool weight_in_out = false;
  bool dweight_overwrite = false;
  std::function<void()> dgrad_queued;
  int groups = 0;  // as GroupedLinearForward's
  const std::int32_t* expert_of = nullptr;
};

// A grouped linear's row groups (GroupedLinearForward::groups): how many, and the expert of group g.
inline int row_groups(int groups, std::int64_t experts) { return groups > 0 ? groups : static_cast<int>(experts); }
inline int group_expert(const std::int32_t* expert_of, int g) { return expert_of ? expert_of[g] : g; }
// The passes a weight gradient runs in where several row groups share an expert, so that no two
// products adding into one expert's gradient run at once: pass p holds the p-th group with rows of
// each expert, in group order; an expert's first pass writes its gradient (or adds, without
// overwrite), the later ones add. One pass where every expert has one group.
std::vector<std::vector<int>> weight_grad_passes(const std::int32_t* offsets, int groups, const std::int32_t* expert_of);
// The experts of `experts` that none of the groups with rows goes through: they get no product, so
// a weight gradient that is overwritten is written zero for them.
std::vector<int> experts_without_rows(const std::int32_t* offsets, int groups, const std::int32_t* expert_of,
                                      int experts);

// Dropout on the first `rows` grouped rows of x [R, F] (this rank's columns [col_offset, col_offset
// + F) of rows cols_total wide), in place: row r is (token, expert) ids[r] of the step's global batch
// (MoePermute::source), and its element c keeps with the Philox draw at
// ids[r] * cols_total + col_offset + c of `rng` (ops::dropout_keep), scaled by 1 / (1 - p). The
// same on any split of the batch over ranks. Used forward (on the activation) and backward (on its
// gradient) with the same arguments. Rows from `rows` on are left alone.
struct MoeDropout {
  TensorView x;    // [R, F] act, in place
  TensorView ids;  // [R] i32 on the backend's device
  std::int64_t rows = 0;
  float p = 0;
  rng::PhiloxArgs rng;
  std::int64_t col_offset = 0;
  std::int64_t cols_total = 0;  // 0: F
};

}  // namespace kiln::ops
