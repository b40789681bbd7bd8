#pragma once
// CUDA launchers of the mixture-of-experts kernels (semantics: kiln/ops/moe.hpp, bf16 = act).
// Device pointers, an explicit stream; every launch checked (KILN_CUDA_LAUNCH_CHECK). All of them
// are deterministic: fixed reduction orders, and the only atomics are integer counts in shared
// memory, whose sums do not depend on the order.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

#include "kiln/ops/cuda/launchers.hpp"
#include "kiln/ops/moe.hpp"
#include "kiln/rng/philox.hpp"

namespace kiln::cuda {

// The router's and the permutation's kernels keep one value per expert in shared memory.
constexpr int kMoeMaxExperts = 1024;

// ---- router (moe_route.cu) ----
// Scratch (floats) for moe_route with loss terms: the per-sequence partial sums, the choice
// shares f[s, e] and the sigmoid scores' sums per token. T = tokens per sequence.
std::int64_t moe_route_scratch(int N, int E, int T);
// ops::MoeRoute; loss_terms may be null (then scratch may be too).
void moe_route(float* scores, float* lse, std::int32_t* experts, float* gates, float* loss_terms, float* scratch,
               const bf16* logits, const float* bias, int N, int E, int k, int T, ops::MoeScore score,
               bool normalize, float aux_coeff, float z_coeff, cudaStream_t s);
// Scratch (floats) for moe_route_backward: the choice shares f[s, e].
std::int64_t moe_route_backward_scratch(int N, int E, int T);
void moe_route_backward(bf16* dlogits, float* scratch, const float* dgates, const float* scores, const float* lse,
                        const std::int32_t* experts, const bf16* logits, int N, int E, int k, int T,
                        ops::MoeScore score, bool normalize, float aux_coeff, float z_coeff, cudaStream_t s);

// ---- permutation (moe_permute.cu) ----
// Scratch (4-byte words) for moe_permute: per chunk of choices and per sequence, each expert's
// counts and bases. seq_len: tokens per sequence when capacity > 0 (else unused).
std::int64_t moe_permute_scratch(int N, int k, int E, int seq_len, std::int64_t capacity);
// ops::MoePermute; out (with x) may be null. Choices naming an expert outside [0, E) are dropped
// (the CPU reference refuses them; the kernels never index with them). `indexed`, when given, is
// called once offsets, row_of and source are enqueued, before the rows' gather.
void moe_permute(std::int32_t* offsets, std::int32_t* row_of, std::int32_t* source, bf16* out, const bf16* x,
                 const std::int32_t* experts, std::int32_t* scratch, int N, int k, int E, int C, int seq_len,
                 std::int64_t capacity, std::int64_t token_offset, cudaStream_t s,
                 const std::function<void()>& indexed = {});
// ops::MoePermuteBackward: dx [N, C] from dout [N k, C].
void moe_permute_backward(bf16* dx, const bf16* dout, const std::int32_t* row_of, int N, int k, int C,
                          cudaStream_t s);

// ---- combine (moe_combine.cu) ----
void moe_combine(bf16* out, const bf16* y, const float* gates, const std::int32_t* row_of, int N, int k, int C,
                 cudaStream_t s);
// Scratch (floats) for moe_combine_backward: one mark byte per grouped row.
std::int64_t moe_combine_backward_scratch(int N, int k);
void moe_combine_backward(bf16* dy, float* dgates, float* scratch, const bf16* dout, const bf16* y,
                          const float* gates, const std::int32_t* row_of, int N, int k, int C, cudaStream_t s);

// ---- expert dropout (moe_dropout.cu) ----
// ops::MoeDropout on x [R, F] (rows < `rows` only); cols_total 0 means F.
void moe_dropout(bf16* x, const std::int32_t* ids, std::int64_t rows, int F, float p, rng::PhiloxArgs rng,
                 std::int64_t col_offset, std::int64_t cols_total, cudaStream_t s);

// ---- pointer tables of a grouped GEMM (grouped_gemm_pointers.cu) ----
// Group g multiplies expert expert[g]'s matrix by the rows from row0[g]: its A, B and C pointers are
//   a = a0 + expert[g] * a_stride,  b = b0 + row0[g] * b_stride,  c = c0 + row0[g] * c_stride  (bytes).
// The table travels as the kernel's parameter, so filling the device arrays needs no host staging.
constexpr int kGroupedMaxGroups = 1024;
struct GroupedPointerTable {
  const char* a0;
  const char* b0;
  char* c0;
  std::int64_t a_stride, b_stride, c_stride;
  int groups;
  std::int32_t expert[kGroupedMaxGroups];
  std::int32_t row0[kGroupedMaxGroups];
};
// Writes groups pointers each to a, b and c (device arrays).
void grouped_gemm_pointers(const void** a, const void** b, void** c, const GroupedPointerTable& table,
                           cudaStream_t s);

}  // namespace kiln::cuda
