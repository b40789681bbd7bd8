// FP8 on the GPU against the CPU emulation. Every case skips (KILN_SKIP) without a GPU.
//  - the cast: bit-identical codes over all 65,536 bf16 bit patterns and 4M random f32 patterns,
//    through the tiled (16-byte) kernel and the elementwise fallback;
//  - cast + transpose + amax at awkward shapes; the amax kernel and the scale computation;
//  - cuBLASLt FP8 GEMMs (forward E4M3 x E4M3, dgrad and wgrad E5M2 x E4M3, every epilogue)
//    against a double-precision product of the dequantised operands, with stated error bounds;
//  - the delayed-scaling update kernel, bit-identical to the CPU;
//  - an Fp8Linear layer, and a whole FP8 training step, on CUDA against the CPU emulation;
//  - a mixture of experts' grouped FP8 operands (the batched and the grouped quantisation, bit for
//    bit), the grouped FP8 GEMMs (one per expert, over several streams), an Fp8GroupedLinear layer
//    and a whole mixture-of-experts FP8 training step, on CUDA against the CPU emulation.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "../model/model_fixture.hpp"
#include "cuda_test_util.hpp"
#include "fp8_test_util.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/fp8/grouped_linear.hpp"
#include "kiln/fp8/linear.hpp"
#include "kiln/fp8/module.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/ops/cuda/launchers.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/train/train.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "kiln_test.hpp"

using namespace kiln;
using namespace kiln::fp8;

#define KILN_REQUIRE_CUDA()                                             \
  do {                                                                  \
    if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible"); \
  } while (0)

namespace {

// Codes a kernel wrote against the CPU's: how many differ, and how many by more than one step (a
// value a few ulp from a rounding boundary on one side may take the neighbouring code).
struct CodeDiff {
  std::size_t differ = 0, far = 0;
  void add(const std::vector<std::uint8_t>& want, const void* dev) {
    const auto got = test::to_host<std::uint8_t>(dev, want.size());
    for (std::size_t i = 0; i < want.size(); ++i)
      if (got[i] != want[i]) ++differ, far += std::abs(int(got[i]) - int(want[i])) > 1;
  }
};

// The outputs of a quantise-on-load case on both sides: e4m3 rowwise (copies & 1) and colwise
// (copies & 2) [R, C] copies, scale and amax (starting at 0.25) as {scale, amax}; check() compares
// the device's with the CPU's, allowing an occasional neighbouring code (values a few ulp from a
// bf16 rounding boundary on one side).
struct OnLoadOutputs {
  std::size_t n;
  int copies;
  std::vector<float> c_meta;
  std::vector<std::uint8_t> c_row, c_col;
  Buffer d_meta, d_row, d_col;
  Fp8TensorView c, g;
  OnLoadOutputs(std::int64_t R, std::int64_t C, int copies_, float scale)
      : n(static_cast<std::size_t>(R * C)),
        copies(copies_),
        c_meta{scale, 0.25f},
        c_row(n),
        c_col(n),
        d_meta(test::to_device(c_meta)),
        d_row(Device::cuda, n),
        d_col(Device::cuda, n) {
    if (copies & 1) {
      c.rowwise = TensorView(c_row.data(), {R, C}, DType::e4m3, Device::cpu);
      g.rowwise = TensorView(d_row.data(), {R, C}, DType::e4m3, Device::cuda);
    }
    if (copies & 2) {
      c.colwise = TensorView(c_col.data(), {C, R}, DType::e4m3, Device::cpu);
      g.colwise = TensorView(d_col.data(), {C, R}, DType::e4m3, Device::cuda);
    }
    c.scale = &c_meta[0];
    g.scale = static_cast<float*>(d_meta.data());
  }
  float* cpu_amax() { return &c_meta[1]; }
  float* gpu_amax() { return static_cast<float*>(d_meta.data()) + 1; }
  void check() {
    CodeDiff d;
    if (copies & 1) d.add(c_row, d_row.data());
    if (copies & 2) d.add(c_col, d_col.data());
    CHECK(d.far == 0);
    CHECK(d.differ <= n / 500 + 2);
    const auto meta = test::to_host<float>(d_meta.data(), 2);
    CHECK(meta[1] == doctest::Approx(c_meta[1]).epsilon(1e-2));
    CHECK(meta[1] > 0.25f);
  }
};

std::vector<std::uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<std::uint16_t> b(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) b[i] = float_to_bf16_bits(v[i]);
  return b;
}
std::vector<float> from_bf16(const std::vector<std::uint16_t>& b) {
  std::vector<float> v(b.size());
  for (std::size_t i = 0; i < b.size(); ++i) v[i] = bf16_bits_to_float(b[i]);
  return v;
}

// Quantises `x` (host bits of dtype `dt`, shape [R, C]) on both sides with the same scale and
// compares the rowwise and colwise codes and the max-accumulated amax bit for bit.
struct CastResult {
  std::size_t mismatches = 0;
  std::string first;
};
CastResult compare_cast(Fp8Ops& gpu, Fp8Ops& cpu, const void* host_x, DType dt, std::int64_t R, std::int64_t C,
                        Format f, float scale, bool row, bool col, float amax_start) {
  const std::size_t n = static_cast<std::size_t>(R * C), bytes = n * size_of(dt);
  std::vector<std::uint8_t> hx(static_cast<const std::uint8_t*>(host_x), static_cast<const std::uint8_t*>(host_x) + bytes);
  Buffer dx = test::to_device(hx);
  // meta on each side: scale, amax
  std::vector<float> hm = {scale, amax_start};
  Buffer dm = test::to_device(hm);
  Buffer drow(Device::cuda, std::max<std::size_t>(n, 16)), dcol(Device::cuda, std::max<std::size_t>(n, 16));
  std::vector<std::uint8_t> crow(n), ccol(n);
  Fp8TensorView g, c;
  if (row) {
    g.rowwise = TensorView(drow.data(), {R, C}, dtype_of(f), Device::cuda);
    c.rowwise = TensorView(crow.data(), {R, C}, dtype_of(f), Device::cpu);
  }
  if (col) {
    g.colwise = TensorView(dcol.data(), {C, R}, dtype_of(f), Device::cuda);
    c.colwise = TensorView(ccol.data(), {C, R}, dtype_of(f), Device::cpu);
  }
  g.format = c.format = f;
  g.scale = static_cast<float*>(dm.data());
  c.scale = &hm[0];
  gpu.quantize(TensorView(dx.data(), {R, C}, dt, Device::cuda), g, static_cast<float*>(dm.data()) + 1);
  cpu.quantize(TensorView(hx.data(), {R, C}, dt, Device::cpu), c, &hm[1]);
  CastResult res;
  auto cmp = [&](const std::vector<std::uint8_t>& want, const void* dev, const char* which) {
    const auto got = test::to_host<std::uint8_t>(dev, n);
    for (std::size_t i = 0; i < n; ++i)
      if (got[i] != want[i] && res.mismatches++ == 0)
        res.first = cat(which, " element ", i, ": gpu 0x", std::hex, int(got[i]), " cpu 0x", int(want[i]));
  };
  if (row) cmp(crow, drow.data(), "rowwise");
  if (col) cmp(ccol, dcol.data(), "colwise");
  const auto gm = test::to_host<float>(dm.data(), 2);
  if (float_bits(gm[1]) != float_bits(hm[1]) && res.mismatches++ == 0)
    res.first = cat("amax: gpu ", gm[1], " cpu ", hm[1]);
  return res;
}

}  // namespace

TEST_CASE("the CUDA cast is bit-identical to the CPU emulation over every bf16 bit pattern") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops();
  std::vector<std::uint16_t> all(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<std::uint16_t>(i);
  for (Format f : {Format::e4m3, Format::e5m2})
    for (float scale : {1.0f, 3.7f, 448.0f / 1000.3f, std::ldexp(1.0f, -10), 12345.678f}) {
      // [256, 256]: the tiled 16-byte kernel, both copies; [65536, 1]: the elementwise fallback.
      for (auto [R, C] : {std::pair<std::int64_t, std::int64_t>{256, 256}, {65536, 1}, {1, 65536}}) {
        auto r = compare_cast(*gpu, *cpu, all.data(), DType::bf16, R, C, f, scale, true, true, 0.0f);
        INFO(name_of(f) << " scale " << scale << " shape [" << R << "," << C << "]: " << r.mismatches
                        << " mismatches; first: " << r.first);
        CHECK(r.mismatches == 0);
      }
    }
}

TEST_CASE("the CUDA cast is bit-identical to the CPU emulation on 4M random f32 bit patterns") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops();
  std::mt19937_64 gen(2024);
  const std::int64_t R = 2048, C = 2048;
  std::vector<float> x(static_cast<std::size_t>(R * C));
  for (auto& v : x) {
    // Half uniformly random bits (every exponent, NaNs and infinities included), half near the FP8 range.
    const std::uint32_t bits = static_cast<std::uint32_t>(gen());
    if (gen() & 1)
      v = bits_float(bits);
    else
      v = bits_float((bits & 0x807fffffu) | ((100u + static_cast<std::uint32_t>(gen() % 50)) << 23));
  }
  for (Format f : {Format::e4m3, Format::e5m2})
    for (float scale : {1.0f, 0.37f}) {
      auto r = compare_cast(*gpu, *cpu, x.data(), DType::f32, R, C, f, scale, true, true, 0.0f);
      INFO(name_of(f) << " scale " << scale << ": " << r.mismatches << " mismatches; first: " << r.first);
      CHECK(r.mismatches == 0);
      auto g = compare_cast(*gpu, *cpu, x.data(), DType::f32, R * C / 16 + 3, 1, f, scale, true, false, 0.0f);
      INFO("elementwise path: " << g.first);
      CHECK(g.mismatches == 0);
    }
}

TEST_CASE("cast + transpose + amax match the CPU at awkward shapes, one copy or both") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops();
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{16, 16}, {48, 80},  {1040, 784}, {208, 2064},
                                                          {64, 4096}, {33, 47}, {1, 1},      {17, 160}};
  int seed = 0;
  for (auto [R, C] : shapes)
    for (DType dt : {DType::bf16, DType::f32})
      for (int copies = 1; copies <= 3; ++copies)
        for (float amax0 : {0.0f, 2.5f, 1e9f}) {
          auto v = test::normal_values(static_cast<std::size_t>(R * C), static_cast<std::uint64_t>(++seed), 3.0f);
          std::vector<std::uint16_t> b = to_bf16(v);
          const void* host = dt == DType::bf16 ? static_cast<const void*>(b.data()) : static_cast<const void*>(v.data());
          const Format f = copies == 2 ? Format::e5m2 : Format::e4m3;
          auto r = compare_cast(*gpu, *cpu, host, dt, R, C, f, 37.5f, copies & 1, copies & 2, amax0);
          INFO("[" << R << "," << C << "] " << name_of(dt) << " copies " << copies << " amax0 " << amax0 << ": "
                   << r.first);
          CHECK(r.mismatches == 0);
        }
}

TEST_CASE("the gradient quantisation (dGELU, both copies, amax, bias gradient in one pass) matches the CPU") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops({.round_bf16 = true});  // the dGELU stored in bf16, as on the GPU
  // Tiled shapes (multiples of 16, partial 64-tiles) and shapes that take the three-pass fallback.
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{1040, 784}, {64, 4096}, {208, 2064}, {16, 16},
                                                          {4112, 48},  {33, 47},   {17, 160}};
  int seed = 1000;
  for (auto [R, C] : shapes)
    for (bool gelu : {false, true})
      for (bool dbias : {false, true}) {
        const std::size_t n = static_cast<std::size_t>(R * C);
        const Format f = gelu ? Format::e5m2 : Format::e4m3;
        INFO("[" << R << "," << C << "] gelu " << gelu << " dbias " << dbias);
        const auto dy = from_bf16(to_bf16(test::normal_values(n, static_cast<std::uint64_t>(++seed), 0.3f)));
        const auto pre = from_bf16(to_bf16(test::normal_values(n, static_cast<std::uint64_t>(++seed), 2.0f)));
        const auto bias0 = test::normal_values(static_cast<std::size_t>(C), static_cast<std::uint64_t>(++seed));
        // CPU
        auto c_dy = dy;
        auto c_bias = bias0;
        std::vector<float> c_meta = {90.0f, 0.5f};  // scale, amax
        std::vector<std::uint8_t> c_row(n), c_col(n);
        GradQuantizeArgs c;
        c.dy = TensorView(c_dy.data(), {R, C}, DType::f32, Device::cpu);
        if (gelu) c.gelu_pre = TensorView(const_cast<float*>(pre.data()), {R, C}, DType::f32, Device::cpu);
        c.out.rowwise = TensorView(c_row.data(), {R, C}, dtype_of(f), Device::cpu);
        c.out.colwise = TensorView(c_col.data(), {C, R}, dtype_of(f), Device::cpu);
        c.out.format = f;
        c.out.scale = &c_meta[0];
        c.amax = &c_meta[1];
        if (dbias) c.dbias = TensorView(c_bias.data(), {C}, DType::f32, Device::cpu);
        cpu->quantize_grad(c);
        // GPU
        Buffer d_dy = test::to_device(to_bf16(dy)), d_pre = test::to_device(to_bf16(pre)), d_bias = test::to_device(bias0);
        Buffer d_meta = test::to_device(std::vector<float>{90.0f, 0.5f});
        Buffer d_row(Device::cuda, n), d_col(Device::cuda, n);
        GradQuantizeArgs g;
        g.dy = TensorView(d_dy.data(), {R, C}, DType::bf16, Device::cuda);
        if (gelu) g.gelu_pre = TensorView(d_pre.data(), {R, C}, DType::bf16, Device::cuda);
        g.out.rowwise = TensorView(d_row.data(), {R, C}, dtype_of(f), Device::cuda);
        g.out.colwise = TensorView(d_col.data(), {C, R}, dtype_of(f), Device::cuda);
        g.out.format = f;
        g.out.scale = static_cast<float*>(d_meta.data());
        g.amax = static_cast<float*>(d_meta.data()) + 1;
        if (dbias) g.dbias = TensorView(d_bias.data(), {C}, DType::f32, Device::cuda);
        gpu->quantize_grad(g);
        // Codes: identical without the dGELU; with it the device's exp2 / reciprocal may differ from
        // the host's in the last bits, so an occasional neighbouring code is allowed.
        CodeDiff d;
        d.add(c_row, d_row.data());
        d.add(c_col, d_col.data());
        if (gelu) {
          CHECK(d.far == 0);
          CHECK(d.differ <= n / 500 + 2);
        } else {
          CHECK(d.differ == 0);
        }
        const auto meta = test::to_host<float>(d_meta.data(), 2);
        if (gelu)
          CHECK(meta[1] == doctest::Approx(c_meta[1]).epsilon(1e-2));
        else
          CHECK(float_bits(meta[1]) == float_bits(c_meta[1]));
        if (dbias) {
          const auto got = test::to_host<float>(d_bias.data(), static_cast<std::size_t>(C));
          double worst = 0;
          for (std::int64_t j = 0; j < C; ++j) {
            double mag = 1.0;
            for (std::int64_t r = 0; r < R; ++r) mag += std::fabs(c_dy[static_cast<std::size_t>(r * C + j)]);
            worst = std::max(worst, std::fabs(got[static_cast<std::size_t>(j)] - c_bias[static_cast<std::size_t>(j)]) / mag);
          }
          // Exact sums of the same g but for the dGELU's last bits (device exp2 / reciprocal): one g
          // rounded to the neighbouring bf16 in a column moves its sum by ~|g| 2^-8 / mag.
          CHECK(worst < (gelu ? 1e-4 : 2e-5));
        }
      }
}

