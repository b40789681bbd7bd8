// kiln's own block-scaled FP8 GEMM (kiln/fp8/cuda/block_gemm.hpp) against the CPU emulation at awkward
// shapes: rows, columns and K not multiples of the 128 x 128 x 128 tile, more tiles than SMs (the
// persistent loop), every operand format pair, bf16 with and without a bias, f32 written and f32
// accumulated; and through Fp8GemmRunner with GELU and dGELU epilogues against cuBLASLt's products.
// Every case skips without a Hopper GPU.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cuda_test_util.hpp"
#include "fp8_test_util.hpp"
#include "kiln/fp8/block.hpp"
#include "kiln/fp8/cuda/block_gemm.hpp"
#include "kiln/fp8/ops.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "kiln_test.hpp"

using namespace kiln;
using namespace kiln::fp8;

namespace {

// A product's operands quantised on the CPU, and the CPU emulation's f32 result.
struct Operands {
  std::int64_t m, n, k;
  ScalingMode ym;
  Format fx, fy;
  std::vector<std::uint8_t> xc, yc;
  std::vector<float> xs, ys, want;
  Operands(std::int64_t m_, std::int64_t n_, std::int64_t k_, ScalingMode ym_, Format fx_, Format fy_, std::uint64_t seed,
           Fp8Ops& cpu)
      : m(m_), n(n_), k(k_), ym(ym_), fx(fx_), fy(fy_) {
    const BlockLayout lx{ScalingMode::block_1x128, m, k}, ly{ym, n, k};
    auto xv = test::normal_values(static_cast<std::size_t>(m * k), seed);
    auto yv = test::normal_values(static_cast<std::size_t>(n * k), seed + 1, 0.05f);
    for (std::size_t i = 0; i < xv.size(); i += 89) xv[i] *= 40.0f;  // outliers: blocks of their own scale
    for (std::size_t i = 7; i < yv.size(); i += 131) yv[i] *= 25.0f;
    xc.resize(xv.size());
    yc.resize(yv.size());
    xs.assign(static_cast<std::size_t>(lx.count()), 0.0f);
    ys.assign(static_cast<std::size_t>(ly.count()), 0.0f);
    cpu.quantize_blocks({TensorView(xv.data(), {m, k}, DType::f32, Device::cpu), ScalingMode::block_1x128, false,
                         TensorView(xc.data(), {m, k}, dtype_of(fx), Device::cpu), xs.data()});
    cpu.quantize_blocks({TensorView(yv.data(), {n, k}, DType::f32, Device::cpu), ym, false,
                         TensorView(yc.data(), {n, k}, dtype_of(fy), Device::cpu), ys.data()});
    want.resize(static_cast<std::size_t>(m * n));
    GemmArgs h;
    h.x = TensorView(xc.data(), {m, k}, dtype_of(fx), Device::cpu);
    h.y = TensorView(yc.data(), {n, k}, dtype_of(fy), Device::cpu);
    h.d = TensorView(want.data(), {m, n}, DType::f32, Device::cpu);
    h.x_scale_inv = xs.data();
    h.y_scale_inv = ys.data();
    h.x_mode = ScalingMode::block_1x128;
    h.y_mode = ym;
    h.f32_result = true;
    cpu.gemm(h);
  }
};

// The operands on the device, and GemmArgs for a D of `dt` there.
struct DeviceOperands {
  Buffer x, y, xs, ys, d;
  GemmArgs g;
  DeviceOperands(const Operands& o, DType dt)
      : x(test::to_device(o.xc)), y(test::to_device(o.yc)), xs(test::to_device(o.xs)), ys(test::to_device(o.ys)),
        d(Device::cuda, static_cast<std::size_t>(o.m * o.n) * 4 + 256) {
    g.x = TensorView(x.data(), {o.m, o.k}, dtype_of(o.fx), Device::cuda);
    g.y = TensorView(y.data(), {o.n, o.k}, dtype_of(o.fy), Device::cuda);
    g.d = TensorView(d.data(), {o.m, o.n}, dt, Device::cuda);
    g.x_scale_inv = static_cast<const float*>(xs.data());
    g.y_scale_inv = static_cast<const float*>(ys.data());
    g.x_mode = ScalingMode::block_1x128;
    g.y_mode = o.ym;
    g.f32_result = dt == DType::f32;
  }
  std::vector<float> result() const {
    const auto n = static_cast<std::size_t>(g.d.numel());
    if (g.d.dtype == DType::f32) return test::to_host<float>(d.data(), n);
    const auto b = test::to_host<std::uint16_t>(d.data(), n);
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = bf16_bits_to_float(b[i]);
    return v;
  }
};

// Runs the kernel on dev (D already set: 0x7f bytes, or 1.0 with -7.0 beyond it when accumulated) and
// checks the product against want, that nothing beyond D was written, and that the bits equal first's
// (the first run's, which this one becomes when first is empty).
void run_and_check(fp8::cuda::BlockGemm& kernel, DeviceOperands& dev, bool accumulated, const std::vector<float>& want,
                   std::vector<float>& first) {
  kernel.run(dev.g, nullptr);
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  auto got = dev.result();
  if (accumulated)
    for (auto& v : got) v -= 1.0f;
  const bool f32 = dev.g.d.dtype == DType::f32;
  const double err = test::rel_error(got, want), bound = f32 ? 1e-3 : 5e-3;
  INFO("relative error " << err << " (bound " << bound << ")");
  CHECK(err < bound);
  // Nothing beyond D is written.
  const std::size_t n = want.size(), bytes = n * (f32 ? 4 : 2);
  if (accumulated) {
    const auto t = test::to_host<float>(static_cast<const float*>(dev.d.data()) + n, 16);
    CHECK(std::all_of(t.begin(), t.end(), [](float v) { return v == -7.0f; }));
  } else {
    const auto tail = test::to_host<std::uint8_t>(static_cast<const std::uint8_t*>(dev.d.data()) + bytes, 64);
    CHECK(std::all_of(tail.begin(), tail.end(), [](std::uint8_t v) { return v == 0x7f; }));
  }
  if (first.empty())
    first = got;
  else
    CHECK(test::same_bits(first, got));
}

}  // namespace

