// The mixture-of-experts ops on CUDA (kiln/ops/moe.hpp): the router, permutation, combine and
// dropout kernels (kiln/ops/cuda/moe.hpp) and the experts' grouped linears (grouped_gemm.hpp).
#include "cuda_backend.hpp"
#include "grouped_gemm.hpp"
#include "kiln/ops/cuda/moe.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::ops {
namespace cuda_impl {

using cuda::bf16;

namespace {
template <class T>
T* dptr_or_null(const TensorView& t) {
  return t ? static_cast<T*>(t.data) : nullptr;
}
}  // namespace

cuda::GroupedGemm& CudaBackend::grouped_gemm() {
  if (grouped_) return *grouped_;
  // A cuBLAS handle belongs to the device current when it is made: this backend's, whatever the
  // calling thread has selected since.
  int current = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&current));
  KILN_CUDA_CHECK(cudaSetDevice(device_));
  try {
    grouped_ = std::make_unique<cuda::GroupedGemm>(stream_, lt_, workspace_.data(), workspace_.bytes(), grouped_call_,
                                                   grouped_tune_);
  } catch (...) {
    cudaSetDevice(current);
    throw;
  }
  KILN_CUDA_CHECK(cudaSetDevice(current));
  return *grouped_;
}

void CudaBackend::moe_route(const MoeRoute& a) {
  Timer t(*this, "moe_route");
  const MoeDims d = check_args(a, kTarget);
  const int N = i32(d.N), E = i32(d.E), k = i32(d.k);
  float* scratch = a.loss_terms ? scratch_floats(cuda::moe_route_scratch(N, E, a.seq_len)) : nullptr;
  cuda::moe_route(dptr<float>(a.scores), dptr<float>(a.lse), dptr<std::int32_t>(a.experts), dptr<float>(a.gates),
                  dptr_or_null<float>(a.loss_terms), scratch, dptr<bf16>(a.logits), dptr_or_null<float>(a.bias), N, E,
                  k, a.seq_len, a.score, a.normalize, a.aux_coeff, a.z_coeff, stream_);
}

void CudaBackend::moe_route_backward(const MoeRouteBackward& a) {
  Timer t(*this, "moe_route_backward");
  const MoeDims d = check_args(a, kTarget);
  const int N = i32(d.N), E = i32(d.E), k = i32(d.k);
  float* scratch = scratch_floats(cuda::moe_route_backward_scratch(N, E, a.seq_len));
  cuda::moe_route_backward(dptr<bf16>(a.dlogits), scratch, dptr<float>(a.dgates), dptr<float>(a.scores),
                           dptr<float>(a.lse), dptr<std::int32_t>(a.experts), dptr<bf16>(a.logits), N, E, k,
                           a.seq_len, a.score, a.normalize, a.aux_coeff, a.z_coeff, stream_);
}

void CudaBackend::moe_permute(const MoePermute& a) {
  Timer t(*this, "moe_permute");
  const MoeDims d = check_args(a, kTarget);
  const int N = i32(d.N), E = i32(d.E), k = i32(d.k), C = i32(d.C);
  auto* scratch =
      reinterpret_cast<std::int32_t*>(scratch_floats(cuda::moe_permute_scratch(N, k, E, a.seq_len, a.capacity)));
  // The offsets to the host through pinned memory as soon as the scan wrote them; the host waits for
  // that copy alone while the gather runs.
  std::function<void()> indexed;
  if (a.offsets_host)
    indexed = [&] { offsets_readback_.copy(a.offsets.data, static_cast<std::size_t>(E + 1) * sizeof(std::int32_t), stream_); };
  cuda::moe_permute(dptr<std::int32_t>(a.offsets), dptr<std::int32_t>(a.row_of), dptr<std::int32_t>(a.source),
                    dptr_or_null<bf16>(a.out), a.out ? dptr<bf16>(a.x) : nullptr, dptr<std::int32_t>(a.experts),
                    scratch, N, k, E, C, a.seq_len, a.capacity, a.token_offset, stream_, indexed);
  if (a.offsets_host) offsets_readback_.read(a.offsets_host);
}

void CudaBackend::moe_permute_backward(const MoePermuteBackward& a) {
  Timer t(*this, "moe_permute_backward");
  const MoeDims d = check_args(a, kTarget);
  cuda::moe_permute_backward(dptr<bf16>(a.dx), dptr<bf16>(a.dout), dptr<std::int32_t>(a.row_of), i32(d.N), i32(d.k),
                             i32(d.C), stream_);
}