TEST_CASE("an LM head's cross-entropy gradient quantised on load equals the loss's dlogits quantised, bit for bit, "
          "and matches the CPU") {
  KILN_REQUIRE_CUDA();
  auto gpu_be = ops::make_cuda_backend(0, {});
  auto cpu_be = ops::make_cpu_backend({.round_bf16 = true});
  auto gpu = make_cuda_ops(gpu_be->stream());
  auto cpu = make_cpu_ops({.round_bf16 = true});  // the gradient stored in bf16, as on the GPU
  // [rows, this rank's columns], the columns' first vocabulary index, the real vocabulary: tiled
  // shapes (with padded columns, a slice past the real ones) and one the three-pass fallback takes.
  struct Case {
    std::int64_t R, V, begin;
    int real;
  };
  const Case cases[] = {{1040, 784, 0, 700}, {64, 4096, 4096, 8000}, {208, 2064, 0, 2064}, {33, 47, 0, 40}};
  int seed = 5000;
  for (const Case& k : cases) {
    const std::int64_t R = k.R, V = k.V;
    const std::size_t n = static_cast<std::size_t>(R * V);
    INFO("[" << R << "," << V << "] from column " << k.begin << " of " << k.real);
    const auto logits = from_bf16(to_bf16(test::normal_values(n, static_cast<std::uint64_t>(++seed), 3.0f)));
    std::vector<std::int32_t> targets(static_cast<std::size_t>(R));
    std::mt19937 gen(static_cast<unsigned>(++seed));
    for (auto& t : targets) {
      t = static_cast<std::int32_t>(gen() % static_cast<unsigned>(k.real));
      if (gen() % 16 == 0) t = -1;  // ignored rows
    }
    const float dloss = 1.0f / static_cast<float>(R);
    const Format f = Format::e5m2;
    // One side: the loss's statistics, then either its dlogits quantised (on_load false) or the
    // gradient made as the logits are quantised; returns the codes (rowwise then colwise), amax,
    // losses and the logits afterwards.
    struct Result {
      std::vector<std::uint8_t> codes;
      float amax;
      std::vector<float> losses, logits_after;
    };
    auto run = [&](ops::Backend& be, Fp8Ops& q, bool on_load, bool materialise) {
      const Device dev = be.device();
      const DType act = dev == Device::cuda ? DType::bf16 : DType::f32;
      Buffer l = dev == Device::cuda ? test::to_device(to_bf16(logits)) : Buffer(Device::cpu, n * 4);
      if (dev == Device::cpu) std::memcpy(l.data(), logits.data(), n * 4);
      Buffer t = dev == Device::cuda ? test::to_device(targets) : Buffer(Device::cpu, targets.size() * 4);
      if (dev == Device::cpu) std::memcpy(t.data(), targets.data(), targets.size() * 4);
      Buffer stats = be.alloc(static_cast<std::size_t>(R) * 12), lse = be.alloc(static_cast<std::size_t>(R) * 4),
             losses = be.alloc(static_cast<std::size_t>(R) * 4), codes = be.alloc(2 * n),
             meta = dev == Device::cuda ? test::to_device(std::vector<float>{4096.0f, 0.0f}) : Buffer(Device::cpu, 8);
      if (dev == Device::cpu) {
        static_cast<float*>(meta.data())[0] = 4096.0f;
        static_cast<float*>(meta.data())[1] = 0.0f;
      }
      const TensorView L(l.data(), {R, V}, act, dev), T(t.data(), {R}, DType::i32, dev);
      const TensorView S(stats.data(), {1, R, 3}, DType::f32, dev), E(lse.data(), {R}, DType::f32, dev);
      const TensorView Lo(losses.data(), {R}, DType::f32, dev);
      be.cross_entropy_stats({S.reshape({R, 3}), L, T, k.begin, k.real});
      be.cross_entropy_finish({.losses = Lo,
                               .logits = L,
                               .targets = T,
                               .all_stats = S,
                               .vocab_begin = k.begin,
                               .vocab_real = k.real,
                               .dloss = dloss,
                               .lse = E,
                               .write_dlogits = !on_load && !materialise});
      const ops::XentOnLoad x{L, E, T, k.begin, k.real, dloss};
      if (materialise) q.xent_grad(x);
      GradQuantizeArgs g;
      g.dy = L;
      g.out.rowwise = TensorView(codes.data(), {R, V}, dtype_of(f), dev);
      g.out.colwise = TensorView(static_cast<std::uint8_t*>(codes.data()) + n, {V, R}, dtype_of(f), dev);
      g.out.format = f;
      g.out.scale = static_cast<float*>(meta.data());
      g.amax = static_cast<float*>(meta.data()) + 1;
      if (on_load) g.xent = &x;
      q.quantize_grad(g);
      be.synchronize();
      Result r;
      if (dev == Device::cuda) {
        r.codes = test::to_host<std::uint8_t>(codes.data(), 2 * n);
        r.amax = test::to_host<float>(meta.data(), 2)[1];
        r.losses = test::to_host<float>(losses.data(), static_cast<std::size_t>(R));
        r.logits_after = from_bf16(test::to_host<std::uint16_t>(l.data(), n));
      } else {
        const auto* c = static_cast<const std::uint8_t*>(codes.data());
        r.codes.assign(c, c + 2 * n);
        r.amax = static_cast<const float*>(meta.data())[1];
        r.losses.assign(static_cast<const float*>(losses.data()), static_cast<const float*>(losses.data()) + R);
        r.logits_after.assign(static_cast<const float*>(l.data()), static_cast<const float*>(l.data()) + n);
      }
      return r;
    };
    const Result written = run(*gpu_be, *gpu, false, false), loaded = run(*gpu_be, *gpu, true, false),
                 made = run(*gpu_be, *gpu, false, true);
    CHECK(loaded.codes == written.codes);
    CHECK(float_bits(loaded.amax) == float_bits(written.amax));
    CHECK(loaded.losses == written.losses);
    CHECK(made.logits_after == written.logits_after);  // xent_grad writes the loss's dlogits
    CHECK(made.codes == written.codes);
    if (R % 16 == 0 && V % 16 == 0) CHECK(loaded.logits_after == logits);  // the fused kernel leaves them
    // The CPU: its own exp, so an occasional neighbouring code.
    const Result host = run(*cpu_be, *cpu, true, false);
    std::size_t differ = 0, far = 0;
    for (std::size_t i = 0; i < host.codes.size(); ++i)
      if (host.codes[i] != loaded.codes[i]) ++differ, far += std::abs(int(host.codes[i]) - int(loaded.codes[i])) > 1;
    CHECK(far == 0);
    CHECK(differ <= 2 * n / 500 + 2);
    CHECK(host.amax == doctest::Approx(loaded.amax).epsilon(1e-3));
    for (std::int64_t r = 0; r < R; ++r)
      CHECK(host.losses[static_cast<std::size_t>(r)] == doctest::Approx(loaded.losses[static_cast<std::size_t>(r)]).epsilon(1e-4));
  }
}

TEST_CASE("quantising gelu(pre) on load matches the CPU (one copy or both, and the amax alone)") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops({.round_bf16 = true});
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{1040, 784}, {64, 3072}, {33, 47}, {16, 16}};
  int seed = 2000;
  for (auto [R, C] : shapes)
    for (int copies = 0; copies <= 3; ++copies) {
      INFO("[" << R << "," << C << "] copies " << copies);
      const std::size_t n = static_cast<std::size_t>(R * C);
      const auto pre = from_bf16(to_bf16(test::normal_values(n, static_cast<std::uint64_t>(++seed), 2.5f)));
      OnLoadOutputs o(R, C, copies, 60.0f);
      Buffer d_pre = test::to_device(to_bf16(pre));
      const TensorView hp(const_cast<float*>(pre.data()), {R, C}, DType::f32, Device::cpu);
      const TensorView dp(d_pre.data(), {R, C}, DType::bf16, Device::cuda);
      if (copies == 0) {
        cpu->amax_gelu(hp, o.cpu_amax());
        gpu->amax_gelu(dp, o.gpu_amax());
      } else {
        cpu->quantize_gelu(hp, o.c, o.cpu_amax());
        gpu->quantize_gelu(dp, o.g, o.gpu_amax());
      }
      o.check();  // the device's exp2 / reciprocal differ from the host's in the last bits
    }
}

TEST_CASE("quantising swiglu(pre) on load matches the CPU (one copy or both, and the amax alone)") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops({.round_bf16 = true});
  // [rows, F] outputs of pre [rows, 2F]: tiled (F % 16 == 0), and the elementwise path (F = 47, 40).
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{1040, 784}, {64, 3072}, {33, 47}, {48, 40}, {16, 16}};
  int seed = 3000;
  for (auto [R, F] : shapes)
    for (int copies = 0; copies <= 3; ++copies) {
      INFO("[" << R << "," << F << "] copies " << copies);
      const std::size_t n = static_cast<std::size_t>(R * 2 * F);
      const auto pre = from_bf16(to_bf16(test::normal_values(n, static_cast<std::uint64_t>(++seed), 2.5f)));
      OnLoadOutputs o(R, F, copies, 20.0f);
      Buffer d_pre = test::to_device(to_bf16(pre));
      const TensorView hp(const_cast<float*>(pre.data()), {R, 2 * F}, DType::f32, Device::cpu);
      const TensorView dp(d_pre.data(), {R, 2 * F}, DType::bf16, Device::cuda);
      if (copies == 0) {
        cpu->amax_swiglu(hp, o.cpu_amax());
        gpu->amax_swiglu(dp, o.gpu_amax());
      } else {
        cpu->quantize_swiglu(hp, o.c, o.cpu_amax());
        gpu->quantize_swiglu(dp, o.g, o.gpu_amax());
      }
      o.check();  // the device's exp / division differ from the host's in the last bits
    }
}

