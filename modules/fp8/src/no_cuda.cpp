#include "kiln/core/error.hpp"
#include "kiln/fp8/ops.hpp"

namespace kiln::fp8 {

std::unique_ptr<Fp8Ops> make_cuda_ops(void*, const CudaOpsOptions&) { KILN_THROW("FP8 on CUDA: this kiln was built without CUDA"); }

}  // namespace kiln::fp8
