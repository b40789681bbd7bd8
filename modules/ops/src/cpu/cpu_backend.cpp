#include "cpu_backend.hpp"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "kiln/ops/grads.hpp"

namespace kiln::ops {

std::unique_ptr<Backend> make_cpu_backend(const CpuOptions& options) {
  return std::make_unique<cpu::CpuBackend>(options);
}

namespace cpu {

CpuBackend::CpuBackend(const CpuOptions& o)
    : round_(o.round_bf16),
      threads_(o.threads > 0 ? o.threads : std::max(1u, std::thread::hardware_concurrency())) {}

namespace {
void check_cpu(const TensorView& t, const char* what) {
  if (t.device != Device::cpu) KILN_THROW(what, ": expected a CPU tensor, got ", t.str());
}
}  // namespace

void CpuBackend::copy(const TensorView& dst, const TensorView& src) {
  check_cpu(dst, "copy dst");
  check_cpu(src, "copy src");
  KILN_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel(), "copy ", src.str(), " -> ", dst.str());
  std::memmove(dst.data, src.data, src.bytes());
}

void CpuBackend::convert(const TensorView& dst, const TensorView& src) {
  check_cpu(dst, "convert dst");
  check_cpu(src, "convert src");
  KILN_CHECK(dst.numel() == src.numel() && dst.contiguous() && src.contiguous(), "convert ", src.str(), " -> ",
             dst.str());
  const std::int64_t n = src.numel();
  if (dst.dtype == DType::f32 && src.dtype == DType::f32) {  // to act: rounded as the CUDA backend stores it
    const float* s = src.as<float>();
    float* d = dst.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t i = 0; i < n; ++i) d[i] = store(s[i]);
  } else if (dst.dtype == DType::bf16 && src.dtype == DType::f32) {
    const float* s = src.as<float>();
    auto* d = dst.as<std::uint16_t>();
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t i = 0; i < n; ++i) d[i] = float_to_bf16_bits(s[i]);
  } else if (dst.dtype == DType::f32 && src.dtype == DType::bf16) {
    const auto* s = src.as<std::uint16_t>();
    float* d = dst.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t i = 0; i < n; ++i) d[i] = bf16_bits_to_float(s[i]);
  } else {
    KILN_THROW("the CPU backend converts f32 to f32 (act) and between f32 and bf16, not ", src.str(), " -> ",
               dst.str());
  }
}

void CpuBackend::add(const TensorView& dst, const TensorView& src) {
  const std::int64_t n = check_add_args(dst, src, kTarget);
  if (dst.dtype == DType::bf16) {  // bf16 gradients: the sum in f32, rounded once
    const auto* s = src.as<std::uint16_t>();
    auto* d = dst.as<std::uint16_t>();
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t i = 0; i < n; ++i) d[i] = float_to_bf16_bits(bf16_bits_to_float(d[i]) + bf16_bits_to_float(s[i]));
    return;
  }
  const float* s = src.as<float>();
  float* d = dst.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t i = 0; i < n; ++i) d[i] += s[i];
}

void CpuBackend::zero(const TensorView& t) {
  check_zero_args(t, kTarget);
  std::memset(t.data, 0, t.bytes());
}

double CpuBackend::sum_squares(const TensorView& x) {
  const std::int64_t n = check_grad_tensor("sum_squares", "x", x, kTarget);
  // Fixed chunking keeps the result independent of the thread count.
  constexpr std::int64_t kChunk = 1 << 14;
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(static_cast<std::size_t>(chunks), 0.0);
  // f32 or bf16 (a gradient): the same sums of the elements' f32 values.
  with_grads(x.dtype == DType::bf16, x.data, [&](auto* p) {
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t c = 0; c < chunks; ++c) {
      double s = 0;
      for (std::int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) {
        const float v = grad_load(p, i);
        s += double(v) * v;
      }
      partial[c] = s;
    }
  });
  double total = 0;
  for (double s : partial) total += s;
  return total;
}

std::vector<double> CpuBackend::sum_squares_each(std::span<const TensorView> xs) {
  std::vector<double> out;
  out.reserve(xs.size());
  for (const TensorView& x : xs) out.push_back(sum_squares(x));
  return out;
}

void CpuBackend::init_normal(const TensorView& dst, float std, rng::PhiloxArgs r, std::int64_t global_offset) {
  const std::int64_t n = check_f32_tensor("init_normal", "dst", dst, kTarget);
  float* d = dst.as<float>();
  const std::uint64_t start = r.start();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t i = 0; i < n; ++i)
    d[i] = rng::mul_rn(std, rng::philox_normal(r.seed, start, static_cast<std::uint64_t>(global_offset + i)));
}

void CpuBackend::fill(const TensorView& dst, float value) {
  std::fill_n(dst.as<float>(), check_f32_tensor("fill", "dst", dst, kTarget), value);
}

int CpuBackend::begin_op(const char* op) {
  if (!profiling_) return -1;
  open_.push_back({op, std::chrono::steady_clock::now()});
  return static_cast<int>(open_.size()) - 1;
}

void CpuBackend::end_op(int token) {
  if (token < 0 || token >= static_cast<int>(open_.size())) return;
  const Open o = open_[static_cast<std::size_t>(token)];
  auto& t = times_[o.op];
  t.op = o.op;
  t.ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - o.t0).count();
  ++t.calls;
  if (token == static_cast<int>(open_.size()) - 1) open_.pop_back();  // ops nest: the last begun ends first
}

std::vector<Backend::OpTime> CpuBackend::op_times() {
  std::vector<OpTime> out;
  for (auto& [_, t] : times_) out.push_back(t);
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.ms > b.ms; });
  return out;
}

}  // namespace cpu
}  // namespace kiln::ops