TEST_CASE("quantising LayerNorm(x) on load from the forward's statistics matches the CPU") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops({.round_bf16 = true});
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{1040, 784}, {64, 3072}, {33, 47}};
  int seed = 4000;
  for (auto [R, C] : shapes)
    for (int copies = 1; copies <= 3; ++copies) {
      INFO("[" << R << "," << C << "] copies " << copies);
      const std::size_t n = static_cast<std::size_t>(R * C);
      const auto x = from_bf16(to_bf16(test::normal_values(n, static_cast<std::uint64_t>(++seed), 3.0f)));
      auto w = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(C), static_cast<std::uint64_t>(++seed))));
      auto b = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(C), static_cast<std::uint64_t>(++seed), 0.1f)));
      std::vector<float> mean(static_cast<std::size_t>(R)), rstd(static_cast<std::size_t>(R));
      for (std::int64_t r = 0; r < R; ++r)  // statistics as a LayerNorm forward writes them
        ops::layernorm_row_stats(x.data() + r * C, C, 1e-5f, mean[static_cast<std::size_t>(r)],
                                 rstd[static_cast<std::size_t>(r)]);
      OnLoadOutputs o(R, C, copies, 30.0f);
      Buffer d_x = test::to_device(to_bf16(x)), d_w = test::to_device(to_bf16(w)), d_b = test::to_device(to_bf16(b)), d_mean = test::to_device(mean),
             d_rstd = test::to_device(rstd);
      ops::LayerNormOnLoad hl, dl;
      hl.x = TensorView(const_cast<float*>(x.data()), {R, C}, DType::f32, Device::cpu);
      hl.weight = TensorView(w.data(), {C}, DType::f32, Device::cpu);
      hl.bias = TensorView(b.data(), {C}, DType::f32, Device::cpu);
      hl.mean = TensorView(mean.data(), {R}, DType::f32, Device::cpu);
      hl.rstd = TensorView(rstd.data(), {R}, DType::f32, Device::cpu);
      dl.x = TensorView(d_x.data(), {R, C}, DType::bf16, Device::cuda);
      dl.weight = TensorView(d_w.data(), {C}, DType::bf16, Device::cuda);
      dl.bias = TensorView(d_b.data(), {C}, DType::bf16, Device::cuda);
      dl.mean = TensorView(d_mean.data(), {R}, DType::f32, Device::cuda);
      dl.rstd = TensorView(d_rstd.data(), {R}, DType::f32, Device::cuda);
      cpu->quantize_layernorm(hl, o.c, o.cpu_amax());
      gpu->quantize_layernorm(dl, o.g, o.gpu_amax());
      o.check();  // FMA contraction may move a value across a bf16 rounding boundary
    }
}

TEST_CASE("the LayerNorm statistics of an FP8 layer are the backend LayerNorm's, bit for bit, with its output's amax") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  // Vectorised rows (C 784 and 3072), a row the backend reads plainly (C 47), and one too wide for
  // registers (C 8200).
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{1040, 784}, {64, 3072}, {33, 47}, {16, 8200}};
  int seed = 5000;
  for (auto [R, C] : shapes) {
    INFO("[" << R << "," << C << "]");
    const std::size_t n = static_cast<std::size_t>(R * C);
    const auto x = to_bf16(test::normal_values(n, static_cast<std::uint64_t>(++seed), 2.0f));
    const auto w = to_bf16(test::normal_values(static_cast<std::size_t>(C), static_cast<std::uint64_t>(++seed)));
    const auto b = to_bf16(test::normal_values(static_cast<std::size_t>(C), static_cast<std::uint64_t>(++seed), 0.1f));
    Buffer d_x = test::to_device(x), d_w = test::to_device(w), d_b = test::to_device(b), d_out(Device::cuda, n * 2),
           d_stats(Device::cuda, static_cast<std::size_t>(4 * R) * 4), d_amax = test::to_device(std::vector<float>{0.0f});
    auto* st = static_cast<float*>(d_stats.data());
    kiln::cuda::layernorm_forward(static_cast<kiln::cuda::bf16*>(d_out.data()), st, st + R,
                                  static_cast<const kiln::cuda::bf16*>(d_x.data()),
                                  static_cast<const kiln::cuda::bf16*>(d_w.data()),
                                  static_cast<const kiln::cuda::bf16*>(d_b.data()), static_cast<int>(R),
                                  static_cast<int>(C), 1e-5f, nullptr);
    ops::LayerNormOnLoad ln;
    ln.x = TensorView(d_x.data(), {R, C}, DType::bf16, Device::cuda);
    ln.weight = TensorView(d_w.data(), {C}, DType::bf16, Device::cuda);
    ln.bias = TensorView(d_b.data(), {C}, DType::bf16, Device::cuda);
    ln.mean = TensorView(st + 2 * R, {R}, DType::f32, Device::cuda);
    ln.rstd = TensorView(st + 3 * R, {R}, DType::f32, Device::cuda);
    ln.eps = 1e-5f;
    gpu->layernorm_stats(ln, static_cast<float*>(d_amax.data()));
    const auto stats = test::to_host<float>(st, static_cast<std::size_t>(4 * R));
    CHECK(std::memcmp(stats.data(), stats.data() + 2 * R, static_cast<std::size_t>(2 * R) * 4) == 0);
    const auto out = from_bf16(test::to_host<std::uint16_t>(d_out.data(), n));
    float want = 0;
    for (float v : out) want = std::max(want, std::fabs(v));
    CHECK(test::to_host<float>(d_amax.data(), 1)[0] == want);
  }
}

namespace {
// The AdamW step the fused-update tests take (step 7, weight decay, a gradient scale).
void set_test_hyperparameters(AdamWQuantizeArgs& a) {
  a.lr = 3e-3f;
  a.beta1 = 0.9f;
  a.beta2 = 0.95f;
  a.eps = 1e-8f;
  a.weight_decay = 0.1f;
  a.grad_scale = 0.8f;
  a.step = 7;
}

// The fused-update tests' arguments over `shape` ([R, C] or [B, R, C]; `transposed` the colwise
// copy's): f32 param and gradient, moments of `moments`, the test's hyperparameters, and by mode
// 0: no copies, 1: both, 2: both and the amax, 3: the rowwise copy and the amax (meta: scale, amax).
struct FusedUpdateBuffers {
  void *param, *grad, *m, *v, *row, *col;
  float* meta;
};
AdamWQuantizeArgs fused_update_args(Device dev, const Shape& shape, const Shape& transposed, DType moments, int mode,
                                    const FusedUpdateBuffers& b) {
  AdamWQuantizeArgs a;
  a.param = TensorView(b.param, shape, DType::f32, dev);
  a.grad = TensorView(b.grad, shape, DType::f32, dev);
  a.m = TensorView(b.m, shape, moments, dev);
  a.v = TensorView(b.v, shape, moments, dev);
  if (mode > 0) {
    a.out.rowwise = TensorView(b.row, shape, DType::e4m3, dev);
    if (mode < 3) a.out.colwise = TensorView(b.col, transposed, DType::e4m3, dev);
    a.out.format = Format::e4m3;
    a.out.scale = b.meta;
  }
  if (mode >= 2) a.amax = b.meta + 1;
  set_test_hyperparameters(a);
  return a;
}
}  // namespace

TEST_CASE("the fused AdamW step + weight quantisation matches the CPU (tiled and elementwise, with one, two or no "
          "copies, stacked matrices each transposed)") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops();
  // [3072, 768]: tiled, several tiles per block; [80, 48]: tiled, partial tiles; [33, 47]: the
  // elementwise kernel. Stacked (a mixture of experts' weights): 3 x [128, 96], tiles within a
  // matrix; 3 x [48, 80], tiles across two; 2 x [33, 47], elementwise.
  struct Dims {
    std::int64_t B, R, C;
  };
  const Dims shapes[] = {{1, 3072, 768}, {1, 80, 48}, {1, 33, 47}, {3, 128, 96}, {3, 48, 80}, {2, 33, 47}};
  int seed = 3000;
  for (auto [B, R, C] : shapes)
    for (int mode = 0; mode < 4; ++mode) {  // 0: update only, 1: both copies, 2: both and amax, 3: rowwise and amax
      INFO(B << " x [" << R << "," << C << "] mode " << mode);
      const std::size_t n = static_cast<std::size_t>(B * R * C);
      auto shape = [&](std::int64_t a, std::int64_t b) { return B > 1 ? Shape{B, a, b} : Shape{a, b}; };
      auto p = test::normal_values(n, static_cast<std::uint64_t>(++seed), 0.05f);
      const auto g = test::normal_values(n, static_cast<std::uint64_t>(++seed), 0.01f);
      auto m = test::normal_values(n, static_cast<std::uint64_t>(++seed), 1e-3f);
      auto v = test::normal_values(n, static_cast<std::uint64_t>(++seed), 1e-5f);
      for (auto& x : v) x = std::fabs(x) + 1e-8f;
      std::vector<float> c_meta = {2000.0f, 0.01f};  // scale, amax
      std::vector<std::uint8_t> c_row(n), c_col(n);
      Buffer d_p = test::to_device(p), d_g = test::to_device(g), d_m = test::to_device(m), d_v = test::to_device(v), d_meta = test::to_device(c_meta),
             d_row(Device::cuda, n), d_col(Device::cuda, n);
      cpu->adamw_quantize(fused_update_args(Device::cpu, shape(R, C), shape(C, R), DType::f32, mode,
                                            {p.data(), const_cast<float*>(g.data()), m.data(), v.data(), c_row.data(),
                                             c_col.data(), c_meta.data()}));
      gpu->adamw_quantize(fused_update_args(Device::cuda, shape(R, C), shape(C, R), DType::f32, mode,
                                            {d_p.data(), d_g.data(), d_m.data(), d_v.data(), d_row.data(), d_col.data(),
                                             static_cast<float*>(d_meta.data())}));
      // The same formula; FMA contraction may differ in the last bits of an f32: ||got - want|| / ||want||.
      auto close = [&](const std::vector<float>& want, const void* dev) {
        const auto got = test::to_host<float>(dev, n);
        double num = 0, den = 0;
        for (std::size_t i = 0; i < n; ++i) {
          num += double(got[i] - want[i]) * (got[i] - want[i]);
          den += double(want[i]) * want[i];
        }
        return std::sqrt(num / den);
      };
      CHECK(close(p, d_p.data()) < 1e-6);
      CHECK(close(m, d_m.data()) < 1e-6);
      CHECK(close(v, d_v.data()) < 1e-6);
      if (mode > 0) {
        // A parameter a last bit away from a rounding boundary may take the neighbouring code.
        CodeDiff d;
        d.add(c_row, d_row.data());
        if (mode < 3) d.add(c_col, d_col.data());
        CHECK(d.far == 0);
        CHECK(d.differ <= n / 1000 + 2);
      }
      const auto meta = test::to_host<float>(d_meta.data(), 2);
      if (mode >= 2) {
        CHECK(meta[1] == doctest::Approx(c_meta[1]).epsilon(1e-5));
        CHECK(meta[1] > 0.01f);
      } else {
        CHECK(meta[1] == 0.01f);  // no amax asked for: untouched
      }
    }
}

TEST_CASE("the fused AdamW step with bf16 moments matches the CPU's bits (tiled, elementwise, stacked)") {
  // optim.moments = "bf16": the moments read as f32, updated, stored rounded to nearest even.
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops();
  struct Dims {
    std::int64_t B, R, C;
  };
  int seed = 3500;
  for (auto [B, R, C] : {Dims{1, 80, 48}, Dims{1, 33, 47}, Dims{3, 48, 80}}) {
    INFO(B << " x [" << R << "," << C << "]");
    const std::size_t n = static_cast<std::size_t>(B * R * C);
    auto shape = [&](std::int64_t a, std::int64_t b) { return B > 1 ? Shape{B, a, b} : Shape{a, b}; };
    auto p = test::normal_values(n, static_cast<std::uint64_t>(++seed), 0.05f);
    const auto g = test::normal_values(n, static_cast<std::uint64_t>(++seed), 0.01f);
    std::vector<std::uint16_t> m(n), v(n);
    const auto m0 = test::normal_values(n, static_cast<std::uint64_t>(++seed), 1e-3f);
    const auto v0 = test::normal_values(n, static_cast<std::uint64_t>(++seed), 1e-5f);
    for (std::size_t i = 0; i < n; ++i) m[i] = float_to_bf16_bits(m0[i]), v[i] = float_to_bf16_bits(std::fabs(v0[i]) + 1e-8f);
    std::vector<float> c_meta = {2000.0f, 0.01f};
    std::vector<std::uint8_t> c_row(n), c_col(n);
    Buffer d_p = test::to_device(p), d_g = test::to_device(g), d_m = test::to_device(m), d_v = test::to_device(v), d_meta = test::to_device(c_meta),
           d_row(Device::cuda, n), d_col(Device::cuda, n);
    // Both copies and the amax (mode 2).
    cpu->adamw_quantize(fused_update_args(Device::cpu, shape(R, C), shape(C, R), DType::bf16, 2,
                                          {p.data(), const_cast<float*>(g.data()), m.data(), v.data(), c_row.data(),
                                           c_col.data(), c_meta.data()}));
    gpu->adamw_quantize(fused_update_args(Device::cuda, shape(R, C), shape(C, R), DType::bf16, 2,
                                          {d_p.data(), d_g.data(), d_m.data(), d_v.data(), d_row.data(), d_col.data(),
                                           static_cast<float*>(d_meta.data())}));
    CHECK(test::to_host<float>(d_p.data(), n) == p);
    CHECK(test::to_host<std::uint16_t>(d_m.data(), n) == m);
    CHECK(test::to_host<std::uint16_t>(d_v.data(), n) == v);
    CHECK(test::to_host<std::uint8_t>(d_row.data(), n) == c_row);
    CHECK(test::to_host<std::uint8_t>(d_col.data(), n) == c_col);
    CHECK(test::to_host<float>(d_meta.data(), 2)[1] == c_meta[1]);
  }
}

