#pragma once
// Fp8Ops that time every operation through the compute backend's profiler (backend.profile = true),
// so the per-op breakdown of an FP8 step lists the quantisations, the three kinds of FP8 GEMM and
// the scaling kernels next to the backend's own ops.
#include <memory>

#include "kiln/fp8/ops.hpp"
#include "kiln/ops/backend.hpp"

namespace kiln::fp8 {

std::unique_ptr<Fp8Ops> make_profiled_ops(std::unique_ptr<Fp8Ops> inner, ops::Backend& backend);

}  // namespace kiln::fp8
