#pragma once
// AdamW's moments typed as they are held (optim.moments): every AdamW implementation (the ops
// backend's flat update, the fp8 module's fused updates; CPU and CUDA) takes them as untyped
// pointers and a dtype, and runs its typed body through with_moments: float*, or std::uint16_t*
// holding bf16 bits (ops::moment_load / moment_store read and write both).
#include <cstdint>
#include <utility>

namespace kiln::ops {

template <class F>
decltype(auto) with_moments(bool bf16, void* m, void* v, F&& f) {
  if (bf16) return std::forward<F>(f)(static_cast<std::uint16_t*>(m), static_cast<std::uint16_t*>(v));
  return std::forward<F>(f)(static_cast<float*>(m), static_cast<float*>(v));
}

}  // namespace kiln::ops