TEST_CASE("the fused AdamW step with a bf16 gradient matches the CPU and the f32 gradient's bits (tiled, elementwise, "
          "stacked)") {
  // optim.grads = "bf16": the gradient read as f32 exactly. On the GPU the step equals, bit for bit,
  // the step with an f32 gradient of the same values; against the CPU the f32 gradient's tolerance
  // (bits where the moments are bf16, as there).
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops();
  struct Dims {
    std::int64_t B, R, C;
  };
  int seed = 3700;
  for (auto [B, R, C] : {Dims{1, 80, 48}, Dims{1, 33, 47}, Dims{3, 48, 80}})
    for (const DType moments : {DType::f32, DType::bf16}) {
      INFO(B << " x [" << R << "," << C << "] " << name_of(moments) << " moments");
      const std::size_t n = static_cast<std::size_t>(B * R * C);
      auto shape = [&](std::int64_t a, std::int64_t b) { return B > 1 ? Shape{B, a, b} : Shape{a, b}; };
      auto p = test::normal_values(n, static_cast<std::uint64_t>(++seed), 0.05f);
      auto g = test::normal_values(n, static_cast<std::uint64_t>(++seed), 0.01f);
      std::vector<std::uint16_t> g16(n);
      for (std::size_t i = 0; i < n; ++i) g16[i] = float_to_bf16_bits(g[i]), g[i] = bf16_bits_to_float(g16[i]);
      const auto m0 = test::normal_values(n, static_cast<std::uint64_t>(++seed), 1e-3f);
      const auto v0 = test::normal_values(n, static_cast<std::uint64_t>(++seed), 1e-5f);
      std::vector<float> m(n), v(n);
      std::vector<std::uint16_t> mb(n), vb(n);
      for (std::size_t i = 0; i < n; ++i) {
        mb[i] = float_to_bf16_bits(m0[i]), vb[i] = float_to_bf16_bits(std::fabs(v0[i]) + 1e-8f);
        m[i] = bf16_bits_to_float(mb[i]), v[i] = bf16_bits_to_float(vb[i]);
      }
      const bool half = moments == DType::bf16;
      void* cm = half ? static_cast<void*>(mb.data()) : m.data();
      void* cv = half ? static_cast<void*>(vb.data()) : v.data();
      const std::size_t mbytes = n * size_of(moments);
      std::vector<float> c_meta = {2000.0f, 0.01f};
      std::vector<std::uint8_t> c_row(n), c_col(n);
      struct Side {
        Buffer p, g, m, v, meta, row, col;
      };
      auto make = [&](bool bf16_grad) {
        return Side{test::to_device(p), bf16_grad ? test::to_device(g16) : test::to_device(g),
                    half ? test::to_device(mb) : test::to_device(m), half ? test::to_device(vb) : test::to_device(v),
                    test::to_device(c_meta), Buffer(Device::cuda, n), Buffer(Device::cuda, n)};
      };
      Side with16 = make(true), with32 = make(false);
      for (Side* d : {&with16, &with32}) {
        AdamWQuantizeArgs a = fused_update_args(Device::cuda, shape(R, C), shape(C, R), moments, 2,
                                                {d->p.data(), d->g.data(), d->m.data(), d->v.data(), d->row.data(),
                                                 d->col.data(), static_cast<float*>(d->meta.data())});
        if (d == &with16) a.grad = TensorView(d->g.data(), shape(R, C), DType::bf16, Device::cuda);
        gpu->adamw_quantize(a);
      }
      AdamWQuantizeArgs c = fused_update_args(Device::cpu, shape(R, C), shape(C, R), moments, 2,
                                              {p.data(), g16.data(), cm, cv, c_row.data(), c_col.data(), c_meta.data()});
      c.grad = TensorView(g16.data(), shape(R, C), DType::bf16, Device::cpu);
      cpu->adamw_quantize(c);
      CHECK(test::same_device_bytes(with16.p.data(), with32.p.data(), n * 4));
      CHECK(test::same_device_bytes(with16.m.data(), with32.m.data(), mbytes));
      CHECK(test::same_device_bytes(with16.v.data(), with32.v.data(), mbytes));
      CHECK(test::same_device_bytes(with16.row.data(), with32.row.data(), n));
      CHECK(test::same_device_bytes(with16.col.data(), with32.col.data(), n));
      CHECK(test::same_device_bytes(with16.meta.data(), with32.meta.data(), 8));
      if (half) {
        CHECK(test::to_host<float>(with16.p.data(), n) == p);
        CHECK(test::to_host<std::uint16_t>(with16.m.data(), n) == mb);
        CHECK(test::to_host<std::uint16_t>(with16.v.data(), n) == vb);
        CHECK(test::to_host<std::uint8_t>(with16.row.data(), n) == c_row);
        CHECK(test::to_host<std::uint8_t>(with16.col.data(), n) == c_col);
      } else {
        const auto got = test::to_host<float>(with16.p.data(), n);
        double num = 0, den = 0;
        for (std::size_t i = 0; i < n; ++i) num += double(got[i] - p[i]) * (got[i] - p[i]), den += double(p[i]) * p[i];
        CHECK(std::sqrt(num / den) < 1e-6);
        CodeDiff d;
        d.add(c_row, with16.row.data());
        d.add(c_col, with16.col.data());
        CHECK(d.far == 0);
        CHECK(d.differ <= n / 1000 + 2);
      }
    }
}

TEST_CASE("a weight's fused AdamW step gives the same bits whole (tiled, both copies) and in parts (elementwise)") {
  // Plain data parallelism updates each whole weight with its two FP8 copies (the tiled kernel);
  // FSDP updates each rank's flat part of it with its rowwise codes (the elementwise kernel). The
  // same parameters must come out of both, bit for bit, or the two layouts drift apart.
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  for (auto [R, C] : {std::pair<std::int64_t, std::int64_t>{384, 128}, {80, 48}, {1536, 512}}) {
    INFO("[" << R << "," << C << "]");
    const std::size_t n = static_cast<std::size_t>(R * C);
    auto p = test::normal_values(n, 41, 0.05f);
    const auto g = test::normal_values(n, 42, 0.01f);
    auto m = test::normal_values(n, 43, 1e-3f);
    auto v = test::normal_values(n, 44, 1e-5f);
    for (auto& x : v) x = std::fabs(x) + 1e-8f;
    const std::vector<float> meta = {2000.0f, 0.0f};
    struct Side {
      Buffer p, g, m, v, meta, row, col;
    };
    auto make = [&] {
      return Side{test::to_device(p), test::to_device(g), test::to_device(m), test::to_device(v), test::to_device(meta), Buffer(Device::cuda, n), Buffer(Device::cuda, n)};
    };
    Side whole = make(), parts = make();
    auto step = [&](Side& s, std::int64_t first, std::int64_t count, bool tiled) {
      auto at = [&](Buffer& b, std::size_t bytes) { return static_cast<char*>(b.data()) + first * static_cast<std::int64_t>(bytes); };
      const Shape shape = tiled ? Shape{R, C} : Shape{1, count};
      AdamWQuantizeArgs a;
      a.param = TensorView(at(s.p, 4), shape, DType::f32, Device::cuda);
      a.grad = TensorView(at(s.g, 4), shape, DType::f32, Device::cuda);
      a.m = TensorView(at(s.m, 4), shape, DType::f32, Device::cuda);
      a.v = TensorView(at(s.v, 4), shape, DType::f32, Device::cuda);
      a.out.rowwise = TensorView(at(s.row, 1), shape, DType::e4m3, Device::cuda);
      if (tiled) a.out.colwise = TensorView(s.col.data(), {C, R}, DType::e4m3, Device::cuda);
      a.out.format = Format::e4m3;
      a.out.scale = static_cast<float*>(s.meta.data());
      a.amax = static_cast<float*>(s.meta.data()) + 1;
      set_test_hyperparameters(a);
      gpu->adamw_quantize(a);
    };
    step(whole, 0, R * C, true);
    const std::int64_t half = (R * C / 2) / 16 * 16;  // FSDP's parts: flat ranges, 16-element aligned
    step(parts, 0, half, false);
    step(parts, half, R * C - half, false);
    CHECK(test::to_host<float>(whole.p.data(), n) == test::to_host<float>(parts.p.data(), n));
    CHECK(test::to_host<float>(whole.m.data(), n) == test::to_host<float>(parts.m.data(), n));
    CHECK(test::to_host<float>(whole.v.data(), n) == test::to_host<float>(parts.v.data(), n));
    CHECK(test::to_host<std::uint8_t>(whole.row.data(), n) == test::to_host<std::uint8_t>(parts.row.data(), n));
    CHECK(test::to_host<float>(whole.meta.data(), 2)[1] == test::to_host<float>(parts.meta.data(), 2)[1]);
  }
}

TEST_CASE("the amax kernel and the current-scaling scale match the CPU, aligned or not") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops();
  for (std::int64_t n : {1, 7, 8, 1000, 1 << 20, (1 << 20) + 5})
    for (int offset : {0, 1, 3})
      for (DType dt : {DType::bf16, DType::f32}) {
        auto v = test::normal_values(static_cast<std::size_t>(n + offset), static_cast<std::uint64_t>(n + offset));
        v[static_cast<std::size_t>(n + offset) / 2] = -77.0f;
        auto b = to_bf16(v);
        Buffer dx = dt == DType::bf16 ? test::to_device(b) : test::to_device(v);
        const std::size_t es = size_of(dt);
        const void* hptr = dt == DType::bf16 ? static_cast<const void*>(b.data() + offset)
                                             : static_cast<const void*>(v.data() + offset);
        std::vector<float> hm = {0.5f, 1.0f, 1.0f};  // amax, scale, scale_inv
        Buffer dm = test::to_device(hm);
        float* d = static_cast<float*>(dm.data());
        gpu->amax(TensorView(static_cast<char*>(dx.data()) + offset * es, {n}, dt, Device::cuda), d);
        gpu->scale_from_amax(d, d + 1, d + 2, 448.0f, 2);
        cpu->amax(TensorView(const_cast<void*>(hptr), {n}, dt, Device::cpu), &hm[0]);
        cpu->scale_from_amax(&hm[0], &hm[1], &hm[2], 448.0f, 2);
        const auto g = test::to_host<float>(d, 3);
        INFO("n " << n << " offset " << offset << " " << name_of(dt));
        CHECK(test::same_bits(g, hm));
      }
}

namespace {

struct GemmCase {
  int M, N, K;
  Format fx, fy;
  ops::Epilogue epi;
  bool bias, accumulate, fast;
};

// Runs one FP8 GEMM on the GPU and returns its relative error against double-precision products of
// the dequantised operands (and the error of the GELU pre-activation, when written).
std::pair<double, double> gemm_error(Fp8Ops& gpu, const GemmCase& c, std::uint64_t seed) {
  const auto xv = test::normal_values(static_cast<std::size_t>(c.M) * c.K, seed, 2.0f);
  const auto yv = test::normal_values(static_cast<std::size_t>(c.N) * c.K, seed + 1, 0.05f);
  const float sx = compute_scale(max_value(c.fx), test::max_abs(xv), 0, 1.0f);
  const float sy = compute_scale(max_value(c.fy), test::max_abs(yv), 0, 1.0f);
  std::vector<std::uint8_t> xq(xv.size()), yq(yv.size());
  for (std::size_t i = 0; i < xv.size(); ++i) xq[i] = quantize(xv[i], sx, c.fx);
  for (std::size_t i = 0; i < yv.size(); ++i) yq[i] = quantize(yv[i], sy, c.fy);
  const auto xd = test::fake_quantize(xv, sx, c.fx), yd = test::fake_quantize(yv, sy, c.fy);
  auto ref = test::matmul_nt(xd, yd, c.M, c.N, c.K);
  const std::size_t MN = static_cast<std::size_t>(c.M) * c.N;
  auto bias = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(c.N), seed + 2)));
  auto aux = from_bf16(to_bf16(test::normal_values(MN, seed + 3)));
  auto d0 = test::normal_values(MN, seed + 4);
  std::vector<float> pre;
  if (c.bias)
    for (std::size_t i = 0; i < MN; ++i) ref[i] += bias[i % static_cast<std::size_t>(c.N)];
  if (c.epi == ops::Epilogue::gelu) {
    pre = ref;
    for (auto& v : ref) v = ops::gelu(v);
  } else if (c.epi == ops::Epilogue::dgelu) {
    for (std::size_t i = 0; i < MN; ++i) ref[i] *= ops::gelu_grad(aux[i]);
  }
  if (c.accumulate)
    for (std::size_t i = 0; i < MN; ++i) ref[i] += d0[i];

  std::vector<float> scales = {1.0f / sx, 0, 0, 0, 1.0f / sy};  // 16-byte aligned, as cuBLASLt wants
  Buffer ds = test::to_device(scales), dxq = test::to_device(xq), dyq = test::to_device(yq), dbias = test::to_device(to_bf16(bias)),
         daux = test::to_device(to_bf16(aux));
  Buffer dd = c.accumulate ? test::to_device(d0) : Buffer(Device::cuda, MN * 2);
  GemmArgs g;
  g.x = TensorView(dxq.data(), {c.M, c.K}, dtype_of(c.fx), Device::cuda);
  g.x_scale_inv = static_cast<float*>(ds.data());
  g.y = TensorView(dyq.data(), {c.N, c.K}, dtype_of(c.fy), Device::cuda);
  g.y_scale_inv = static_cast<float*>(ds.data()) + 4;
  g.d = TensorView(dd.data(), {c.M, c.N}, c.accumulate ? DType::f32 : DType::bf16, Device::cuda);
  g.accumulate = c.accumulate;
  g.f32_result = c.accumulate;
  g.epilogue = c.epi;
  if (c.bias) g.bias = TensorView(dbias.data(), {c.N}, DType::bf16, Device::cuda);
  if (c.epi == ops::Epilogue::gelu || c.epi == ops::Epilogue::dgelu) g.aux = TensorView(daux.data(), {c.M, c.N}, DType::bf16, Device::cuda);
  g.fast_accum = c.fast;
  gpu.gemm(g);
  const auto got = c.accumulate ? test::to_host<float>(dd.data(), MN) : from_bf16(test::to_host<std::uint16_t>(dd.data(), MN));
  double pre_err = 0;
  if (c.epi == ops::Epilogue::gelu) pre_err = test::rel_error(from_bf16(test::to_host<std::uint16_t>(daux.data(), MN)), pre);
  return {test::rel_error(got, ref), pre_err};
}

}  // namespace

