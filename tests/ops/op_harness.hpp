#pragma once
// Runs the same op on the CPU reference backend and on the CUDA backend and compares the results.
// The CPU backend rounds its act outputs to bf16 (as the CUDA backend stores them), and every act
// input is rounded to bf16 before either backend sees it, so both start from identical values.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kiln/ops/backend.hpp"
#include "kiln/tensor/bf16.hpp"
#include "kiln_test.hpp"

namespace kiln::test {

struct BackendPair {
  std::unique_ptr<ops::Backend> cpu;
  std::unique_ptr<ops::Backend> gpu;
};

// Returns both backends, or a pair with gpu == nullptr when no GPU is visible.
inline BackendPair backend_pair(const ops::CudaOptions& cuda_options = {}) {
  BackendPair p;
  p.cpu = ops::make_cpu_backend({.round_bf16 = true});
  if (ops::cuda_available()) p.gpu = ops::make_cuda_backend(0, cuda_options);
  return p;
}

#define KILN_REQUIRE_GPU(pair)                                      \
  do {                                                              \
    if (!(pair).gpu) KILN_SKIP_TEST("no CUDA device is visible");   \
  } while (0)

// Fresh random values: never zeros. Seeded per call site so failures reproduce.
inline std::vector<float> random_values(std::size_t n, std::uint64_t seed, float scale = 1.0f, float shift = 0.0f) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = shift + scale * dist(gen);
  return v;
}

inline std::vector<std::int32_t> random_ints(std::size_t n, std::uint64_t seed, int lo, int hi) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> dist(lo, hi - 1);
  std::vector<std::int32_t> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// One logical tensor held by both backends. kind: act (bf16 on GPU, f32 on CPU), f32, i32, or bf16
// (bf16 on both: AdamW's moments under optim.moments = "bf16").
enum class Kind { act, f32, i32, bf16 };

class Dual {
 public:
  Dual(BackendPair& p, Kind kind, Shape shape) : pair_(p), kind_(kind), shape_(shape) {
    const std::size_t n = static_cast<std::size_t>(shape.numel());
    cpu_buf_ = Buffer(Device::cpu, n * 4);
    gpu_dtype_ = kind == Kind::act || kind == Kind::bf16 ? DType::bf16 : (kind == Kind::f32 ? DType::f32 : DType::i32);
    cpu_dtype_ = kind == Kind::i32 ? DType::i32 : (kind == Kind::bf16 ? DType::bf16 : DType::f32);
    if (p.gpu) gpu_buf_ = p.gpu->alloc(n * size_of(gpu_dtype_));
  }
  TensorView cpu() const { return cpu_buf_.view(cpu_dtype_, shape_); }
  TensorView gpu() const { return gpu_buf_.view(gpu_dtype_, shape_); }
  std::int64_t numel() const { return shape_.numel(); }

  // Sets the values (act tensors are rounded to bf16 first) on both backends.
  void set(std::vector<float> v) {
    REQUIRE(static_cast<std::int64_t>(v.size()) == numel());
    if (kind_ == Kind::act || kind_ == Kind::bf16)
      for (auto& x : v) x = round_bf16(x);
    if (kind_ == Kind::bf16) {
      auto* bits = static_cast<std::uint16_t*>(cpu().data);
      for (std::size_t i = 0; i < v.size(); ++i) bits[i] = float_to_bf16_bits(v[i]);
    } else {
      std::copy(v.begin(), v.end(), cpu().as<float>());
    }
    if (!pair_.gpu) return;
    if (kind_ == Kind::act || kind_ == Kind::bf16) {
      std::vector<bf16> h(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) h[i] = bf16(v[i]);
      pair_.gpu->copy(gpu(), TensorView(h.data(), shape_, DType::bf16, Device::cpu));
    } else {
      pair_.gpu->copy(gpu(), TensorView(v.data(), shape_, DType::f32, Device::cpu));
    }
    pair_.gpu->synchronize();
  }
  void set_ints(const std::vector<std::int32_t>& v) {
    REQUIRE(kind_ == Kind::i32);
    std::copy(v.begin(), v.end(), cpu().as<std::int32_t>());
    if (pair_.gpu) {
      pair_.gpu->copy(gpu(), TensorView(const_cast<std::int32_t*>(v.data()), shape_, DType::i32, Device::cpu));
      pair_.gpu->synchronize();
    }
  }
  std::vector<float> cpu_values() const {
    if (kind_ == Kind::bf16) {
      const auto* bits = static_cast<const std::uint16_t*>(cpu().data);
      std::vector<float> out(static_cast<std::size_t>(numel()));
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = bf16_bits_to_float(bits[i]);
      return out;
    }
    const float* p = cpu().as<float>();
    return std::vector<float>(p, p + numel());
  }
  std::vector<float> gpu_values() const {
    std::vector<float> out(static_cast<std::size_t>(numel()));
    if (kind_ == Kind::act || kind_ == Kind::bf16) {
      std::vector<bf16> h(out.size());
      pair_.gpu->copy(TensorView(h.data(), shape_, DType::bf16, Device::cpu), gpu());
      for (std::size_t i = 0; i < h.size(); ++i) out[i] = static_cast<float>(h[i]);
    } else {
      pair_.gpu->copy(TensorView(out.data(), shape_, DType::f32, Device::cpu), gpu());
    }
    return out;
  }
  // Fills both sides with a poison value so unwritten outputs show up.
  void poison() { set(std::vector<float>(static_cast<std::size_t>(numel()), 1234.5f)); }

