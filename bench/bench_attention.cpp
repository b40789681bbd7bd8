// Times CUDA attention through the backend, with kiln's kernels and with cuDNN's fused flash
// attention (deterministic and atomic-dQ backward): forward and backward at the GPT-2 124M shape
// (B=16, T=1024, H=12, D=64), the 1.3B shape (B=8, T=1024, H=16, D=128), and 124M with dropout
// 0.1 (kiln's kernels only). Causal FLOPs: forward 4*B*H*T*T*D/2, backward 2.5x that. Median of 20 timed calls (CUDA
// events on the backend's stream) after warm-up.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kiln/ops/backend.hpp"
#include "kiln/tensor/bf16.hpp"
#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "bench_timer.hpp"

namespace {

using namespace kiln;

struct Case {
  int B, T, H, D;
  float dropout;
};

Buffer random_bf16(ops::Backend& be, Shape shape, std::uint64_t seed, float std) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist(0.0f, std);
  std::vector<bf16> host(static_cast<std::size_t>(shape.numel()));
  for (auto& x : host) x = bf16(dist(gen));
  Buffer buf = be.alloc(host.size() * sizeof(bf16));
  be.copy(buf.view(DType::bf16, shape), TensorView(host.data(), shape, DType::bf16, Device::cpu));
  return buf;
}

// Median milliseconds of `iters` calls of f, each between two events on `stream`.
template <class F>
double median_ms(cudaStream_t stream, int iters, F&& f) {
  return bench::EventTimer(stream, false, 0, iters).median_ms(f);
}

void run(ops::Backend& be, const Case& c) {
  const Shape s_qkv{c.B, c.T, 3, c.H, c.D}, s_out{c.B, c.T, c.H, c.D}, s_lse{c.B, c.H, c.T};
  Buffer qkv = random_bf16(be, s_qkv, 1, 1.0f), dout = random_bf16(be, s_out, 2, 1.0f);
  Buffer out = be.alloc(s_out.numel() * 2), dqkv = be.alloc(s_qkv.numel() * 2), lse = be.alloc(s_lse.numel() * 4);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  const rng::PhiloxArgs rng{42, 0, nullptr};
  const ops::AttentionForward f{out.view(DType::bf16, s_out), lse.view(DType::f32, s_lse),
                                qkv.view(DType::bf16, s_qkv), scale, c.dropout, rng};
  const ops::AttentionBackward b{dqkv.view(DType::bf16, s_qkv), dout.view(DType::bf16, s_out),
                                 out.view(DType::bf16, s_out),  lse.view(DType::f32, s_lse),
                                 qkv.view(DType::bf16, s_qkv),  scale,
                                 c.dropout,                     rng};
  auto stream = static_cast<cudaStream_t>(be.stream());
  for (int i = 0; i < 3; ++i) {  // warm-up (also sizes the backend's scratch)
    be.attention_forward(f);
    be.attention_backward(b);
  }
  be.synchronize();
  const double fwd = median_ms(stream, 20, [&] { be.attention_forward(f); });
  const double bwd = median_ms(stream, 20, [&] { be.attention_backward(b); });
  const double flops = 4.0 * c.B * c.H * static_cast<double>(c.T) * c.T * c.D / 2;
  std::printf("B=%-3d T=%-5d H=%-3d D=%-4d p=%.1f | %9.3f %9.1f | %9.3f %9.1f\n", c.B, c.T, c.H, c.D, c.dropout, fwd,
              flops / (fwd * 1e-3) / 1e12, bwd, 2.5 * flops / (bwd * 1e-3) / 1e12);
}

}  // namespace

int main() {
  try {
    struct Impl {
      const char* name;
      ops::CudaOptions options;
    };
    const Impl impls[] = {{"kiln", {.attention = ops::AttentionImpl::kiln}},
                          {"cudnn (deterministic)", {.attention = ops::AttentionImpl::cudnn}},
                          {"cudnn (atomic dQ)", {.attention = ops::AttentionImpl::cudnn, .attention_deterministic = false}}};
    for (const Impl& impl : impls) {
      try {
        auto be = ops::make_cuda_backend(0, impl.options);
        std::printf("%s, causal attention, %s (median of 20)\n", be->name().c_str(), impl.name);
        std::printf("%-35s | %9s %9s | %9s %9s\n", "shape", "fwd ms", "TFLOP/s", "bwd ms", "TFLOP/s");
        for (const Case& c : {Case{16, 1024, 12, 64, 0.0f}, Case{8, 1024, 16, 128, 0.0f}, Case{16, 1024, 12, 64, 0.1f}})
          if (c.dropout == 0.0f || impl.options.attention == ops::AttentionImpl::kiln) run(*be, c);
      } catch (const std::exception& e) {
        std::printf("%s: %s\n", impl.name, e.what());
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_attention: %s\n", e.what());
    return 1;
  }
}