TEST_CASE("cuBLASLt FP8 GEMMs (forward, dgrad, wgrad) match products of the dequantised operands") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  // Bounds: bf16 outputs carry 2^-9 relative rounding per element (L2 error ~0.2-0.3%): 1e-2.
  // f32 wgrad outputs without fast accumulation: 2e-3. Forward with fast accumulation: 1e-2.
  const auto e4 = Format::e4m3, e5 = Format::e5m2;
  const GemmCase cases[] = {
      // forward: out[N, OC] = x[N, IC] W[OC, IC]^T, E4M3 x E4M3, fast accumulation, bias / GELU
      {256, 192, 320, e4, e4, ops::Epilogue::none, false, false, true},
      {256, 192, 320, e4, e4, ops::Epilogue::bias, true, false, true},
      {1024, 2304, 768, e4, e4, ops::Epilogue::bias, true, false, true},
      {512, 3072, 768, e4, e4, ops::Epilogue::gelu, true, false, true},
      {512, 1024, 256, e4, e4, ops::Epilogue::gelu, false, false, false},
      // dgrad: dx[N, IC] = dout[N, OC] W^T-copy[IC, OC]^T, E5M2 x E4M3, dGELU
      {512, 768, 2304, e5, e4, ops::Epilogue::none, false, false, false},
      {512, 3072, 768, e5, e4, ops::Epilogue::dgelu, false, false, false},
      {256, 96, 48, e4, e5, ops::Epilogue::none, false, false, false},
      // wgrad: dW[OC, IC] += dout^T[OC, N] x^T[IC, N]^T, f32 accumulated
      {768, 3072, 1024, e5, e4, ops::Epilogue::none, false, true, false},
      {2304, 768, 512, e5, e4, ops::Epilogue::none, false, true, false},
      {64, 48, 4096, e4, e4, ops::Epilogue::none, false, true, false},
  };
  std::uint64_t seed = 100;
  for (const auto& c : cases) {
    auto [err, pre_err] = gemm_error(*gpu, c, seed += 10);
    const double bound = c.accumulate ? 2e-3 : 1e-2;
    INFO("M " << c.M << " N " << c.N << " K " << c.K << " " << name_of(c.fx) << " x " << name_of(c.fy) << " epilogue "
              << static_cast<int>(c.epi) << (c.bias ? " +bias" : "") << (c.accumulate ? " accumulate" : "")
              << (c.fast ? " fast" : "") << ": relative error " << err << " (bound " << bound << "), pre-activation "
              << pre_err);
    CHECK(err < bound);
    CHECK(pre_err < 1e-2);
  }
  // Layout errors are named.
  GemmArgs bad;
  Buffer b(Device::cuda, 4096);
  float* one = static_cast<float*>(b.data());
  bad.x = TensorView(b.data(), {16, 24}, DType::e4m3, Device::cuda);
  bad.y = TensorView(b.data(), {16, 24}, DType::e4m3, Device::cuda);
  bad.d = TensorView(b.data(), {16, 16}, DType::bf16, Device::cuda);
  bad.x_scale_inv = bad.y_scale_inv = one;
  CHECK_THROWS_WITH_AS(gpu->gemm(bad), doctest::Contains("multiples of 16"), Error);
}

TEST_CASE("the CUDA transpose of one-byte codes matches the CPU at awkward shapes") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops();
  std::mt19937 gen(61);
  // Multiples of 16 take the 64 x 64 tiles of 16-byte words (whole and partial tiles: 2048 x 96,
  // 80 x 48, 16 x 16, 2048 x 6144 over more tiles than the grid's blocks); the rest a byte at a time.
  for (auto [rows, cols] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {1, 1}, {33, 65}, {7, 1000}, {2048, 96}, {130, 31}, {80, 48}, {16, 16}, {2048, 6144}}) {
    INFO(rows, " x ", cols);
    std::vector<std::uint8_t> in(static_cast<std::size_t>(rows * cols)), want(in.size());
    for (auto& b : in) b = static_cast<std::uint8_t>(gen());
    cpu->transpose(TensorView(want.data(), {cols, rows}, DType::e4m3, Device::cpu),
                   TensorView(in.data(), {rows, cols}, DType::e4m3, Device::cpu));
    for (std::int64_t r = 0; r < rows; ++r) REQUIRE(want[static_cast<std::size_t>(r)] == in[static_cast<std::size_t>(r * cols)]);
    Buffer din = test::to_device(in), dout(Device::cuda, in.size());
    gpu->transpose(TensorView(dout.data(), {cols, rows}, DType::e4m3, Device::cuda),
                   TensorView(din.data(), {rows, cols}, DType::e4m3, Device::cuda));
    CHECK(test::to_host<std::uint8_t>(dout.data(), in.size()) == want);
  }
}

TEST_CASE("the delayed scaling update kernel is bit-identical to the CPU") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops();
  std::uint64_t seed = 7;
  for (int len : {1, 7, 1024})
    for (int n : {1, 37, 300})
      for (int margin : {0, 2})
        for (AmaxAlgo algo : {AmaxAlgo::max, AmaxAlgo::most_recent}) {
          auto hist = test::random_amaxes(static_cast<std::size_t>(len * n), ++seed);
          auto scale = test::random_amaxes(static_cast<std::size_t>(n), ++seed);
          for (auto& s : scale) s = std::isfinite(s) && s > 0 ? s : 1.0f;
          std::vector<float> inv(static_cast<std::size_t>(n), 0.0f), fmax(static_cast<std::size_t>(n));
          for (int i = 0; i < n; ++i) fmax[static_cast<std::size_t>(i)] = i % 3 == 2 ? 57344.0f : 448.0f;
          Buffer dh = test::to_device(hist), ds = test::to_device(scale), di = test::to_device(inv), df = test::to_device(fmax);
          DelayedUpdateArgs a{static_cast<float*>(dh.data()), static_cast<float*>(ds.data()), static_cast<float*>(di.data()),
                              static_cast<const float*>(df.data()), len, n, algo, margin};
          gpu->update_delayed(a);
          DelayedUpdateArgs h{hist.data(), scale.data(), inv.data(), fmax.data(), len, n, algo, margin};
          cpu->update_delayed(h);
          INFO("len " << len << " n " << n << " margin " << margin);
          CHECK(test::same_bits(test::to_host<float>(dh.data(), hist.size()), hist));
          CHECK(test::same_bits(test::to_host<float>(ds.data(), scale.size()), scale));
          CHECK(test::same_bits(test::to_host<float>(di.data(), inv.size()), inv));
        }
}

TEST_CASE("an FP8 linear layer on CUDA matches the CPU emulation (forward, dgrad, wgrad, dbias)") {
  KILN_REQUIRE_CUDA();
  const std::int64_t N = 384, IC = 256, OC = 768;
  for (bool gelu : {false, true})
    for (auto kind : {RecipeKind::delayed, RecipeKind::current}) {
      // The same bf16-representable inputs on both sides; the CPU rounds its outputs to bf16.
      auto x = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(N * IC), 1, 2.0f)));
      auto w = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(OC * IC), 2, 0.05f)));
      auto b = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(OC), 3)));
      auto dout = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(N * OC), 4, 1e-4f)));
      auto pre = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(N * IC), 5)));
      struct Side {
        std::unique_ptr<Fp8Ops> ops;
        std::unique_ptr<Fp8MetaStore> meta;
        std::unique_ptr<Fp8Workspace> ws;
        std::unique_ptr<Fp8Linear> lin;
      };
      auto make = [&](std::unique_ptr<Fp8Ops> o) {
        Side s;
        s.ops = std::move(o);
        s.meta = std::make_unique<Fp8MetaStore>(*s.ops, std::vector<Format>{Format::e4m3, Format::e4m3, Format::e5m2}, 16);
        s.ws = std::make_unique<Fp8Workspace>(*s.ops);
        s.lin = std::make_unique<Fp8Linear>(*s.ops, *s.meta, 0, *s.ws, Fp8Recipe{kind, 16, AmaxAlgo::max, 0,
                                                                                 FormatPolicy::hybrid, true});
        return s;
      };
      Side cpu = make(make_cpu_ops({.round_bf16 = true})), gpu = make(make_cuda_ops(nullptr));
      std::vector<float> results[2][5];  // out, pre_gelu, dx, dw, db
      std::vector<float> scales[2];
      for (int side = 0; side < 2; ++side) {
        Side& s = side ? gpu : cpu;
        const bool dev = side == 1;
        const DType act = dev ? DType::bf16 : DType::f32;
        const Device where = dev ? Device::cuda : Device::cpu;
        std::vector<Buffer> keep;
        auto t = [&](const std::vector<float>& v, Shape shape) {
          keep.push_back(dev ? test::to_device(to_bf16(v)) : Buffer(Device::cpu, v.size() * 4));
          if (!dev) std::memcpy(keep.back().data(), v.data(), v.size() * 4);
          return TensorView(keep.back().data(), shape, act, where);
        };
        auto f32 = [&](std::size_t n, float fill) {
          std::vector<float> v(n, fill);
          keep.push_back(dev ? test::to_device(v) : Buffer(Device::cpu, n * 4));
          if (!dev) std::memcpy(keep.back().data(), v.data(), n * 4);
          return TensorView(keep.back().data(), {static_cast<std::int64_t>(n)}, DType::f32, where);
        };
        std::vector<float> zeros_out(static_cast<std::size_t>(N * OC)), zeros_in(static_cast<std::size_t>(N * IC));
        TensorView tx = t(x, {N, IC}), tw = t(w, {OC, IC}), tb = t(b, {OC}), tout = t(zeros_out, {N, OC}),
                   tpre = t(zeros_out, {N, OC}), tdout = t(dout, {N, OC}), tdx = t(zeros_in, {N, IC}),
                   tgpre = t(pre, {N, IC});
        TensorView tdw = f32(static_cast<std::size_t>(OC * IC), 0.5f).reshape({OC, IC}), tdb = f32(static_cast<std::size_t>(OC), 0.0f);
        s.lin->forward({tout, gelu ? tpre : TensorView{}, tx, tw, tb}, 1);
        s.lin->backward({tdx, tdw, tdb, tdout, tx, tw, gelu ? tgpre : TensorView{}});
        auto get = [&](const TensorView& v) {
          if (!dev) return std::vector<float>(v.as<float>(), v.as<float>() + v.numel());
          if (v.dtype == DType::f32) return test::to_host<float>(v.data, static_cast<std::size_t>(v.numel()));
          return from_bf16(test::to_host<std::uint16_t>(v.data, static_cast<std::size_t>(v.numel())));
        };
        results[side][0] = get(tout);
        results[side][1] = get(tpre);
        results[side][2] = get(tdx);
        results[side][3] = get(tdw);
        results[side][4] = get(tdb);
        // The scales come from identical data: identical bits.
        const TensorView sv = s.meta->scales();
        scales[side] = dev ? test::to_host<float>(sv.data, 3) : std::vector<float>(sv.as<float>(), sv.as<float>() + 3);
      }
      const char* names[] = {"out", "pre_gelu", "dx", "dweight", "dbias"};
      for (int k = 0; k < 5; ++k) {
        if (k == 1 && !gelu) continue;
        const double err = test::rel_error(results[1][k], results[0][k]);
        INFO("gelu " << gelu << " recipe " << static_cast<int>(kind) << " " << names[k] << ": relative error " << err);
        CHECK(err < 1e-2);
      }
      CHECK(test::same_bits(scales[1], scales[0]));
    }
}

namespace {
const char* const kModel = test::kSmallGpuModel;
}  // namespace

