#pragma once
// A parameter gradient held twice, for the bf16-gradient tests (optim.grads = "bf16"): an f32 copy
// and a bf16 copy of the same random old values, bf16-representable so both start equal. After an
// op has run on each, every bf16 element must be the f32 element rounded once (round_bf16): the
// contract of a bf16 gradient (backend.hpp).
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kiln/tensor/bf16.hpp"
#include "kiln/tensor/tensor.hpp"

namespace kiln::test {

class GradTwin {
 public:
  GradTwin(Shape s, std::uint64_t seed, float scale = 0.5f) : shape_(s) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<float> d(0.0f, scale);
    const auto n = static_cast<std::size_t>(s.numel());
    f32_.resize(n);
    bits_.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      f32_[i] = round_bf16(d(gen));
      bits_[i] = float_to_bf16_bits(f32_[i]);
    }
    old_ = f32_;
  }
  TensorView f32() { return TensorView(f32_.data(), shape_, DType::f32, Device::cpu); }
  TensorView bf16() { return TensorView(bits_.data(), shape_, DType::bf16, Device::cpu); }
  const std::vector<float>& f32_values() const { return f32_; }
  std::vector<float> bf16_values() const {
    std::vector<float> v(bits_.size());
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = bf16_bits_to_float(bits_[i]);
    return v;
  }
  // Every bf16 element is round_bf16 of the f32 one, bit for bit; and the op changed more than
  // `min_changed` of them (the test means something).
  void check_rounded_once(const char* what, double min_changed = 0.5) const {
    std::size_t wrong = 0, first = 0, changed = 0;
    for (std::size_t i = 0; i < bits_.size(); ++i) {
      if (bits_[i] != float_to_bf16_bits(f32_[i]) && wrong++ == 0) first = i;
      if (f32_[i] != old_[i]) ++changed;
    }
    INFO(what << ": " << wrong << " of " << bits_.size() << " elements differ, the first at " << first << " (bf16 "
              << bf16_bits_to_float(bits_[first]) << ", f32 " << f32_[first] << ")");
    CHECK(wrong == 0);
    CHECK(static_cast<double>(changed) > min_changed * static_cast<double>(bits_.size()));
  }

 private:
  Shape shape_;
  std::vector<float> f32_, old_;
  std::vector<std::uint16_t> bits_;
};

}  // namespace kiln::test
