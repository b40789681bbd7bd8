#pragma once
// A parameter gradient as the CPU reference ops add into it: f32, whatever the gradient's dtype.
// The gradient may be held in bf16 (optim.grads = "bf16"); its contract is one rounding per op call
// per element, round_bf16(float(old) + contribution). Staging gives that with the f32 loops
// unchanged: a bf16 gradient is widened into an f32 copy (float(old), exact), the op's f32 code
// adds (or writes) into the copy exactly as it would into an f32 gradient, and finish() rounds each
// element back once. An f32 gradient is used in place (no copy: today's bits).
#include <cstdint>
#include <vector>

#include "kiln/core/error.hpp"
#include "kiln/tensor/bf16.hpp"
#include "kiln/tensor/tensor.hpp"

namespace kiln::ops {

class GradStaging {
 public:
  // `grad`: an f32 or bf16 host tensor, or empty (an optional gradient not given).
  explicit GradStaging(const TensorView& grad) : grad_(grad) {
    if (!grad || grad.dtype == DType::f32) return;
    KILN_CHECK(grad.dtype == DType::bf16 && grad.contiguous(), "gradient staging: a parameter gradient is f32 or bf16, got ",
               grad.str());
    const std::int64_t n = grad.numel();
    wide_.resize(static_cast<std::size_t>(n));
    const auto* g = grad.as<std::uint16_t>();
    for (std::int64_t i = 0; i < n; ++i) wide_[static_cast<std::size_t>(i)] = bf16_bits_to_float(g[i]);
  }
  GradStaging(const GradStaging&) = delete;
  GradStaging& operator=(const GradStaging&) = delete;

  bool staged() const { return grad_ && grad_.dtype == DType::bf16; }
  // Where the op's f32 code reads and adds: the gradient itself (f32), its f32 copy (bf16), or null.
  float* data() { return staged() ? wide_.data() : grad_ ? grad_.as<float>() : nullptr; }
  // The same as an f32 view of the gradient's shape (empty where the gradient is).
  TensorView view() { return grad_ ? TensorView(data(), grad_.shape, DType::f32, grad_.device) : TensorView{}; }
  // Rounds the f32 copy back into a bf16 gradient (once per element); nothing for f32.
  void finish() {
    if (!staged()) return;
    auto* g = grad_.as<std::uint16_t>();
    const std::int64_t n = grad_.numel();
    for (std::int64_t i = 0; i < n; ++i) g[i] = float_to_bf16_bits(wide_[static_cast<std::size_t>(i)]);
  }

 private:
  TensorView grad_;
  std::vector<float> wide_;
};

}  // namespace kiln::ops
