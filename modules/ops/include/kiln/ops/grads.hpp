#pragma once
// Parameter gradients as the ops that read them take them (optim.grads): f32, or bf16 bits
// (Megatron's bf16 grads, FSDP2's reduce_dtype). Every reader (AdamW, the fp8 module's fused
// updates, grad_clip and the sums of squares; CPU and CUDA) takes the gradient as an untyped pointer
// and a dtype, runs its typed body through with_grads, and reads each element as f32 with grad_load:
// bf16 -> f32 is exact, so a bf16 gradient gives the bits an f32 one holding the same values gives.
#include <cstdint>
#include <utility>

#include "kiln/tensor/bf16.hpp"
#include "kiln/tensor/hd.hpp"

namespace kiln::ops {

template <class F>
decltype(auto) with_grads(bool bf16, const void* g, F&& f) {
  if (bf16) return std::forward<F>(f)(static_cast<const std::uint16_t*>(g));
  return std::forward<F>(f)(static_cast<const float*>(g));
}

KILN_HD float grad_load(const float* g, std::int64_t i) { return g[i]; }
KILN_HD float grad_load(const std::uint16_t* g, std::int64_t i) { return bf16_bits_to_float(g[i]); }

}  // namespace kiln::ops