TEST_CASE("kiln's block-scaled FP8 GEMM matches the CPU emulation: partial tiles, every format pair, bf16 with a "
          "bias, f32 written and accumulated, more tiles than SMs") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  fp8::cuda::BlockGemm kernel;
  if (!kernel.available()) KILN_SKIP_TEST("kiln's block GEMM needs a Hopper GPU");
  auto cpu = make_cpu_ops({.threads = 2});
  using M = ScalingMode;
  enum Out { bf16, bf16_bias, f32, f32_add };
  struct Case {
    std::int64_t m, n, k;
    M ym;
    Format fx, fy;
    Out out;
  } cases[] = {
      {256, 384, 512, M::block_128x128, Format::e4m3, Format::e4m3, bf16},       // forward
      {200, 272, 384, M::block_128x128, Format::e4m3, Format::e4m3, bf16_bias},  // rows and N not of 128
      {198, 144, 336, M::block_128x128, Format::e4m3, Format::e4m3, bf16},       // M not of 4, K not of 128
      {8, 16, 128, M::block_128x128, Format::e4m3, Format::e4m3, bf16_bias},     // one partial tile
      {512, 768, 1024, M::block_128x128, Format::e5m2, Format::e4m3, bf16},      // data gradient, E5M2
      {384, 256, 512, M::block_1x128, Format::e5m2, Format::e4m3, f32_add},      // weight gradient
      {200, 336, 2000, M::block_1x128, Format::e4m3, Format::e4m3, f32_add},     // long K, partial last block
      {136, 400, 640, M::block_1x128, Format::e4m3, Format::e5m2, f32},          // E5M2 Y, f32 written
      {2048, 2304, 256, M::block_128x128, Format::e4m3, Format::e4m3, bf16},     // 288 tiles: the persistent loop
      {1664, 2176, 384, M::block_1x128, Format::e4m3, Format::e4m3, f32_add},    // 221 tiles, 1x128 Y
  };
  std::uint64_t seed = 900;
  for (const Case& c : cases) {
    INFO(c.m << " x " << c.n << " x " << c.k << (c.ym == M::block_1x128 ? " 1x128 x 1x128 " : " 1x128 x 128x128 ")
              << name_of(c.fx) << " x " << name_of(c.fy) << " output " << static_cast<int>(c.out));
    seed += 2;
    const Operands o(c.m, c.n, c.k, c.ym, c.fx, c.fy, seed, *cpu);
    DeviceOperands dev(o, c.out == f32 || c.out == f32_add ? DType::f32 : DType::bf16);
    REQUIRE(kernel.takes(dev.g));
    std::vector<float> want = o.want, bias_h;
    Buffer bias_d;
    const auto n = want.size();
    if (c.out == bf16_bias) {
      const auto b = test::normal_values(static_cast<std::size_t>(c.n), seed + 7, 0.5f);
      std::vector<std::uint16_t> bits(b.size());
      for (std::size_t i = 0; i < b.size(); ++i) bits[i] = float_to_bf16_bits(b[i]);
      for (std::size_t i = 0; i < n; ++i) want[i] += bf16_bits_to_float(bits[i % static_cast<std::size_t>(c.n)]);
      bias_d = test::to_device(bits);
      dev.g.bias = TensorView(bias_d.data(), {c.n}, DType::bf16, Device::cuda);
      dev.g.epilogue = ops::Epilogue::bias;
    }
    // Accumulated: D starts at 1 (and at a sentinel beyond it, which must stay).
    std::vector<float> start(n + 64, 1.0f);
    for (std::size_t i = n; i < start.size(); ++i) start[i] = -7.0f;
    if (c.out == f32_add) dev.g.accumulate = true;
    // Every tile computes the same sums in the same order: the same bits.
    std::vector<float> first;
    for (auto tile : {fp8::cuda::BlockGemm::Tile::automatic, fp8::cuda::BlockGemm::Tile::m256n128,
                      fp8::cuda::BlockGemm::Tile::m192n128}) {
      INFO("tile " << static_cast<int>(tile));
      kernel.set_tile(tile);
      if (c.out == f32_add)
        KILN_CUDA_CHECK(cudaMemcpy(dev.d.data(), start.data(), start.size() * 4, cudaMemcpyHostToDevice));
      else
        KILN_CUDA_CHECK(cudaMemset(dev.d.data(), 0x7f, dev.d.bytes()));  // beyond D: must stay
      run_and_check(kernel, dev, c.out == f32_add, want, first);
    }
  }
}

