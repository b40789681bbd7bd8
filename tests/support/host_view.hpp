#pragma once
// A host vector as a tensor view of a given shape, for tests that call ops and layers on the CPU.
#include <cstdint>
#include <vector>

#include "kiln/tensor/tensor.hpp"

namespace kiln::test {

inline TensorView view(std::vector<float>& v, Shape s) { return TensorView(v.data(), s, DType::f32, Device::cpu); }
inline TensorView iview(std::vector<std::int32_t>& v, Shape s) {
  return TensorView(v.data(), s, DType::i32, Device::cpu);
}

}  // namespace kiln::test