void CudaBackend::moe_combine(const MoeCombine& a) {
  Timer t(*this, "moe_combine");
  const MoeDims d = check_args(a, kTarget);
  cuda::moe_combine(dptr<bf16>(a.out), dptr<bf16>(a.y), dptr<float>(a.gates), dptr<std::int32_t>(a.row_of), i32(d.N),
                    i32(d.k), i32(d.C), stream_);
}

void CudaBackend::moe_combine_backward(const MoeCombineBackward& a) {
  Timer t(*this, "moe_combine_backward");
  const MoeDims d = check_args(a, kTarget);
  const int N = i32(d.N), k = i32(d.k);
  float* scratch = scratch_floats(cuda::moe_combine_backward_scratch(N, k));
  cuda::moe_combine_backward(dptr<bf16>(a.dy), dptr<float>(a.dgates), scratch, dptr<bf16>(a.dout), dptr<bf16>(a.y),
                             dptr<float>(a.gates), dptr<std::int32_t>(a.row_of), N, k, i32(d.C), stream_);
}

// out rows of expert e = x rows @ W_e^T ([E, OC, IC]) or x rows @ W_e ([E, IC, OC]). Named
// "..._per_expert" in the op table where the data GEMMs cannot run as one grouped call.
void CudaBackend::grouped_linear_forward(const GroupedLinearForward& a) {
  const GroupedDims d = check_args(a, kTarget);
  const int G = i32(d.G), IC = i32(d.IC), OC = i32(d.OC);
  cuda::GroupedGemm& gg = grouped_gemm();
  bf16* out = dptr<bf16>(a.out);
  const bf16 *x = dptr<bf16>(d.x), *w = dptr<bf16>(a.weight);
  Timer t(*this, gg.one_call(out, x, w, G, IC, OC) ? "grouped_linear_forward" : "grouped_linear_forward_per_expert");
  gg.rows_times_weight(out, x, w, a.offsets_host, G, /*K=*/IC, /*N=*/OC, /*w_nk=*/!a.weight_in_out, a.expert_of);
}

// dx rows = dout rows @ W_e ([E, OC, IC]) or dout rows @ W_e^T ([E, IC, OC]), zero from offsets[E]
// on, times gelu'(pre) with dx_gelu_pre; dW_e = (or +=) dout^T x ([E, OC, IC]) or x^T dout.
void CudaBackend::grouped_linear_backward(const GroupedLinearBackward& a) {
  const GroupedDims d = check_args(a, kTarget);
  const int E = i32(d.E), G = i32(d.G), IC = i32(d.IC), OC = i32(d.OC);
  const std::int64_t R = d.R, used = a.offsets_host[G];
  cuda::GroupedGemm& gg = grouped_gemm();
  bf16* dx = dptr_or_null<bf16>(a.dx);
  const bf16 *dout = dptr<bf16>(d.dout), *x = dptr<bf16>(d.x), *w = dptr<bf16>(a.weight);
  const bool one = !dx || gg.one_call(dx, dout, w, G, OC, IC);
  Timer t(*this, one ? "grouped_linear_backward" : "grouped_linear_backward_per_expert");
  if (dx) {
    gg.rows_times_weight(dx, dout, w, a.offsets_host, G, /*K=*/OC, /*N=*/IC, /*w_nk=*/a.weight_in_out, a.expert_of);
    if (used < R)
      KILN_CUDA_CHECK(cudaMemsetAsync(dx + used * IC, 0, static_cast<std::size_t>((R - used) * IC) * sizeof(bf16),
                                      stream_));
    if (a.dx_gelu_pre) cuda::gelu_backward(dx, dx, dptr<bf16>(a.dx_gelu_pre), used * IC, stream_);
  }
  if (a.dgrad_queued) a.dgrad_queued();
  float* dw = dptr<float>(a.dweight);
  if (a.weight_in_out)
    gg.weight_grad(dw, x, dout, a.offsets_host, G, E, /*P=*/IC, /*Q=*/OC, a.dweight_overwrite, a.expert_of);
  else
    gg.weight_grad(dw, dout, x, a.offsets_host, G, E, /*P=*/OC, /*Q=*/IC, a.dweight_overwrite, a.expert_of);
}

void CudaBackend::moe_dropout(const MoeDropout& a) {
  Timer t(*this, "moe_dropout");
  const MoeDims d = check_args(a, kTarget);
  cuda::moe_dropout(dptr<bf16>(a.x), dptr<std::int32_t>(a.ids), a.rows, i32(d.C), a.p, a.rng, a.col_offset,
                    a.cols_total, stream_);
}

}  // namespace cuda_impl
}  // namespace kiln::ops
