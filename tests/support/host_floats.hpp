#pragma once
// A tensor of any backend copied to the host as floats: f32 as it is, bf16 widened exactly (a
// gradient buffer under optim.grads = "bf16").
#include <cstdint>
#include <vector>

#include "kiln/core/error.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/tensor/bf16.hpp"

namespace kiln::test {

inline std::vector<float> host_floats(ops::Backend& be, const TensorView& t) {
  const auto n = static_cast<std::size_t>(t.numel());
  std::vector<float> h(n);
  if (t.dtype == DType::f32) {
    be.copy(TensorView(h.data(), t.shape, DType::f32, Device::cpu), t);
    return h;
  }
  KILN_CHECK(t.dtype == DType::bf16, "host_floats: f32 or bf16, not ", t.str());
  std::vector<std::uint16_t> bits(n);
  be.copy(TensorView(bits.data(), t.shape, DType::bf16, Device::cpu), t);
  for (std::size_t i = 0; i < n; ++i) h[i] = bf16_bits_to_float(bits[i]);
  return h;
}

}  // namespace kiln::test
