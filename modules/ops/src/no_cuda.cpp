// Built when kiln has no CUDA backend.
#include "kiln/ops/backend.hpp"

namespace kiln::ops {

bool cuda_available() { return false; }

std::unique_ptr<Backend> make_cuda_backend(int, const CudaOptions&) {
  KILN_THROW("this kiln was built without CUDA (nvcc was not found at build time)");
}

}  // namespace kiln::ops
