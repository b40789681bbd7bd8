// The mixture-of-experts ops on CUDA: not written yet (issue 26 builds them next: the router and
// permutation kernels, cuBLAS's grouped GEMM). Until then they refuse, and the model module refuses
// model.moe on the CUDA backend as a config error before any of them could run.
#include "cuda_backend.hpp"

namespace kiln::ops {
namespace cuda_impl {

namespace {
[[noreturn]] void not_yet(const char* op) {
  KILN_THROW(op, ": the mixture-of-experts ops run on the CPU backend only so far");
}
}  // namespace

void CudaBackend::moe_route(const MoeRoute&) { not_yet("moe_route"); }
void CudaBackend::moe_route_backward(const MoeRouteBackward&) { not_yet("moe_route_backward"); }
void CudaBackend::moe_permute(const MoePermute&) { not_yet("moe_permute"); }
void CudaBackend::moe_permute_backward(const MoePermuteBackward&) { not_yet("moe_permute_backward"); }
void CudaBackend::moe_combine(const MoeCombine&) { not_yet("moe_combine"); }
void CudaBackend::moe_combine_backward(const MoeCombineBackward&) { not_yet("moe_combine_backward"); }
void CudaBackend::grouped_linear_forward(const GroupedLinearForward&) { not_yet("grouped_linear_forward"); }
void CudaBackend::grouped_linear_backward(const GroupedLinearBackward&) { not_yet("grouped_linear_backward"); }
void CudaBackend::moe_dropout(const MoeDropout&) { not_yet("moe_dropout"); }

}  // namespace cuda_impl
}  // namespace kiln::ops