TEST_CASE("a whole FP8 training step on CUDA matches the CPU emulation, and is deterministic") {
  KILN_REQUIRE_CUDA();
  // GPT-2 (GELU and LayerNorm computed while quantising) and Llama (SwiGLU computed while quantising
  // FC2's input, its backward while quantising FC1's output gradient, grouped-query attention);
  // block scaling (Fp8BlockLinear: the same operands on load, the epilogues after its GEMMs; and with
  // the weight gradient's input in 128x128 blocks) in both; and the LM head in FP8 too (delayed
  // scaling: its cross-entropy gradient made as its logits are quantised).
  for (const bool llama : {false, true})
  for (const std::string recipe : {"delayed", "current", "block", "block-2d", "delayed-head"}) {
    INFO((llama ? "llama " : "gpt2 ") << recipe);
    const bool two_d = recipe == "block-2d", head = recipe == "delayed-head";
    const std::string fp8 = "fp8.enabled=true",
                      r = "fp8.recipe=" + (two_d ? std::string("block") : head ? std::string("delayed") : recipe);
    auto sets = [&](const char* device) {
      std::vector<std::string> v{std::string("engine.device=") + device, fp8, r};
      if (two_d) v.push_back("fp8.block_2d_wgrad_input=true");
      if (head) v.push_back("fp8.lm_head=true");
      if (llama) v.insert(v.end(), {"model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=320"});
      return v;
    };
    auto cpu_sets = sets("cpu");
    cpu_sets.push_back("backend.cpu_round_bf16=true");
    test::Pipeline cpu(kModel, cpu_sets);
    test::Pipeline gpu(kModel, sets("cuda"));
    test::Pipeline again(kModel, sets("cuda"));
    test::RunRecord runs[3];
    int i = 0;
    for (auto* p : {&cpu, &gpu, &again}) {
      runs[i++] = test::run_recording(*p);
      CHECK(p->world->resource<fp8::Fp8State>().entities.size() == (head ? 9u : 8u));
    }
    const auto &c = runs[0], &g = runs[1];
    INFO(recipe << ": step-1 losses cpu " << c.losses[0] << " gpu " << g.losses[0]);
    CHECK(g.losses[0] == doctest::Approx(c.losses[0]).epsilon(5e-3));
    const double gerr = test::rel_error(g.step1_grads, c.step1_grads);
    INFO("gradient relative error " << gerr);
    // FP8 codes flip where the two backends' bf16 activations differ by an ulp, and an E5M2 gradient
    // code is 12.5% apart from its neighbour: measured 6.4% relative L2 on an H200 (2026-11-21).
    CHECK(gerr < 1e-1);
    for (std::size_t s = 0; s < c.losses.size(); ++s) CHECK(g.losses[s] == doctest::Approx(c.losses[s]).epsilon(2e-2));
    CHECK(runs[2].losses == g.losses);  // bit-identical reruns
    CHECK(test::same_bits(runs[2].step1_grads, g.step1_grads));
  }
}

// ---------------------------------------------------------------------------------------------------
// A mixture of experts' grouped FP8 operands, the grouped GEMMs and the grouped layer.

namespace {

// The FP8 outputs of one batched or grouped quantisation on both sides: rowwise (copies & 1) and
// colwise (copies & 2) codes of the given shapes, every byte starting at 0xaa on both sides (so the
// codes a kernel must write, the padding's included, are all checked), and {scale, amax}.
struct CodesOnBoth {
  std::size_t n_row, n_col;
  std::vector<std::uint8_t> c_row, c_col;
  Buffer d_row, d_col;
  std::vector<float> c_meta;
  Buffer d_meta;
  Fp8TensorView c, g;
  CodesOnBoth(Shape row_shape, Shape col_shape, int copies, Format f, float scale, float amax0)
      : n_row(static_cast<std::size_t>(row_shape.numel())),
        n_col(static_cast<std::size_t>(col_shape.numel())),
        c_row(n_row, 0xaa),
        c_col(n_col, 0xaa),
        d_row(test::to_device(c_row)),
        d_col(test::to_device(c_col)),
        c_meta{scale, amax0},
        d_meta(test::to_device(c_meta)) {
    if (copies & 1) {
      c.rowwise = TensorView(c_row.data(), row_shape, dtype_of(f), Device::cpu);
      g.rowwise = TensorView(d_row.data(), row_shape, dtype_of(f), Device::cuda);
    }
    if (copies & 2) {
      c.colwise = TensorView(c_col.data(), col_shape, dtype_of(f), Device::cpu);
      g.colwise = TensorView(d_col.data(), col_shape, dtype_of(f), Device::cuda);
    }
    c.format = g.format = f;
    c.scale = &c_meta[0];
    g.scale = static_cast<float*>(d_meta.data());
  }
  float* cpu_amax(bool on) { return on ? &c_meta[1] : nullptr; }
  float* gpu_amax(bool on) { return on ? static_cast<float*>(d_meta.data()) + 1 : nullptr; }
  // "" when every byte and the amax's bits agree; else the first difference.
  std::string differences() {
    std::string first;
    std::size_t count = 0;
    auto cmp = [&](const std::vector<std::uint8_t>& want, const Buffer& dev, const char* which) {
      const std::size_t n = want.size();
      const auto got = test::to_host<std::uint8_t>(dev.data(), n);
      for (std::size_t i = 0; i < n; ++i)
        if (got[i] != want[i] && count++ == 0)
          first = cat(which, " byte ", i, ": gpu 0x", std::hex, int(got[i]), " cpu 0x", int(want[i]), std::dec);
    };
    cmp(c_row, d_row, "rowwise");
    cmp(c_col, d_col, "colwise");
    const auto meta = test::to_host<float>(d_meta.data(), 2);
    if (float_bits(meta[1]) != float_bits(c_meta[1]) && count++ == 0) first = cat("amax: gpu ", meta[1], " cpu ", c_meta[1]);
    return count ? cat(count, " differences, first: ", first) : std::string();
  }
};

// A grouping of R rows: expert e's rows are [off[e], off[e + 1]); rows from off[E] on belong to none.
struct Grouping {
  std::vector<std::int32_t> off;
  std::int64_t R;
  int experts() const { return static_cast<int>(off.size()) - 1; }
};
// 70 experts of 0 to 6 rows: more than a kernel's parameters hold (cuda::kInlinePlanExperts), so
// its plan is copied to the device.
Grouping many_experts() {
  Grouping g{{0}, 0};
  for (int e = 0; e < 70; ++e) g.off.push_back(g.off.back() + (e * 5) % 7);
  g.R = g.off.back() + 3;
  return g;
}
// Three experts, one empty, rows past the experts'; five experts, one empty, one of a single row;
// four experts of 64, 0, 86 and 1 rows (several 64-row tiles, one expert exactly a tile); 70 experts.
const Grouping kGroupings[] = {
    {{0, 5, 5, 16}, 19}, {{0, 13, 13, 40, 41, 70}, 74}, {{0, 64, 64, 150, 151}, 160}, many_experts()};

}  // namespace

TEST_CASE("the batched quantize of [B, rows, cols] (each slice transposed on its own) matches the CPU bit for bit") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops();
  const std::int64_t B = 3;
  // Tiled (rows and cols multiples of 16, partial 64-tiles) and elementwise (cols 40, 72; [33, 47]).
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{16, 40}, {48, 72}, {48, 80}, {64, 144}, {80, 96}, {33, 47}};
  std::uint64_t seed = 6000;
  for (auto [R, C] : shapes)
    for (DType dt : {DType::bf16, DType::f32})
      for (Format f : {Format::e4m3, Format::e5m2})
        for (int copies = 0; copies <= 3; ++copies)
          for (bool with_amax : {false, true}) {
            INFO("[" << B << "," << R << "," << C << "] " << std::string(name_of(dt)) << " "
                     << std::string(name_of(f)) << " copies " << copies << " amax " << with_amax);
            const std::size_t n = static_cast<std::size_t>(B * R * C);
            auto v = test::normal_values(n, ++seed, 3.0f);
            v[n / 2] = -400.0f;  // saturates e4m3 at this scale
            const auto b = to_bf16(v);
            if (dt == DType::bf16) v = from_bf16(b);
            CodesOnBoth o({B, R, C}, {B, C, R}, copies, f, 1.7f, 0.125f);
            Buffer dx = dt == DType::bf16 ? test::to_device(b) : test::to_device(v);
            void* host = dt == DType::bf16 ? static_cast<void*>(const_cast<std::uint16_t*>(b.data())) : v.data();
            cpu->quantize(TensorView(host, {B, R, C}, dt, Device::cpu), o.c, o.cpu_amax(with_amax));
            gpu->quantize(TensorView(dx.data(), {B, R, C}, dt, Device::cuda), o.g, o.gpu_amax(with_amax));
            const std::string diff = o.differences();
            INFO(diff);
            CHECK(diff.empty());
          }
}

TEST_CASE("the grouped quantisation (rows as they are, each expert's transpose padded to 16) matches the CPU bit for bit") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops();
  std::uint64_t seed = 7000;
  CHECK(many_experts().experts() > kiln::fp8::cuda::kInlinePlanExperts);  // one plan goes through device memory
  // Columns 80 and 144: the tiled kernel; 40 and 72: the elementwise one.
  for (const Grouping& gr : kGroupings)
    for (std::int64_t C : {40, 72, 80, 144})
      for (Format f : {Format::e4m3, Format::e5m2})
        for (int copies = 0; copies <= 3; ++copies)
          for (bool with_amax : {false, true})
            for (DType dt : {DType::bf16, DType::f32}) {
              if (dt == DType::f32 && C != 80) continue;
              const int E = gr.experts();
              const std::int64_t R = gr.R, used = gr.off[static_cast<std::size_t>(E)],
                                 S = segment_row(gr.off.data(), E);
              INFO(E << " experts, R " << R << ", cols " << C << " " << std::string(name_of(dt)) << " "
                     << std::string(name_of(f)) << " copies " << copies << " amax " << with_amax);
              const std::size_t n = static_cast<std::size_t>(R * C);
              auto v = test::normal_values(n, ++seed, 2.0f);
              v[static_cast<std::size_t>(used * C + 1)] = 1000.0f;  // past the experts' rows
              const auto b = to_bf16(v);
              if (dt == DType::bf16) v = from_bf16(b);
              CodesOnBoth o({used, C}, {S * C}, copies, f, 40.0f, 0.0f);
              Buffer dx = dt == DType::bf16 ? test::to_device(b) : test::to_device(v);
              void* host = dt == DType::bf16 ? static_cast<void*>(const_cast<std::uint16_t*>(b.data())) : v.data();
              cpu->quantize_grouped({TensorView(host, {R, C}, dt, Device::cpu), gr.off.data(), E, o.c,
                                     o.cpu_amax(with_amax)});
              gpu->quantize_grouped({TensorView(dx.data(), {R, C}, dt, Device::cuda), gr.off.data(), E, o.g,
                                     o.gpu_amax(with_amax)});
              const std::string diff = o.differences();
              INFO(diff);
              CHECK(diff.empty());
              if (with_amax) CHECK(o.c_meta[1] < 1000.0f);  // the rows past the experts' are not in it
            }
  // The offsets are checked on the host: a decreasing one is named.
  const std::vector<std::int32_t> off = {0, 20, 12};
  Buffer dx(Device::cuda, 24 * 16 * 2), dq(Device::cuda, 24 * 16);
  std::vector<float> meta = {1.0f};
  Buffer dm = test::to_device(meta);
  Fp8TensorView out;
  out.rowwise = TensorView(dq.data(), {12, 16}, DType::e4m3, Device::cuda);
  out.scale = static_cast<float*>(dm.data());
  CHECK_THROWS_WITH_AS(gpu->quantize_grouped({TensorView(dx.data(), {24, 16}, DType::bf16, Device::cuda), off.data(), 2,
                                              out, nullptr}),
                       doctest::Contains("offsets decrease at expert 1"), Error);
}

TEST_CASE("the grouped quantisation of an activation or its gradient computed on load equals quantising the "
          "activation op's output, bit for bit, and the CPU's") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops({.round_bf16 = true});
  enum class Src { gelu, swiglu, dgelu, dswiglu };
  std::uint64_t seed = 7500;
  for (const Grouping& gr : kGroupings)
    for (Src src : {Src::gelu, Src::swiglu, Src::dgelu, Src::dswiglu})
      // Output columns: 80 and 160 tiled with a partial column tile (dswiglu: 160 loads 80 of them,
      // swiglu 80 from 160), 96 tiled (dswiglu loads 48), 40 and 72 elementwise (dswiglu: 36 loaded).
      for (std::int64_t C : {40, 72, 80, 96, 160})
        for (int copies = 0; copies <= 3; ++copies) {
          const int E = gr.experts();
          const std::int64_t R = gr.R, used = gr.off[static_cast<std::size_t>(E)], S = segment_row(gr.off.data(), E);
          INFO(E << " experts, R " << R << ", cols " << C << ", source " << int(src) << ", copies " << copies);
          // The tensors the values come from, bf16 on the device and their f32 values on the host.
          const std::int64_t in_cols = src == Src::swiglu ? 2 * C : C, grad_cols = src == Src::dswiglu ? C / 2 : C;
          const auto in_b = to_bf16(test::normal_values(static_cast<std::size_t>(R * in_cols), ++seed, 2.5f));
          const auto grad_b = to_bf16(test::normal_values(static_cast<std::size_t>(R * grad_cols), ++seed, 0.5f));
          auto in_f = from_bf16(in_b), grad_f = from_bf16(grad_b);
          Buffer d_in = test::to_device(in_b), d_grad = test::to_device(grad_b), d_vals(Device::cuda, static_cast<std::size_t>(R * C) * 2);
          const TensorView hin(in_f.data(), {R, in_cols}, DType::f32, Device::cpu),
              din(d_in.data(), {R, in_cols}, DType::bf16, Device::cuda),
              hgrad(grad_f.data(), {R, grad_cols}, DType::f32, Device::cpu),
              dgrad(d_grad.data(), {R, grad_cols}, DType::bf16, Device::cuda);
          GroupedSource hs, ds;
          auto* vals = static_cast<kiln::cuda::bf16*>(d_vals.data());
          const auto* in = static_cast<const kiln::cuda::bf16*>(d_in.data());
          const auto* g = static_cast<const kiln::cuda::bf16*>(d_grad.data());
          switch (src) {  // the unfused op's output on the device, and the two sources
            case Src::gelu:
              kiln::cuda::gelu_forward(vals, in, R * C, nullptr);
              hs = ops::GeluOnLoad{hin}, ds = ops::GeluOnLoad{din};
              break;
            case Src::swiglu:
              kiln::cuda::swiglu_forward(vals, in, R, static_cast<int>(C), nullptr);
              hs = ops::SwigluOnLoad{hin}, ds = ops::SwigluOnLoad{din};
              break;
            case Src::dgelu:
              kiln::cuda::gelu_backward(vals, g, in, R * C, nullptr);
              hs = ops::DgeluOnLoad{hgrad, hin}, ds = ops::DgeluOnLoad{dgrad, din};
              break;
            case Src::dswiglu:
              kiln::cuda::swiglu_backward(vals, g, in, R, static_cast<int>(C / 2), nullptr);
              hs = ops::DswigluOnLoad{hgrad, hin}, ds = ops::DswigluOnLoad{dgrad, din};
              break;
          }
          CodesOnBoth fused({used, C}, {S * C}, copies, Format::e4m3, 30.0f, 0.0f),
              unfused({used, C}, {S * C}, copies, Format::e4m3, 30.0f, 0.0f),
              host({used, C}, {S * C}, copies, Format::e4m3, 30.0f, 0.0f);
          gpu->quantize_grouped({ds, gr.off.data(), E, fused.g, fused.gpu_amax(true)});
          gpu->quantize_grouped({TensorView(d_vals.data(), {R, C}, DType::bf16, Device::cuda), gr.off.data(), E,
                                 unfused.g, unfused.gpu_amax(true)});
          cpu->quantize_grouped({hs, gr.off.data(), E, host.c, host.cpu_amax(true)});
          // Bit for bit against the unfused path on the device.
          CHECK(test::to_host<std::uint8_t>(fused.d_row.data(), fused.n_row) ==
                test::to_host<std::uint8_t>(unfused.d_row.data(), unfused.n_row));
          CHECK(test::to_host<std::uint8_t>(fused.d_col.data(), fused.n_col) ==
                test::to_host<std::uint8_t>(unfused.d_col.data(), unfused.n_col));
          const float amax = test::to_host<float>(fused.d_meta.data(), 2)[1];
          CHECK(float_bits(amax) == float_bits(test::to_host<float>(unfused.d_meta.data(), 2)[1]));
          CHECK(amax > 0.0f);
          // Near the CPU's (the device's exp and division differ from the host's in the last bits).
          CodeDiff d;
          if (copies & 1) d.add(host.c_row, fused.d_row.data());
          if (copies & 2) d.add(host.c_col, fused.d_col.data());
          CHECK(d.far == 0);
          CHECK(d.differ <= (fused.n_row + fused.n_col) / 500 + 2);
          CHECK(amax == doctest::Approx(host.c_meta[1]).epsilon(1e-2));
        }
}

