#pragma once
// An FP8 tensor: non-owning views of its data plus the scaling factors it was quantised with.
// Hopper's FP8 GEMMs take both operands with the reduction dimension K contiguous ("TN"), so a
// tensor used on both sides of a product needs two copies: `rowwise` [rows, cols] as it is, and
// `colwise` [cols, rows], its transpose. Either may be absent when no GEMM needs it.
#include <cstdint>

#include "kiln/fp8/format.hpp"
#include "kiln/tensor/tensor.hpp"

namespace kiln::fp8 {

// How scale / scale_inv are laid out. Only per_tensor exists today; block scaling (one factor per
// 1x128 or 128x128 block, cuBLASLt's VEC128_32F / BLK128x128_32F modes) is the planned third recipe
// and will make scale_inv an array indexed by block.
enum class ScalingMode : std::uint8_t { per_tensor, block_1x128, block_128x128 };

struct Fp8TensorView {
  TensorView rowwise;   // [rows, cols] e4m3/e5m2, or empty
  TensorView colwise;   // [cols, rows] e4m3/e5m2 (the transpose), or empty
  Format format = Format::e4m3;
  ScalingMode mode = ScalingMode::per_tensor;
  float* scale = nullptr;      // quantised with: q = encode(x * scale)
  float* scale_inv = nullptr;  // 1 / scale: x ~ decode(q) * scale_inv (the GEMM's operand scale)

  std::int64_t rows() const { return rowwise ? rowwise.size(0) : colwise.size(1); }
  std::int64_t cols() const { return rowwise ? rowwise.size(1) : colwise.size(0); }
};

}  // namespace kiln::fp8