TEST_CASE("kiln's block GEMM picks the tile whose rounds of CTAs compute the fewest rows an SM") {
  using T = fp8::cuda::BlockGemm::Tile;
  // The shapes docs/PERF.md measured on 132 SMs, and the tile that ran faster there.
  CHECK(fp8::cuda::BlockGemm::automatic_tile(8192, 6144, 132) == T::m192n128);   // 1.3B qkv forward
  CHECK(fp8::cuda::BlockGemm::automatic_tile(8192, 16384, 132) == T::m192n128);  // Llama 1B fc1 forward
  // fc2 forward, the data gradients and 1.3B's fc1 weight gradient: all D [8192, 2048].
  CHECK(fp8::cuda::BlockGemm::automatic_tile(8192, 2048, 132) == T::m256n128);
  CHECK(fp8::cuda::BlockGemm::automatic_tile(16384, 2048, 132) == T::m192n128);  // Llama 1B fc1 weight gradient
  CHECK(fp8::cuda::BlockGemm::automatic_tile(100, 256, 132) == T::m192n128);     // one round: fewer rows wasted
}

TEST_CASE("fp8.block_gemm=kiln runs GELU and dGELU epilogues after kiln's product as cuBLASLt's plans do") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  auto cpu = make_cpu_ops({.threads = 2});
  auto lt = make_cuda_ops(nullptr, {.block_gemm = BlockGemmKernel::cublaslt});
  auto own = make_cuda_ops(nullptr, {.block_gemm = BlockGemmKernel::kiln});
  if (!fp8::cuda::BlockGemm().available()) KILN_SKIP_TEST("kiln's block GEMM needs a Hopper GPU");
  const Operands o(264, 400, 384, ScalingMode::block_128x128, Format::e4m3, Format::e4m3, 77, *cpu);
  const auto n = static_cast<std::size_t>(o.m * o.n);
  const auto bias = test::normal_values(static_cast<std::size_t>(o.n), 78, 0.3f);
  std::vector<std::uint16_t> bias_bits(bias.size());
  for (std::size_t i = 0; i < bias.size(); ++i) bias_bits[i] = float_to_bf16_bits(bias[i]);
  const auto pre = test::normal_values(n, 79);
  std::vector<std::uint16_t> pre_bits(n);
  for (std::size_t i = 0; i < n; ++i) pre_bits[i] = float_to_bf16_bits(pre[i]);
  Buffer bias_d = test::to_device(bias_bits);
  for (auto epi : {ops::Epilogue::gelu, ops::Epilogue::dgelu}) {
    INFO(ops::name_of(epi));
    std::vector<std::vector<float>> outs;
    for (Fp8Ops* ops : {lt.get(), own.get()}) {
      DeviceOperands dev(o, DType::bf16);
      Buffer aux = test::to_device(pre_bits);  // dGELU reads it; GELU writes the pre-activation there
      dev.g.epilogue = epi;
      dev.g.aux = TensorView(aux.data(), {o.m, o.n}, DType::bf16, Device::cuda);
      if (epi == ops::Epilogue::gelu) dev.g.bias = TensorView(bias_d.data(), {o.n}, DType::bf16, Device::cuda);
      ops->gemm(dev.g);
      outs.push_back(dev.result());
    }
    const double err = test::rel_error(outs[1], outs[0]);
    INFO("relative difference " << err);
    CHECK(err < 1e-2);
  }
}