namespace {

struct GroupedGemmCase {
  std::vector<std::int64_t> M;  // each product's rows (0: none)
  std::int64_t N, K;
  Format fx, fy;
  bool f32_result, accumulate, fast;
};

// The products of one gemm_grouped call on the GPU against double-precision products of the
// dequantised operands (plus D's old values when accumulating); returns the relative L2 error over
// all of them and, in *bits, the results' bits (to compare runs).
double grouped_gemm_error(Fp8Ops& gpu, const GroupedGemmCase& c, std::uint64_t seed, std::vector<float>* bits) {
  std::vector<GemmArgs> gs;
  std::vector<Buffer> keep;
  std::vector<float> ref, got;
  std::vector<std::pair<Buffer*, std::size_t>> outs;
  std::vector<float> scales(8 * c.M.size() + 8);
  struct Product {
    std::size_t d, n;
  };
  std::vector<Product> products;
  keep.reserve(4 * c.M.size() + 1);
  for (std::size_t i = 0; i < c.M.size(); ++i) {
    const std::int64_t M = c.M[i];
    const std::size_t xs = static_cast<std::size_t>(M * c.K), ys = static_cast<std::size_t>(c.N * c.K),
                      ds = static_cast<std::size_t>(M * c.N);
    const auto xv = test::normal_values(xs, seed + 10 * i, 2.0f), yv = test::normal_values(ys, seed + 10 * i + 1, 0.05f);
    const float sx = compute_scale(max_value(c.fx), std::max(test::max_abs(xv), 1e-3f), 0, 1.0f);
    const float sy = compute_scale(max_value(c.fy), test::max_abs(yv), 0, 1.0f);
    std::vector<std::uint8_t> xq(xs), yq(ys);
    for (std::size_t j = 0; j < xs; ++j) xq[j] = quantize(xv[j], sx, c.fx);
    for (std::size_t j = 0; j < ys; ++j) yq[j] = quantize(yv[j], sy, c.fy);
    const auto p = test::matmul_nt(test::fake_quantize(xv, sx, c.fx), test::fake_quantize(yv, sy, c.fy),
                                   static_cast<int>(M), static_cast<int>(c.N), static_cast<int>(c.K));
    const auto d0 = test::normal_values(ds, seed + 10 * i + 2);
    for (std::size_t j = 0; j < ds; ++j) ref.push_back(p[j] + (c.accumulate ? d0[j] : 0.0f));
    scales[8 * i] = 1.0f / sx;  // 16-byte aligned, as cuBLASLt wants
    scales[8 * i + 4] = 1.0f / sy;
    keep.push_back(test::to_device(xq.empty() ? std::vector<std::uint8_t>(16) : xq));
    keep.push_back(test::to_device(yq));
    keep.push_back(c.f32_result ? test::to_device(d0.empty() ? std::vector<float>(4) : d0)
                                : test::to_device(to_bf16(d0.empty() ? std::vector<float>(8) : d0)));
    products.push_back({keep.size() - 1, ds});
    GemmArgs g;
    g.x = TensorView(keep[keep.size() - 3].data(), {M, c.K}, dtype_of(c.fx), Device::cuda);
    g.y = TensorView(keep[keep.size() - 2].data(), {c.N, c.K}, dtype_of(c.fy), Device::cuda);
    g.d = TensorView(keep.back().data(), {M, c.N}, c.f32_result ? DType::f32 : DType::bf16, Device::cuda);
    g.f32_result = c.f32_result;
    g.accumulate = c.accumulate;
    g.fast_accum = c.fast;
    gs.push_back(g);
  }
  keep.push_back(test::to_device(scales));
  for (std::size_t i = 0; i < gs.size(); ++i) {
    gs[i].x_scale_inv = static_cast<float*>(keep.back().data()) + 8 * i;
    gs[i].y_scale_inv = static_cast<float*>(keep.back().data()) + 8 * i + 4;
  }
  gpu.gemm_grouped(gs);
  for (const Product& p : products) {
    const auto v = c.f32_result ? test::to_host<float>(keep[p.d].data(), p.n)
                                : from_bf16(test::to_host<std::uint16_t>(keep[p.d].data(), p.n));
    got.insert(got.end(), v.begin(), v.end());
  }
  if (bits) *bits = got;
  return test::rel_error(got, ref);
}

}  // namespace

TEST_CASE("grouped FP8 GEMMs (one cuBLASLt matmul per expert, over several streams) match products of the dequantised "
          "operands, at any row count, deterministically") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  const auto e4 = Format::e4m3, e5 = Format::e5m2;
  // The grouped layer's products: forward E4M3 x E4M3 (bf16, fast accumulation) and dgrad E5M2 x
  // E4M3 (bf16) over rows that are no multiple of 16 (and an expert without rows); wgrad E5M2 x E4M3
  // (f32, written or accumulated) with K the padded rows (16, 48); more products than streams.
  const GroupedGemmCase cases[] = {
      {{37, 0, 100, 1, 64}, 80, 64, e4, e4, false, false, true},
      {{5, 130, 16}, 144, 48, e5, e4, false, false, false},
      {{80, 64, 48}, 64, 48, e5, e4, true, false, false},
      {{80, 80}, 64, 16, e5, e4, true, true, false},
      {{64, 48, 32, 16, 96, 112}, 48, 48, e4, e5, true, true, false},
  };
  std::uint64_t seed = 9000;
  for (const auto& c : cases) {
    std::vector<float> first, second;
    const double err = grouped_gemm_error(*gpu, c, seed += 100, &first);
    const double bound = c.f32_result ? 2e-3 : 1e-2;
    MESSAGE("grouped FP8 GEMM of " << c.M.size() << " products, N " << c.N << " K " << c.K << " "
                                   << std::string(name_of(c.fx)) << " x " << std::string(name_of(c.fy))
                                   << std::string(c.f32_result ? " f32" : " bf16") << std::string(c.accumulate ? " accumulate" : "")
                                   << std::string(c.fast ? " fast" : "") << ": relative error " << err << " (bound "
                                   << bound << ")");
    CHECK(err < bound);
    grouped_gemm_error(*gpu, c, seed, &second);
    CHECK(test::same_bits(first, second));
  }
  // The products take no epilogue.
  Buffer b(Device::cuda, 1 << 16);
  GemmArgs bad;
  bad.x = TensorView(b.data(), {16, 16}, DType::e4m3, Device::cuda);
  bad.y = TensorView(b.data(), {16, 16}, DType::e4m3, Device::cuda);
  bad.d = TensorView(b.data(), {16, 16}, DType::bf16, Device::cuda);
  bad.x_scale_inv = bad.y_scale_inv = static_cast<float*>(b.data());
  bad.epilogue = ops::Epilogue::gelu;
  bad.aux = bad.d;
  CHECK_THROWS_WITH_AS(gpu->gemm_grouped(std::span<const GemmArgs>(&bad, 1)), doctest::Contains("no epilogue"), Error);
}

TEST_CASE("an FP8 grouped (expert) linear on CUDA matches the CPU emulation (both layouts and recipes, dweight "
          "written and added)") {
  KILN_REQUIRE_CUDA();
  const int E = 4;
  const std::int64_t R = 107, IC = 64, OC = 96;
  const std::vector<std::int32_t> off = {0, 37, 37, 70, 101};  // an expert without rows, rows past the experts'
  for (const bool in_out : {false, true})
    for (const auto kind : {RecipeKind::delayed, RecipeKind::current}) {
      INFO("weight_in_out " << in_out << " recipe " << std::string(kind == RecipeKind::delayed ? "delayed" : "current"));
      const Shape wshape = in_out ? Shape{E, IC, OC} : Shape{E, OC, IC};
      const auto x = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(R * IC), 21, 2.0f)));
      const auto w = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(E * OC * IC), 22, 0.05f)));
      const auto dout = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(R * OC), 23, 1e-3f)));
      struct Side {
        std::unique_ptr<Fp8Ops> ops;
        std::unique_ptr<Fp8MetaStore> meta;
        std::unique_ptr<Fp8Workspace> ws;
        std::unique_ptr<Fp8GroupedLinear> lin;
      };
      auto make = [&](std::unique_ptr<Fp8Ops> o) {
        Side s;
        s.ops = std::move(o);
        s.meta = std::make_unique<Fp8MetaStore>(*s.ops, std::vector<Format>{Format::e4m3, Format::e4m3, Format::e5m2},
                                                kind == RecipeKind::delayed ? 16 : 1);
        s.ws = std::make_unique<Fp8Workspace>(*s.ops);
        s.lin = std::make_unique<Fp8GroupedLinear>(*s.ops, *s.meta, 0, *s.ws,
                                                   Fp8Recipe{kind, 16, AmaxAlgo::max, 0, FormatPolicy::hybrid, true},
                                                   "test.experts");
        return s;
      };
      Side cpu = make(make_cpu_ops({.round_bf16 = true})), gpu = make(make_cuda_ops(nullptr));
      std::vector<float> results[2][4];  // out, dx, dweight written, dweight added to
      std::vector<float> meta[2];        // the amax history, the scales, the current amaxes
      for (int side = 0; side < 2; ++side) {
        Side& s = side ? gpu : cpu;
        const bool dev = side == 1;
        const DType act = dev ? DType::bf16 : DType::f32;
        const Device where = dev ? Device::cuda : Device::cpu;
        std::vector<Buffer> keep;
        auto t = [&](const std::vector<float>& v, Shape shape) {
          keep.push_back(dev ? test::to_device(to_bf16(v)) : Buffer(Device::cpu, v.size() * 4));
          if (!dev) std::memcpy(keep.back().data(), v.data(), v.size() * 4);
          return TensorView(keep.back().data(), shape, act, where);
        };
        auto f32 = [&](std::size_t n, float fill, Shape shape) {
          std::vector<float> v(n, fill);
          keep.push_back(dev ? test::to_device(v) : Buffer(Device::cpu, n * 4));
          if (!dev) std::memcpy(keep.back().data(), v.data(), n * 4);
          return TensorView(keep.back().data(), shape, DType::f32, where);
        };
        auto get = [&](const TensorView& v) {
          if (!dev) return std::vector<float>(v.as<float>(), v.as<float>() + v.numel());
          if (v.dtype == DType::f32) return test::to_host<float>(v.data, static_cast<std::size_t>(v.numel()));
          return from_bf16(test::to_host<std::uint16_t>(v.data, static_cast<std::size_t>(v.numel())));
        };
        const TensorView tx = t(x, {R, IC}), tw = t(w, wshape), tdout = t(dout, {R, OC}),
                         tout = t(std::vector<float>(static_cast<std::size_t>(R * OC), 7.0f), {R, OC}),
                         tdx = t(std::vector<float>(static_cast<std::size_t>(R * IC), 3.0f), {R, IC});
        const TensorView tdw = f32(static_cast<std::size_t>(E * OC * IC), 0.5f, wshape);
        s.lin->forward({tout, tx, tw, off.data(), in_out}, 1);
        s.lin->backward({.dx = tdx,
                         .dweight = tdw,
                         .dout = tdout,
                         .x = tx,
                         .weight = tw,
                         .offsets_host = off.data(),
                         .weight_in_out = in_out,
                         .dweight_overwrite = true});
        results[side][0] = get(tout);
        results[side][1] = get(tdx);
        results[side][2] = get(tdw);
        s.lin->backward({.dweight = tdw,
                         .dout = tdout,
                         .x = tx,
                         .weight = tw,
                         .offsets_host = off.data(),
                         .weight_in_out = in_out});
        results[side][3] = get(tdw);
        for (const TensorView& m : {s.meta->history(), s.meta->scales(), s.meta->amaxes_now()}) {
          const auto v = dev ? test::to_host<float>(m.data, static_cast<std::size_t>(m.numel()))
                             : std::vector<float>(m.as<float>(), m.as<float>() + m.numel());
          meta[side].insert(meta[side].end(), v.begin(), v.end());
        }
      }
      const char* names[] = {"out", "dx", "dweight written", "dweight added to"};
      for (int k = 0; k < 4; ++k) {
        const double err = test::rel_error(results[1][k], results[0][k]);
        MESSAGE("grouped linear (weight_in_out " << in_out << ", "
                                                 << std::string(kind == RecipeKind::delayed ? "delayed" : "current")
                                                 << ") " << std::string(names[k]) << ": relative error " << err);
        CHECK(err < (k < 2 ? 1e-2 : 1e-3));  // bf16 outputs; f32 weight gradients (same codes, other sums)
      }
      // Rows past the experts': the output left alone, the data gradient zero.
      CHECK(results[1][0][static_cast<std::size_t>((R - 1) * OC)] == 7.0f);
      CHECK(results[1][1][static_cast<std::size_t>((R - 1) * IC)] == 0.0f);
      // The scales and amaxes come from identical data: identical bits.
      CHECK(test::same_bits(meta[1], meta[0]));
    }
}