 private:
  BackendPair& pair_;
  Kind kind_;
  Shape shape_;
  DType gpu_dtype_, cpu_dtype_;
  Buffer cpu_buf_, gpu_buf_;
};

// CHECKs that the GPU values of `t` match its CPU values within `tol` relative L2 error.
#define KILN_CHECK_CLOSE(dual, tol)                                                   \
  do {                                                                                \
    double err_ = ::kiln::test::rel_error((dual).gpu_values(), (dual).cpu_values());  \
    INFO(#dual " relative error " << err_);                                           \
    CHECK(err_ < (tol));                                                              \
  } while (0)

// ---- running an op on both backends ----

// One side of the pair: picks the backend and the matching view of each Dual.
struct Side {
  BackendPair& pair;
  bool gpu;
  ops::Backend& b() const { return gpu ? *pair.gpu : *pair.cpu; }
  TensorView operator()(const Dual& d) const { return gpu ? d.gpu() : d.cpu(); }
};

// Runs f on the CPU side, then on the GPU side, and waits for the GPU.
inline void on_both(BackendPair& p, const std::function<void(const Side&)>& f) {
  f(Side{p, false});
  f(Side{p, true});
  p.gpu->synchronize();
}

inline Dual act(BackendPair& p, Shape s, std::uint64_t seed, float scale = 1.0f, float shift = 0.0f) {
  Dual d(p, Kind::act, s);
  d.set(random_values(static_cast<std::size_t>(s.numel()), seed, scale, shift));
  return d;
}
inline Dual f32(BackendPair& p, Shape s, std::uint64_t seed, float scale = 1.0f, float shift = 0.0f) {
  Dual d(p, Kind::f32, s);
  d.set(random_values(static_cast<std::size_t>(s.numel()), seed, scale, shift));
  return d;
}
inline Dual poisoned(BackendPair& p, Kind k, Shape s) {
  Dual d(p, k, s);
  d.poison();
  return d;
}

// The pair with attention through cuDNN; without its gpu backend (the test then skips) where no GPU
// is visible or libcudnn.so.9 does not open. Any other cuDNN failure fails the test.
inline BackendPair cudnn_pair(bool deterministic = true) {
  auto p = backend_pair({.attention = ops::AttentionImpl::cudnn, .attention_deterministic = deterministic});
  if (!p.gpu) return p;
  auto qkv = act(p, {1, 8, 3, 1, 64}, 1);
  auto out = poisoned(p, Kind::act, {1, 8, 1, 64});
  auto lse = poisoned(p, Kind::f32, {1, 1, 8});
  try {
    p.gpu->attention_forward({out.gpu(), lse.gpu(), qkv.gpu(), 0.125f});
    p.gpu->synchronize();
  } catch (const kiln::Error& e) {
    const std::string what = e.what();
    if (what.find("libcudnn.so.9") == std::string::npos && what.find("without cuDNN") == std::string::npos) throw;
    MESSAGE("cuDNN attention not available here: " << what);
    p.gpu.reset();
  }
  return p;
}

}  // namespace kiln::test