TEST_CASE("a whole mixture-of-experts FP8 training step on CUDA matches the CPU emulation, and is deterministic") {
  KILN_REQUIRE_CUDA();
  // GELU experts (GPT-2) and SwiGLU experts (Llama), every block's experts' linears in FP8: per-tensor
  // (delayed, current) and block scaling (Fp8BlockGroupedLinear).
  const std::vector<std::vector<std::string>> configs = {
      {"model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.hidden=256"},
      {"model.arch=llama", "model.n_kv_head=2", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.hidden=256"}};
  for (const auto& config : configs)
    for (const char* recipe : {"delayed", "current", "block"}) {
      std::string what;
      for (const auto& s : config) what += s + " ";
      what += std::string("fp8.recipe=") + recipe;
      const bool block = std::string(recipe) == "block";
      INFO(what);
      auto sets = [&](const char* device) {
        std::vector<std::string> v{std::string("engine.device=") + device, "fp8.enabled=true",
                                   std::string("fp8.recipe=") + recipe};
        v.insert(v.end(), config.begin(), config.end());
        return v;
      };
      auto cpu_sets = sets("cpu");
      cpu_sets.push_back("backend.cpu_round_bf16=true");
      test::Pipeline cpu(kModel, cpu_sets);
      test::Pipeline gpu(kModel, sets("cuda"));
      test::Pipeline again(kModel, sets("cuda"));
      test::RunRecord runs[3];
      int i = 0;
      for (auto* p : {&cpu, &gpu, &again}) {
        runs[i++] = test::run_recording(*p);
        // Every block's grouped (expert) linears run in FP8, on either device.
        const auto& st = p->world->resource<fp8::Fp8State>();
        const std::size_t layers = block ? st.block_grouped.size() : st.grouped.size();
        CHECK(layers > 0);
        CHECK(layers == p->world->view<nn::GroupedLinear>().size());
      }
      const auto &c = runs[0], &g = runs[1];
      const double gerr = test::rel_error(g.step1_grads, c.step1_grads);
      MESSAGE(what << ": step-1 loss cpu " << c.losses[0] << " gpu " << g.losses[0] << ", gradient relative error "
                   << gerr << ", last loss cpu " << c.losses.back() << " gpu " << g.losses.back());
      // A token near a routing tie may take another expert on one device (bf16 against f32
      // activations), on top of the FP8 codes that flip where the devices' activations differ by an
      // ulp (an E5M2 gradient code is 12.5% from its neighbour): measured on an H200 (2026-11-25) a
      // step-1 gradient 5.5% (GELU experts) and 5.2% (SwiGLU) relative L2 apart, losses within 2e-4.
      for (std::size_t s = 0; s < c.losses.size(); ++s) CHECK(g.losses[s] == doctest::Approx(c.losses[s]).epsilon(1e-2));
      CHECK(gerr < 8e-2);
      CHECK(runs[2].losses == g.losses);  // bit-identical reruns
      CHECK(test::same_bits(runs[2].step1_grads, g.step1_grads));
    }
}

// ---------------------------------------------------------------------------------------------
// bf16 parameter gradients (optim.grads = "bf16"): the wgrad GEMM, quantize_grad's and bias_grad's
// bias sums onto an old bf16 value, rounded once (the GEMM's accumulating kernel: see the weight
// gradient's case), against the CPU emulation. The sides' f32 sums differ only in order, so an
// element may land one bf16 step apart: checked within two bf16 ulps of the CPU's value (with a floor
// for elements that nearly cancel).

namespace {

// `floor`: of the largest value, the error allowed where an element nearly cancels (by default two
// bf16 ulps of a thousandth of it).
void check_bf16_ulps(const std::vector<float>& gpu, const std::vector<float>& cpu, const char* what,
                     float floor = 2e-3f / 128) {
  REQUIRE(gpu.size() == cpu.size());
  float top = 0;
  for (float v : cpu) top = std::max(top, std::fabs(v));
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    const float tol = std::max(2.0f * std::ldexp(1.0f, -7) * std::fabs(cpu[i]), floor * top);
    if (!(std::fabs(gpu[i] - cpu[i]) <= tol) && bad++ == 0) first = i;
  }
  INFO(what << ": " << bad << " of " << cpu.size() << " elements beyond two bf16 ulps, the first at " << first
            << " (gpu " << gpu[first] << ", cpu " << cpu[first] << ")");
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("the gradient quantisation's and bias_grad's bf16 bias gradients match the CPU within two bf16 ulps") {
  KILN_REQUIRE_CUDA();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops({.round_bf16 = true});
  // Tiled (multiples of 16) and the three-pass fallback.
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{1040, 784}, {33, 47}};
  for (auto [R, C] : shapes) {
    INFO("[" << R << "," << C << "]");
    const std::size_t n = static_cast<std::size_t>(R * C);
    const auto dy = from_bf16(to_bf16(test::normal_values(n, 2001, 0.3f)));
    const auto old = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(C), 2002, 4.0f)));
    // quantize_grad
    auto c_dy = dy;
    auto c_bias = to_bf16(old);
    float c_scale = 90.0f;
    std::vector<std::uint8_t> c_row(n), c_col(n);
    GradQuantizeArgs c;
    c.dy = TensorView(c_dy.data(), {R, C}, DType::f32, Device::cpu);
    c.out.rowwise = TensorView(c_row.data(), {R, C}, DType::e4m3, Device::cpu);
    c.out.colwise = TensorView(c_col.data(), {C, R}, DType::e4m3, Device::cpu);
    c.out.format = Format::e4m3;
    c.out.scale = &c_scale;
    c.dbias = TensorView(c_bias.data(), {C}, DType::bf16, Device::cpu);
    cpu->quantize_grad(c);
    Buffer d_dy = test::to_device(to_bf16(dy)), d_bias = test::to_device(to_bf16(old));
    Buffer d_scale = test::to_device(std::vector<float>{90.0f});
    Buffer d_row(Device::cuda, n), d_col(Device::cuda, n);
    GradQuantizeArgs g;
    g.dy = TensorView(d_dy.data(), {R, C}, DType::bf16, Device::cuda);
    g.out.rowwise = TensorView(d_row.data(), {R, C}, DType::e4m3, Device::cuda);
    g.out.colwise = TensorView(d_col.data(), {C, R}, DType::e4m3, Device::cuda);
    g.out.format = Format::e4m3;
    g.out.scale = static_cast<float*>(d_scale.data());
    g.dbias = TensorView(d_bias.data(), {C}, DType::bf16, Device::cuda);
    gpu->quantize_grad(g);
    check_bf16_ulps(from_bf16(test::to_host<std::uint16_t>(d_bias.data(), static_cast<std::size_t>(C))),
                    from_bf16(c_bias), "quantize_grad dbias");
    // bias_grad
    auto c_db = to_bf16(old);
    cpu->bias_grad(TensorView(c_db.data(), {C}, DType::bf16, Device::cpu),
                   TensorView(const_cast<float*>(dy.data()), {R, C}, DType::f32, Device::cpu));
    Buffer d_db = test::to_device(to_bf16(old));
    gpu->bias_grad(TensorView(d_db.data(), {C}, DType::bf16, Device::cuda), g.dy);
    check_bf16_ulps(from_bf16(test::to_host<std::uint16_t>(d_db.data(), static_cast<std::size_t>(C))), from_bf16(c_db),
                    "bias_grad dbias");
  }
}

TEST_CASE("an FP8 linear's bf16 weight and bias gradients on CUDA match the CPU emulation within two bf16 ulps") {
  KILN_REQUIRE_CUDA();
  const std::int64_t N = 384, IC = 256, OC = 768;
  auto x = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(N * IC), 2101, 2.0f)));
  auto w = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(OC * IC), 2102, 0.05f)));
  auto b = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(OC), 2103)));
  auto dout = from_bf16(to_bf16(test::normal_values(static_cast<std::size_t>(N * OC), 2104, 1e-2f)));
  const auto dw0 = to_bf16(test::normal_values(static_cast<std::size_t>(OC * IC), 2105, 0.5f));
  const auto db0 = to_bf16(test::normal_values(static_cast<std::size_t>(OC), 2106, 2.0f));
  for (bool overwrite : {false, true}) {
    INFO("overwrite " << overwrite);
    std::vector<float> results[2][2];  // dw, db per side
    for (int side = 0; side < 2; ++side) {
      const bool dev = side == 1;
      auto ops = dev ? make_cuda_ops(nullptr) : make_cpu_ops({.round_bf16 = true});
      Fp8MetaStore meta(*ops, {Format::e4m3, Format::e4m3, Format::e5m2}, 1);
      Fp8Workspace ws(*ops);
      Fp8Linear lin(*ops, meta, 0, ws, Fp8Recipe{RecipeKind::current, 16, AmaxAlgo::max, 0, FormatPolicy::hybrid, true});
      const DType act = dev ? DType::bf16 : DType::f32;
      const Device where = dev ? Device::cuda : Device::cpu;
      std::vector<Buffer> keep;
      auto t = [&](const std::vector<float>& v, Shape shape) {
        keep.push_back(dev ? test::to_device(to_bf16(v)) : Buffer(Device::cpu, v.size() * 4));
        if (!dev) std::memcpy(keep.back().data(), v.data(), v.size() * 4);
        return TensorView(keep.back().data(), shape, act, where);
      };
      auto grad = [&](const std::vector<std::uint16_t>& bits, Shape shape) {  // bf16 on both sides
        keep.push_back(dev ? test::to_device(bits) : Buffer(Device::cpu, bits.size() * 2));
        if (!dev) std::memcpy(keep.back().data(), bits.data(), bits.size() * 2);
        return TensorView(keep.back().data(), shape, DType::bf16, where);
      };
      std::vector<float> zeros_out(static_cast<std::size_t>(N * OC)), zeros_in(static_cast<std::size_t>(N * IC));
      TensorView tx = t(x, {N, IC}), tw = t(w, {OC, IC}), tb = t(b, {OC}), tout = t(zeros_out, {N, OC}),
                 tdout = t(dout, {N, OC}), tdx = t(zeros_in, {N, IC});
      TensorView tdw = grad(dw0, {OC, IC}), tdb = grad(db0, {OC});
      lin.forward({tout, {}, tx, tw, tb}, 1);
      ops::LinearBackward a{tdx, tdw, tdb, tdout, tx, tw};
      a.dweight_overwrite = overwrite;
      lin.backward(a);
      auto get = [&](const TensorView& v) {
        const auto n = static_cast<std::size_t>(v.numel());
        if (dev) return from_bf16(test::to_host<std::uint16_t>(v.data, n));
        const auto* p = v.as<std::uint16_t>();
        return from_bf16(std::vector<std::uint16_t>(p, p + n));
      };
      results[side][0] = get(tdw);
      results[side][1] = get(tdb);
    }
    // The FP8 GEMM's sums land up to ~2e-4 of the largest value from the CPU's (FP8 products summed
    // in another order and precision), and its accumulating kernel rounds as the bf16 one does
    // (test_cuda_ops): one bf16 ulp of the largest value where an element nearly cancels.
    check_bf16_ulps(results[1][0], results[0][0], "dweight", std::ldexp(1.0f, -8));
    check_bf16_ulps(results[1][1], results[0][1], "dbias");
  }
}
