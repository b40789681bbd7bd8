// FP8 block scaling on the GPU against the CPU (kiln/fp8/block.hpp); every case skips without a GPU.
//  - the block quantisation kernels (1x128 and 128x128, bf16 and f32 inputs, power-of-two scales,
//    partial blocks): codes and scales bit for bit;
//  - the same kernels computing their values on load (LayerNorm, GELU, SwiGLU, dGELU, dSwiGLU) and
//    summing the bias gradient: bit for bit against quantising the unfused ops' outputs on the
//    device, near the CPU's;
//  - cuBLASLt's block-scaled GEMMs (1x128 x 128x128 as the forward and data gradient take them,
//    1x128 x 1x128 as the weight gradient does; bf16 and f32 results, accumulated) against the CPU
//    emulation. Where a product does not match, the case says which other arrangement of the same
//    scales would have (the layout cuBLASLt reads is documented only in prose).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_test_util.hpp"
#include "fp8_test_util.hpp"
#include "kiln/fp8/block.hpp"
#include "kiln/fp8/block_grouped_linear.hpp"
#include "kiln/fp8/ops.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/ops/cuda/launchers.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "kiln_test.hpp"

using namespace kiln;
using namespace kiln::fp8;

namespace {

#define KILN_REQUIRE_CUDA_BLOCK()                                            \
  do {                                                                       \
    if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible"); \
  } while (0)

// The same scales in another arrangement (what a layout other than kiln's would read), by (row
// entry r, K block k): 0 kiln's (BlockLayout), 1 r * kb + k, 2 k * re + r, 3 r * round_up(kb, 4) + k,
// 4 k * round_up(re, 4) + r.
std::vector<float> arranged(const std::vector<float>& s, const BlockLayout& l, int how) {
  const std::int64_t re = l.row_entries(), kb = blocks_of(l.cols), kb4 = (kb + 3) / 4 * 4, re4 = (re + 3) / 4 * 4;
  const std::int64_t step = l.rowwise() ? 1 : kBlock;
  std::vector<float> out(static_cast<std::size_t>(std::max({l.count(), re * kb4, re4 * kb})), 0.0f);
  for (std::int64_t r = 0; r < re; ++r)
    for (std::int64_t k = 0; k < kb; ++k) {
      const float v = s[static_cast<std::size_t>(l.index(r * step, k * kBlock))];
      const std::int64_t i = how == 0   ? l.index(r * step, k * kBlock)
                             : how == 1 ? r * kb + k
                             : how == 2 ? k * re + r
                             : how == 3 ? r * kb4 + k
                                        : k * re4 + r;
      out[static_cast<std::size_t>(i)] = v;
    }
  return out;
}

}  // namespace

TEST_CASE("CUDA block quantisation (1x128, 128x128, and of the transpose) matches the CPU bit for bit, partial blocks "
          "and pow2 included") {
  KILN_REQUIRE_CUDA_BLOCK();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops({.threads = 2});
  std::uint64_t seed = 300;
  // 2100 x 4000: more tiles than the persistent kernel's CTAs (each takes several in turn).
  for (auto [R, C] : {std::pair<std::int64_t, std::int64_t>{1, 16}, {130, 300}, {257, 128}, {1000, 1536}, {2100, 4000}})
    for (auto mode : {ScalingMode::block_1x128, ScalingMode::block_128x128})
      for (DType dt : {DType::bf16, DType::f32})
        for (bool pow2 : {false, true}) {
          const Format f = pow2 ? Format::e5m2 : Format::e4m3;
          INFO(R << " x " << C << " mode " << static_cast<int>(mode) << " " << name_of(dt) << (pow2 ? " pow2" : ""));
          auto x = test::normal_values(static_cast<std::size_t>(R * C), ++seed, 2.0f);
          for (std::size_t i = 0; i < x.size(); i += 101) x[i] *= 300.0f;
          std::vector<std::uint16_t> xb(x.size());
          for (std::size_t i = 0; i < x.size(); ++i) {
            xb[i] = float_to_bf16_bits(x[i]);
            if (dt == DType::bf16) x[i] = bf16_bits_to_float(xb[i]);  // what the CPU sees of the bf16 input
          }
          const BlockLayout l{mode, R, C}, tl{mode, C, R};
          std::vector<std::uint8_t> cc(x.size()), tc(x.size());
          std::vector<float> cs(static_cast<std::size_t>(l.count()), -1.0f), ts(static_cast<std::size_t>(tl.count()), -1.0f);
          cpu->quantize_blocks({TensorView(x.data(), {R, C}, DType::f32, Device::cpu), mode, pow2,
                                TensorView(cc.data(), {R, C}, dtype_of(f), Device::cpu), cs.data(),
                                TensorView(tc.data(), {C, R}, dtype_of(f), Device::cpu), ts.data()});
          Buffer dx = dt == DType::bf16 ? test::to_device(xb) : test::to_device(x);
          // Each copy alone, then both in one pass.
          for (int copies : {1, 2, 3}) {
            CAPTURE(copies);
            Buffer dc(Device::cuda, x.size() + 256), dt_(Device::cuda, x.size() + 256);
            Buffer ds = test::to_device(std::vector<float>(cs.size(), -1.0f)), dts = test::to_device(std::vector<float>(ts.size(), -1.0f));
            BlockQuantizeArgs a{TensorView(dx.data(), {R, C}, dt, Device::cuda), mode, pow2};
            if (copies & 1) {
              a.rowwise = TensorView(dc.data(), {R, C}, dtype_of(f), Device::cuda);
              a.row_scale_inv = static_cast<float*>(ds.data());
            }
            if (copies & 2) {
              a.colwise = TensorView(dt_.data(), {C, R}, dtype_of(f), Device::cuda);
              a.col_scale_inv = static_cast<float*>(dts.data());
            }
            gpu->quantize_blocks(a);
            if (copies & 1) {
              CHECK(test::to_host<std::uint8_t>(dc.data(), cc.size()) == cc);
              CHECK(test::same_bits(test::to_host<float>(ds.data(), cs.size()), cs));
            }
            if (copies & 2) {
              CHECK(test::to_host<std::uint8_t>(dt_.data(), tc.size()) == tc);
              CHECK(test::same_bits(test::to_host<float>(dts.data(), ts.size()), ts));
            }
          }
        }
}

TEST_CASE("CUDA block quantisation on load (LayerNorm, GELU, SwiGLU, dGELU, dSwiGLU) with the bias gradient equals "
          "quantising the unfused ops' outputs") {
  KILN_REQUIRE_CUDA_BLOCK();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops({.round_bf16 = true, .threads = 2});
  using P = ops::Prologue;
  auto bf16_of = [](std::vector<float>& v) {  // v rounded to bf16 in place; its bits
    std::vector<std::uint16_t> b(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      b[i] = float_to_bf16_bits(v[i]);
      v[i] = bf16_bits_to_float(b[i]);
    }
    return b;
  };
  std::uint64_t seed = 900;
  // Output shapes: 16-column loads with partial tiles both ways (300 x 384, 257 x 160: dSwiGLU's
  // halves of 80 columns), one element at a time (130 x 200: 200 not a multiple of 16; dSwiGLU 100),
  // more tiles than the persistent kernel's CTAs (2100 x 4096).
  for (auto [R, C] : {std::pair<std::int64_t, std::int64_t>{300, 384}, {257, 160}, {130, 200}, {2100, 4096}})
    for (P src : {P::layernorm, P::gelu, P::swiglu, P::dgelu, P::dswiglu}) {
      INFO(R << " x " << C << " " << ops::name_of(src));
      const std::int64_t in_cols = src == P::swiglu ? 2 * C : C, grad_cols = src == P::dswiglu ? C / 2 : C;
      auto in_f = test::normal_values(static_cast<std::size_t>(R * in_cols), ++seed, 2.5f);
      for (std::size_t i = 0; i < in_f.size(); i += 97) in_f[i] *= 20.0f;
      auto grad_f = test::normal_values(static_cast<std::size_t>(R * grad_cols), ++seed, 0.5f);
      auto w_f = test::normal_values(static_cast<std::size_t>(C), ++seed, 1.0f);
      auto b_f = test::normal_values(static_cast<std::size_t>(C), ++seed, 0.3f);
      Buffer d_in = test::to_device(bf16_of(in_f)), d_grad = test::to_device(bf16_of(grad_f)), d_w = test::to_device(bf16_of(w_f)),
             d_b = test::to_device(bf16_of(b_f));
      Buffer d_vals(Device::cuda, static_cast<std::size_t>(R * C) * 2 + 256), d_mean(Device::cuda, R * 4 + 256),
          d_rstd(Device::cuda, R * 4 + 256);
      auto* vals = static_cast<kiln::cuda::bf16*>(d_vals.data());
      const auto* in = static_cast<const kiln::cuda::bf16*>(d_in.data());
      const auto* g = static_cast<const kiln::cuda::bf16*>(d_grad.data());
      const TensorView din(d_in.data(), {R, in_cols}, DType::bf16, Device::cuda),
          dgrad(d_grad.data(), {R, grad_cols}, DType::bf16, Device::cuda),
          hin(in_f.data(), {R, in_cols}, DType::f32, Device::cpu), hgrad(grad_f.data(), {R, grad_cols}, DType::f32, Device::cpu);
      std::vector<float> mean, rstd;
      QuantizeSource ds, hs;
      switch (src) {  // the unfused op's output on the device, and the two sources
        case P::layernorm: {
          kiln::cuda::layernorm_forward(vals, static_cast<float*>(d_mean.data()), static_cast<float*>(d_rstd.data()), in,
                                        static_cast<const kiln::cuda::bf16*>(d_w.data()),
                                        static_cast<const kiln::cuda::bf16*>(d_b.data()), static_cast<int>(R),
                                        static_cast<int>(C), 1e-5f, nullptr);
          mean = test::to_host<float>(d_mean.data(), static_cast<std::size_t>(R));
          rstd = test::to_host<float>(d_rstd.data(), static_cast<std::size_t>(R));
          ds = ops::LayerNormOnLoad{din, TensorView(d_w.data(), {C}, DType::bf16, Device::cuda),
                                    TensorView(d_b.data(), {C}, DType::bf16, Device::cuda),
                                    TensorView(d_mean.data(), {R}, DType::f32, Device::cuda),
                                    TensorView(d_rstd.data(), {R}, DType::f32, Device::cuda)};
          hs = ops::LayerNormOnLoad{hin, TensorView(w_f.data(), {C}, DType::f32, Device::cpu),
                                    TensorView(b_f.data(), {C}, DType::f32, Device::cpu),
                                    TensorView(mean.data(), {R}, DType::f32, Device::cpu),
                                    TensorView(rstd.data(), {R}, DType::f32, Device::cpu)};
          break;
        }
        case P::gelu:
          kiln::cuda::gelu_forward(vals, in, R * C, nullptr);
          ds = ops::GeluOnLoad{din}, hs = ops::GeluOnLoad{hin};
          break;
        case P::swiglu:
          kiln::cuda::swiglu_forward(vals, in, R, static_cast<int>(C), nullptr);
          ds = ops::SwigluOnLoad{din}, hs = ops::SwigluOnLoad{hin};
          break;
        case P::dgelu:
          kiln::cuda::gelu_backward(vals, g, in, R * C, nullptr);
          ds = ops::DgeluOnLoad{dgrad, din}, hs = ops::DgeluOnLoad{hgrad, hin};
          break;
        default:
          kiln::cuda::swiglu_backward(vals, g, in, R, static_cast<int>(C / 2), nullptr);
          ds = ops::DswigluOnLoad{dgrad, din}, hs = ops::DswigluOnLoad{hgrad, hin};
          break;
      }
      const BlockLayout l{ScalingMode::block_1x128, R, C}, tl{ScalingMode::block_1x128, C, R};
      const auto n = static_cast<std::size_t>(R * C);
      struct Out {
        Buffer row, col, rs, cs, db;
      };
      auto quantize_on_gpu = [&](const QuantizeSource& x) {
        Out o{Buffer(Device::cuda, n + 256), Buffer(Device::cuda, n + 256),
              test::to_device(std::vector<float>(static_cast<std::size_t>(l.count()), -1.0f)),
              test::to_device(std::vector<float>(static_cast<std::size_t>(tl.count()), -1.0f)),
              test::to_device(std::vector<float>(static_cast<std::size_t>(C), 0.5f))};
        BlockQuantizeArgs a{x, ScalingMode::block_1x128, false,
                            TensorView(o.row.data(), {R, C}, DType::e4m3, Device::cuda), static_cast<float*>(o.rs.data()),
                            TensorView(o.col.data(), {C, R}, DType::e4m3, Device::cuda), static_cast<float*>(o.cs.data())};
        a.dbias = TensorView(o.db.data(), {C}, DType::f32, Device::cuda);
        gpu->quantize_blocks(a);
        return o;
      };
      const Out fused = quantize_on_gpu(ds), unfused = quantize_on_gpu(TensorView(d_vals.data(), {R, C}, DType::bf16, Device::cuda));
      CHECK(test::same_device_bytes(fused.row.data(), unfused.row.data(), n));
      CHECK(test::same_device_bytes(fused.col.data(), unfused.col.data(), n));
      CHECK(test::same_device_bytes(fused.rs.data(), unfused.rs.data(), static_cast<std::size_t>(l.count()) * 4));
      CHECK(test::same_device_bytes(fused.cs.data(), unfused.cs.data(), static_cast<std::size_t>(tl.count()) * 4));
      {  // The rowwise codes alone (no transpose, no bias gradient: where C is a multiple of 128, no tile
         // is staged) equal the fused pass's.
        Buffer row(Device::cuda, n + 256);
        Buffer rs = test::to_device(std::vector<float>(static_cast<std::size_t>(l.count()), -1.0f));
        gpu->quantize_blocks({ds, ScalingMode::block_1x128, false, TensorView(row.data(), {R, C}, DType::e4m3, Device::cuda),
                              static_cast<float*>(rs.data())});
        CHECK(test::same_device_bytes(row.data(), fused.row.data(), n));
        CHECK(test::same_device_bytes(rs.data(), fused.rs.data(), static_cast<std::size_t>(l.count()) * 4));
      }
      {  // Both copies without the bias gradient, and the transpose's codes alone, equal the fused pass's.
        for (bool rows_too : {true, false}) {
          CAPTURE(rows_too);
          Buffer row(Device::cuda, n + 256), col(Device::cuda, n + 256);
          Buffer rs = test::to_device(std::vector<float>(static_cast<std::size_t>(l.count()), -1.0f));
          Buffer cs = test::to_device(std::vector<float>(static_cast<std::size_t>(tl.count()), -1.0f));
          BlockQuantizeArgs a{ds, ScalingMode::block_1x128, false};
          if (rows_too) {
            a.rowwise = TensorView(row.data(), {R, C}, DType::e4m3, Device::cuda);
            a.row_scale_inv = static_cast<float*>(rs.data());
          }
          a.colwise = TensorView(col.data(), {C, R}, DType::e4m3, Device::cuda);
          a.col_scale_inv = static_cast<float*>(cs.data());
          gpu->quantize_blocks(a);
          if (rows_too) {
            CHECK(test::same_device_bytes(row.data(), fused.row.data(), n));
            CHECK(test::same_device_bytes(rs.data(), fused.rs.data(), static_cast<std::size_t>(l.count()) * 4));
          }
          CHECK(test::same_device_bytes(col.data(), fused.col.data(), n));
          CHECK(test::same_device_bytes(cs.data(), fused.cs.data(), static_cast<std::size_t>(tl.count()) * 4));
        }
      }
      const auto dbias = test::to_host<float>(fused.db.data(), static_cast<std::size_t>(C));
      CHECK(test::same_bits(dbias, test::to_host<float>(unfused.db.data(), static_cast<std::size_t>(C))));
      // The bias gradient: the column sums of the unfused values (added to 0.5), within f32 rounding.
      const auto vb = test::to_host<std::uint16_t>(d_vals.data(), n);
      for (std::int64_t c = 0; c < C; ++c) {
        double sum = 0.5, mag = 0.5;
        for (std::int64_t r = 0; r < R; ++r) {
          const double v = bf16_bits_to_float(vb[static_cast<std::size_t>(r * C + c)]);
          sum += v;
          mag += std::fabs(v);
        }
        CHECK(std::fabs(dbias[static_cast<std::size_t>(c)] - sum) <= 1e-5 * mag);
      }
      // Near the CPU's codes (the device's exp and division differ from the host's in the last bits,
      // moving a few values across a rounding boundary).
      std::vector<std::uint8_t> hrow(n), hcol(n);
      std::vector<float> hrs(static_cast<std::size_t>(l.count())), hcs(static_cast<std::size_t>(tl.count()));
      cpu->quantize_blocks({hs, ScalingMode::block_1x128, false, TensorView(hrow.data(), {R, C}, DType::e4m3, Device::cpu),
                            hrs.data(), TensorView(hcol.data(), {C, R}, DType::e4m3, Device::cpu), hcs.data()});
      const auto grow = test::to_host<std::uint8_t>(fused.row.data(), n);
      std::size_t differ = 0;
      for (std::size_t i = 0; i < n; ++i) differ += grow[i] != hrow[i];
      CHECK(differ <= n / 200 + 2);
    }
}

TEST_CASE("CUDA's AdamW step fused with the block quantisation of the updated weight equals the step, then the "
          "quantisation") {
  KILN_REQUIRE_CUDA_BLOCK();
  auto gpu = make_cuda_ops(nullptr);
  std::uint64_t seed = 1300;
  // 130 x 200: 4-float loads, byte stores; 70 x 130: one element at a time. The moments f32, or bf16
  // (optim.moments = "bf16"); the gradient f32, or bf16 (optim.grads = "bf16": then the fused step
  // also equals, bit for bit, the fused step with an f32 gradient of the same values).
  for (auto [R, C] : {std::pair<std::int64_t, std::int64_t>{300, 384}, {130, 200}, {256, 128}, {70, 130}})
    for (int variant = 0; variant < 5; ++variant) {
      const bool pow2 = variant == 1, half = variant == 2 || variant == 4, grad16 = variant >= 3;
      const DType moments = half ? DType::bf16 : DType::f32;
      INFO(R << " x " << C << (pow2 ? " pow2" : "") << (half ? " bf16 moments" : "") << (grad16 ? " bf16 gradient" : ""));
      const auto n = static_cast<std::size_t>(R * C);
      auto p = test::normal_values(n, ++seed, 0.05f), g = test::normal_values(n, ++seed, 1e-2f),
           m = test::normal_values(n, ++seed, 1e-3f), v = test::normal_values(n, ++seed, 1e-3f);
      for (auto& x : v) x = x * x;  // second moments are not negative
      std::vector<std::uint16_t> g16(n);
      if (grad16)
        for (std::size_t i = 0; i < n; ++i) g16[i] = float_to_bf16_bits(g[i]), g[i] = bf16_bits_to_float(g16[i]);
      for (std::size_t i = 0; i < n; i += 113) p[i] *= 50.0f;
      const BlockLayout l{ScalingMode::block_128x128, R, C}, tl{ScalingMode::block_128x128, C, R};
      struct Run {
        Buffer p, g, m, v, row, col, rs, cs;
      };
      auto moment = [&](const std::vector<float>& x) {
        if (!half) return test::to_device(x);
        std::vector<std::uint16_t> bits(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) bits[i] = float_to_bf16_bits(x[i]);
        return test::to_device(bits);
      };
      auto make = [&](bool bf16_grad) {
        return Run{test::to_device(p), bf16_grad ? test::to_device(g16) : test::to_device(g), moment(m), moment(v), Buffer(Device::cuda, n + 256),
                   Buffer(Device::cuda, n + 256), test::to_device(std::vector<float>(static_cast<std::size_t>(l.count()), -1.0f)),
                   test::to_device(std::vector<float>(static_cast<std::size_t>(tl.count()), -1.0f))};
      };
      auto args = [&](Run& r, bool bf16_grad) {
        AdamWQuantizeArgs u;
        u.param = TensorView(r.p.data(), {R, C}, DType::f32, Device::cuda);
        u.grad = TensorView(r.g.data(), {R, C}, bf16_grad ? DType::bf16 : DType::f32, Device::cuda);
        u.m = TensorView(r.m.data(), {R, C}, moments, Device::cuda);
        u.v = TensorView(r.v.data(), {R, C}, moments, Device::cuda);
        u.lr = 1e-3f, u.weight_decay = 0.1f, u.grad_scale = 0.5f, u.step = 7;
        return u;
      };
      auto out = [&](Run& r) {
        return BlockQuantizeArgs{TensorView{}, ScalingMode::block_128x128, pow2,
                                 TensorView(r.row.data(), {R, C}, DType::e4m3, Device::cuda), static_cast<float*>(r.rs.data()),
                                 TensorView(r.col.data(), {C, R}, DType::e4m3, Device::cuda), static_cast<float*>(r.cs.data())};
      };
      Run fused = make(grad16), apart = make(grad16);
      gpu->adamw_quantize_blocks(args(fused, grad16), out(fused));
      gpu->adamw_quantize(args(apart, grad16));
      BlockQuantizeArgs q = out(apart);
      q.x = TensorView(apart.p.data(), {R, C}, DType::f32, Device::cuda);
      gpu->quantize_blocks(q);
      CHECK(test::same_device_bytes(fused.p.data(), apart.p.data(), n * 4));
      const std::size_t moment_bytes = n * size_of(moments);
      for (auto [a, b] : {std::pair{&fused.m, &apart.m}, {&fused.v, &apart.v}})
        CHECK(test::same_device_bytes(a->data(), b->data(), moment_bytes));
      CHECK(test::to_host<float>(fused.p.data(), n) != p);  // the step changed the weight
      CHECK(test::same_device_bytes(fused.row.data(), apart.row.data(), n));
      CHECK(test::same_device_bytes(fused.col.data(), apart.col.data(), n));
      CHECK(test::same_device_bytes(fused.rs.data(), apart.rs.data(), static_cast<std::size_t>(l.count()) * 4));
      CHECK(test::same_device_bytes(fused.cs.data(), apart.cs.data(), static_cast<std::size_t>(tl.count()) * 4));
      if (!grad16) continue;
      Run f32_grad = make(false);
      gpu->adamw_quantize_blocks(args(f32_grad, false), out(f32_grad));
      CHECK(test::same_device_bytes(fused.p.data(), f32_grad.p.data(), n * 4));
      for (auto [a, b] : {std::pair{&fused.m, &f32_grad.m}, {&fused.v, &f32_grad.v}})
        CHECK(test::same_device_bytes(a->data(), b->data(), moment_bytes));
      CHECK(test::same_device_bytes(fused.row.data(), f32_grad.row.data(), n));
      CHECK(test::same_device_bytes(fused.col.data(), f32_grad.col.data(), n));
      CHECK(test::same_device_bytes(fused.rs.data(), f32_grad.rs.data(), static_cast<std::size_t>(l.count()) * 4));
      CHECK(test::same_device_bytes(fused.cs.data(), f32_grad.cs.data(), static_cast<std::size_t>(tl.count()) * 4));
    }
}

TEST_CASE("CUDA's quantisation of a 128x128-scaled weight's parts (FSDP shards) matches the CPU bit for bit") {
  KILN_REQUIRE_CUDA_BLOCK();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops({.threads = 1});
  for (auto [R, C] : {std::pair<std::int64_t, std::int64_t>{300, 200}, {512, 384}, {130, 129}})
    for (bool pow2 : {false, true}) {
      INFO(R << " x " << C << (pow2 ? " pow2" : ""));
      auto x = test::normal_values(static_cast<std::size_t>(R * C), 21, 0.05f);
      for (std::size_t i = 0; i < x.size(); i += 131) x[i] *= 40.0f;
      const BlockLayout l{ScalingMode::block_128x128, R, C}, tl{ScalingMode::block_128x128, C, R};
      const std::int64_t n = R * C, cuts[] = {0, n / 3 + 7, 2 * n / 3 - 5, n};
      const auto nt = static_cast<std::size_t>(l.count()), ntt = static_cast<std::size_t>(tl.count());
      std::vector<float> amax(nt, 0.0f), scale(nt), row_si(nt, -1.0f), col_si(ntt, -1.0f);
      std::vector<std::uint8_t> codes(x.size(), 0xaa);
      Buffer dx = test::to_device(x), damax = test::to_device(amax), dscale = test::to_device(scale), drow = test::to_device(row_si),
             dcol = test::to_device(col_si), dcodes = test::to_device(codes);
      for (int k = 0; k < 3; ++k) {
        cpu->block_part_amax({x.data() + cuts[k], cuts[k + 1] - cuts[k], cuts[k], R, C}, amax.data());
        gpu->block_part_amax({static_cast<const float*>(dx.data()) + cuts[k], cuts[k + 1] - cuts[k], cuts[k], R, C},
                             static_cast<float*>(damax.data()));
      }
      CHECK(test::same_bits(test::to_host<float>(damax.data(), nt), amax));
      cpu->block_scales(amax.data(), R, C, Format::e4m3, pow2, scale.data(), row_si.data(), col_si.data());
      gpu->block_scales(static_cast<float*>(damax.data()), R, C, Format::e4m3, pow2, static_cast<float*>(dscale.data()),
                        static_cast<float*>(drow.data()), static_cast<float*>(dcol.data()));
      CHECK(test::same_bits(test::to_host<float>(dscale.data(), nt), scale));
      CHECK(test::same_bits(test::to_host<float>(drow.data(), nt), row_si));
      CHECK(test::same_bits(test::to_host<float>(dcol.data(), ntt), col_si));
      for (int k = 0; k < 3; ++k) {
        cpu->quantize_block_part({x.data() + cuts[k], cuts[k + 1] - cuts[k], cuts[k], R, C}, scale.data(), Format::e4m3,
                                 codes.data() + cuts[k]);
        gpu->quantize_block_part({static_cast<const float*>(dx.data()) + cuts[k], cuts[k + 1] - cuts[k], cuts[k], R, C},
                                 static_cast<float*>(dscale.data()), Format::e4m3,
                                 static_cast<std::uint8_t*>(dcodes.data()) + cuts[k]);
      }
      CHECK(test::to_host<std::uint8_t>(dcodes.data(), codes.size()) == codes);
    }
}

TEST_CASE("cuBLASLt block-scaled FP8 GEMMs match the CPU emulation (1x128 x 128x128 and 1x128 x 1x128)") {
  KILN_REQUIRE_CUDA_BLOCK();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops({.threads = 2});
  using M = ScalingMode;
  struct Case {
    std::int64_t m, n, k;
    M xm, ym;
    Format fx, fy;
    bool f32;
  } cases[] = {
      {256, 384, 512, M::block_1x128, M::block_128x128, Format::e4m3, Format::e4m3, false},  // forward
      {200, 272, 384, M::block_1x128, M::block_128x128, Format::e4m3, Format::e4m3, false},  // N not of 128
      {136, 256, 640, M::block_1x128, M::block_128x128, Format::e4m3, Format::e4m3, false},  // M not of 16
      {512, 768, 1024, M::block_1x128, M::block_128x128, Format::e5m2, Format::e4m3, false},  // dgrad
      {384, 256, 512, M::block_1x128, M::block_1x128, Format::e5m2, Format::e4m3, true},     // wgrad, f32
      {200, 336, 384, M::block_1x128, M::block_1x128, Format::e5m2, Format::e4m3, true},
      {256, 256, 336, M::block_1x128, M::block_128x128, Format::e4m3, Format::e4m3, false},  // K not a multiple of 128
  };
  std::uint64_t seed = 500;
  for (const Case& c : cases) {
    INFO(c.m << " x " << c.n << " x " << c.k << " modes " << static_cast<int>(c.xm) << "," << static_cast<int>(c.ym)
              << " " << name_of(c.fx) << " x " << name_of(c.fy) << (c.f32 ? " f32 accumulated" : " bf16"));
    const BlockLayout lx{c.xm, c.m, c.k}, ly{c.ym, c.n, c.k};
    auto xv = test::normal_values(static_cast<std::size_t>(c.m * c.k), ++seed);
    auto yv = test::normal_values(static_cast<std::size_t>(c.n * c.k), ++seed, 0.05f);
    for (std::size_t i = 0; i < xv.size(); i += 89) xv[i] *= 40.0f;
    std::vector<std::uint8_t> xc(xv.size()), yc(yv.size());
    std::vector<float> xs(static_cast<std::size_t>(lx.count()), 0.0f), ys(static_cast<std::size_t>(ly.count()), 0.0f);
    cpu->quantize_blocks({TensorView(xv.data(), {c.m, c.k}, DType::f32, Device::cpu), c.xm, false,
                          TensorView(xc.data(), {c.m, c.k}, dtype_of(c.fx), Device::cpu), xs.data()});
    cpu->quantize_blocks({TensorView(yv.data(), {c.n, c.k}, DType::f32, Device::cpu), c.ym, false,
                          TensorView(yc.data(), {c.n, c.k}, dtype_of(c.fy), Device::cpu), ys.data()});
    // The CPU emulation, f32.
    std::vector<float> want(static_cast<std::size_t>(c.m * c.n));
    GemmArgs h;
    h.x = TensorView(xc.data(), {c.m, c.k}, dtype_of(c.fx), Device::cpu);
    h.y = TensorView(yc.data(), {c.n, c.k}, dtype_of(c.fy), Device::cpu);
    h.d = TensorView(want.data(), {c.m, c.n}, DType::f32, Device::cpu);
    h.x_scale_inv = xs.data();
    h.y_scale_inv = ys.data();
    h.x_mode = c.xm;
    h.y_mode = c.ym;
    h.f32_result = true;
    cpu->gemm(h);

    Buffer dx = test::to_device(xc), dy = test::to_device(yc);
    auto run = [&](int how_x, int how_y) {
      Buffer sx = test::to_device(arranged(xs, lx, how_x)), sy = test::to_device(arranged(ys, ly, how_y));
      const std::size_t n = want.size();
      Buffer dd(Device::cuda, n * 4 + 256);
      // f32: D starts at 1 and the product is accumulated onto it.
      if (c.f32) KILN_CUDA_CHECK(cudaMemcpy(dd.data(), std::vector<float>(n, 1.0f).data(), n * 4, cudaMemcpyHostToDevice));
      GemmArgs g;
      g.x = TensorView(dx.data(), {c.m, c.k}, dtype_of(c.fx), Device::cuda);
      g.y = TensorView(dy.data(), {c.n, c.k}, dtype_of(c.fy), Device::cuda);
      g.d = TensorView(dd.data(), {c.m, c.n}, c.f32 ? DType::f32 : DType::bf16, Device::cuda);
      g.x_scale_inv = static_cast<float*>(sx.data());
      g.y_scale_inv = static_cast<float*>(sy.data());
      g.x_mode = c.xm;
      g.y_mode = c.ym;
      g.f32_result = g.accumulate = c.f32;
      gpu->gemm(g);
      std::vector<float> got(n);
      if (c.f32) {
        got = test::to_host<float>(dd.data(), n);
        for (auto& v : got) v -= 1.0f;
      } else {
        const auto b = test::to_host<std::uint16_t>(dd.data(), n);
        for (std::size_t i = 0; i < n; ++i) got[i] = bf16_bits_to_float(b[i]);
      }
      return test::rel_error(got, want);
    };
    // bf16 results: bf16's rounding. f32: the tensor cores' accumulation between promotions (2e-4
    // measured; the per-tensor GEMMs' test allows 2e-3).
    const double bound = c.f32 ? 1e-3 : 5e-3;
    double err = 1;
    try {
      err = run(0, 0);
    } catch (const Error& e) {
      FAIL_CHECK("cuBLASLt refused it: " << std::string(e.what()));
      continue;
    }
    INFO("relative error " << err << " (bound " << bound << ")");
    CHECK(err < bound);
    if (err >= bound)  // which arrangement of the scales cuBLASLt reads instead
      for (int ax = 0; ax < 5; ++ax)
        for (int ay = 0; ay < 5; ++ay)
          if (ax + ay > 0) MESSAGE("scales arranged " << ax << " (x), " << ay << " (y): relative error " << run(ax, ay));
  }
  // cuBLASLt has no algorithm for 1x128 rows that are not a multiple of 4: said before the launch.
  Buffer b(Device::cuda, 1 << 20);
  GemmArgs g;
  g.x = TensorView(b.data(), {198, 256}, DType::e4m3, Device::cuda);
  g.y = TensorView(b.data(), {256, 256}, DType::e4m3, Device::cuda);
  g.d = TensorView(b.data(), {198, 256}, DType::bf16, Device::cuda);
  g.x_scale_inv = g.y_scale_inv = static_cast<float*>(b.data());
  g.x_mode = M::block_1x128;
  g.y_mode = M::block_128x128;
  CHECK_THROWS_WITH_AS(gpu->gemm(g), doctest::Contains("rows (M) to be a multiple of 4"), Error);
}

TEST_CASE("CUDA block quantisation into padded outputs (zero rows appended) matches the CPU bit for bit") {
  KILN_REQUIRE_CUDA_BLOCK();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops({.threads = 2});
  std::uint64_t seed = 700;
  for (auto mode : {ScalingMode::block_1x128, ScalingMode::block_128x128})
    for (auto [R, Rr, Rc] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{5, 8, 16}, {130, 132, 144},
                             {17, 20, 32}, {128, 128, 256}, {300, 300, 304}}) {
      INFO(R << " rows into " << Rr << " and " << Rc << ", mode " << static_cast<int>(mode));
      const std::int64_t C = 272;
      auto x = test::normal_values(static_cast<std::size_t>(R * C), ++seed, 2.0f);
      std::vector<std::uint16_t> xb(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) {
        xb[i] = float_to_bf16_bits(x[i]);
        x[i] = bf16_bits_to_float(xb[i]);
      }
      const BlockLayout rl{mode, Rr, C}, cl{mode, C, Rc};
      std::vector<std::uint8_t> rc(static_cast<std::size_t>(Rr * C)), cc(static_cast<std::size_t>(C * Rc));
      std::vector<float> rs(static_cast<std::size_t>(rl.count()), -1.0f), cs(static_cast<std::size_t>(cl.count()), -1.0f);
      cpu->quantize_blocks({TensorView(x.data(), {R, C}, DType::f32, Device::cpu), mode, false,
                            TensorView(rc.data(), {Rr, C}, DType::e4m3, Device::cpu), rs.data(),
                            TensorView(cc.data(), {C, Rc}, DType::e4m3, Device::cpu), cs.data()});
      Buffer dx = test::to_device(xb), drc(Device::cuda, rc.size() + 256), dcc(Device::cuda, cc.size() + 256);
      KILN_CUDA_CHECK(cudaMemset(drc.data(), 0x7f, rc.size()));  // the padding must be written, not found
      KILN_CUDA_CHECK(cudaMemset(dcc.data(), 0x7f, cc.size()));
      Buffer drs = test::to_device(std::vector<float>(rs.size(), -1.0f)), dcs = test::to_device(std::vector<float>(cs.size(), -1.0f));
      gpu->quantize_blocks({TensorView(dx.data(), {R, C}, DType::bf16, Device::cuda), mode, false,
                            TensorView(drc.data(), {Rr, C}, DType::e4m3, Device::cuda), static_cast<float*>(drs.data()),
                            TensorView(dcc.data(), {C, Rc}, DType::e4m3, Device::cuda), static_cast<float*>(dcs.data())});
      CHECK(test::to_host<std::uint8_t>(drc.data(), rc.size()) == rc);
      CHECK(test::to_host<std::uint8_t>(dcc.data(), cc.size()) == cc);
      CHECK(test::same_bits(test::to_host<float>(drs.data(), rs.size()), rs));
      CHECK(test::same_bits(test::to_host<float>(dcs.data(), cs.size()), cs));
    }
}

TEST_CASE("CUDA's grouped block quantisation (one launch over a mixture of experts' groups) equals each group's "
          "quantisation alone, bit for bit") {
  KILN_REQUIRE_CUDA_BLOCK();
  auto gpu = make_cuda_ops(nullptr);
  using P = ops::Prologue;
  std::uint64_t seed = 1700;
  const std::int64_t C = 288;  // dSwiGLU's halves of 144 columns: partial tiles along the columns
  // Groups of awkward rows (none, fewer than a tile, partial tiles), and 70 groups (two launches).
  std::vector<std::vector<std::int64_t>> groupings = {{5, 130, 0, 17, 300}, {128}, std::vector<std::int64_t>(70, 3)};
  for (const auto& rows : groupings)
    for (P src : {P::plain, P::gelu, P::swiglu, P::dgelu, P::dswiglu})
      for (auto mode : {ScalingMode::block_1x128, ScalingMode::block_128x128})
        for (int copies : {1, 2, 3}) {
          std::int64_t R = 0;
          for (std::int64_t n : rows) R += n;
          R += 7;  // rows past the groups'
          INFO(rows.size() << " groups of " << R << " rows, " << ops::name_of(src) << ", mode " << static_cast<int>(mode)
                           << ", copies " << copies);
          const std::int64_t in_cols = src == P::swiglu ? 2 * C : C, grad_cols = src == P::dswiglu ? C / 2 : C;
          auto bits = [&](std::int64_t n, float sd) {
            auto v = test::normal_values(static_cast<std::size_t>(n), ++seed, sd);
            for (std::size_t i = 0; i < v.size(); i += 89) v[i] *= 40.0f;
            std::vector<std::uint16_t> b(v.size());
            for (std::size_t i = 0; i < v.size(); ++i) b[i] = float_to_bf16_bits(v[i]);
            return b;
          };
          Buffer d_in = test::to_device(bits(R * in_cols, 2.0f)), d_grad = test::to_device(bits(R * grad_cols, 0.5f));
          const TensorView in(d_in.data(), {R, in_cols}, DType::bf16, Device::cuda),
              grad(d_grad.data(), {R, grad_cols}, DType::bf16, Device::cuda);
          QuantizeSource x;
          switch (src) {
            case P::gelu: x = ops::GeluOnLoad{in}; break;
            case P::swiglu: x = ops::SwigluOnLoad{in}; break;
            case P::dgelu: x = ops::DgeluOnLoad{grad, in}; break;
            case P::dswiglu: x = ops::DswigluOnLoad{grad, in}; break;
            default: x = in;
          }
          // Each group's copies padded as the experts' are (rows to 4, the transpose's columns to 16),
          // in one arena per run, filled with a pattern the kernels must overwrite.
          struct Out {
            std::int64_t code_at, scale_at, Rr, Rc;
          };
          std::vector<Out> outs;
          std::int64_t codes = 0, scales = 0;
          for (std::int64_t n : rows) {
            const std::int64_t Rr = (n + 3) / 4 * 4, Rc = (n + 15) / 16 * 16;
            outs.push_back({codes, scales, Rr, Rc});
            codes += (Rr + Rc) * C + 256;
            scales += BlockLayout{mode, Rr, C}.count() + BlockLayout{mode, C, Rc}.count() + 64;
          }
          auto run = [&](bool grouped) {
            Buffer cb(Device::cuda, static_cast<std::size_t>(codes)), sb(Device::cuda, static_cast<std::size_t>(scales) * 4);
            KILN_CUDA_CHECK(cudaMemset(cb.data(), 0x7f, static_cast<std::size_t>(codes)));
            KILN_CUDA_CHECK(cudaMemset(sb.data(), 0xff, static_cast<std::size_t>(scales) * 4));
            std::vector<BlockGroup> groups;
            std::int64_t first = 0;
            for (std::size_t g = 0; g < rows.size(); ++g) {
              const Out& o = outs[g];
              auto* c = static_cast<std::uint8_t*>(cb.data()) + o.code_at;
              float* sc = static_cast<float*>(sb.data()) + o.scale_at;
              BlockGroup bg{first, rows[g]};
              if (copies & 1) {
                bg.rowwise = TensorView(c, {o.Rr, C}, DType::e4m3, Device::cuda);
                bg.row_scale_inv = sc;
              }
              if (copies & 2) {
                bg.colwise = TensorView(c + o.Rr * C, {C, o.Rc}, DType::e4m3, Device::cuda);
                bg.col_scale_inv = sc + BlockLayout{mode, o.Rr, C}.count();
              }
              groups.push_back(bg);
              first += rows[g];
            }
            if (grouped) {
              gpu->quantize_blocks_grouped({x, mode, false, groups});
            } else {
              for (const BlockGroup& g : groups)
                if (g.rows > 0)
                  gpu->quantize_blocks({source_rows(x, g.first, g.rows), mode, false, g.rowwise, g.row_scale_inv,
                                        g.colwise, g.col_scale_inv});
            }
            return std::pair{test::to_host<std::uint8_t>(cb.data(), static_cast<std::size_t>(codes)),
                             test::to_host<float>(sb.data(), static_cast<std::size_t>(scales))};
          };
          const auto [gc, gs] = run(true);
          const auto [ac, as] = run(false);
          CHECK(gc == ac);
          CHECK(test::same_bits(gs, as));
        }
}

TEST_CASE("CUDA's AdamW step of stacked experts' weights with their grouped 128x128 codes equals each expert's fused "
          "step, bit for bit") {
  KILN_REQUIRE_CUDA_BLOCK();
  auto gpu = make_cuda_ops(nullptr);
  std::uint64_t seed = 1900;
  for (auto [E, A, B] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{3, 200, 136}, {4, 256, 128}, {70, 16, 32},
                                                                                     {2, 130, 66}})
    for (bool pow2 : {false, true}) {
      INFO(E << " experts of " << A << " x " << B << (pow2 ? " pow2" : ""));
      const auto n = static_cast<std::size_t>(E * A * B);
      auto p = test::normal_values(n, ++seed, 0.05f), g = test::normal_values(n, ++seed, 1e-2f),
           m = test::normal_values(n, ++seed, 1e-3f), v = test::normal_values(n, ++seed, 1e-3f);
      for (auto& x : v) x = x * x;
      for (std::size_t i = 0; i < n; i += 113) p[i] *= 50.0f;
      const BlockLayout l{ScalingMode::block_128x128, A, B}, tl{ScalingMode::block_128x128, B, A};
      const auto scales = static_cast<std::size_t>(E * (l.count() + tl.count()));
      struct Run {
        Buffer p, g, m, v, codes, scales;
      };
      auto make = [&] {
        Run r{test::to_device(p), test::to_device(g), test::to_device(m), test::to_device(v), Buffer(Device::cuda, 2 * n + 256),
              test::to_device(std::vector<float>(scales, -1.0f))};
        KILN_CUDA_CHECK(cudaMemset(r.codes.data(), 0x7f, 2 * n));
        return r;
      };
      auto step = [&](Run& r, std::int64_t first, std::int64_t rows) {
        AdamWQuantizeArgs u;
        u.param = TensorView(static_cast<float*>(r.p.data()) + first * B, {rows, B}, DType::f32, Device::cuda);
        u.grad = TensorView(static_cast<float*>(r.g.data()) + first * B, {rows, B}, DType::f32, Device::cuda);
        u.m = TensorView(static_cast<float*>(r.m.data()) + first * B, {rows, B}, DType::f32, Device::cuda);
        u.v = TensorView(static_cast<float*>(r.v.data()) + first * B, {rows, B}, DType::f32, Device::cuda);
        u.lr = 1e-3f, u.weight_decay = 0.1f, u.grad_scale = 0.5f, u.step = 9;
        return u;
      };
      auto groups_of = [&](Run& r) {
        std::vector<BlockGroup> gs;
        auto* c = static_cast<std::uint8_t*>(r.codes.data());
        auto* s = static_cast<float*>(r.scales.data());
        for (std::int64_t e = 0; e < E; ++e)
          gs.push_back({e * A, A, TensorView(c + e * A * B, {A, B}, DType::e4m3, Device::cuda), s + e * l.count(),
                        TensorView(c + n + e * A * B, {B, A}, DType::e4m3, Device::cuda),
                        s + E * l.count() + e * tl.count()});
        return gs;
      };
      Run grouped = make(), apart = make();
      const std::vector<BlockGroup> gg = groups_of(grouped), ga = groups_of(apart);
      AdamWQuantizeArgs u = step(grouped, 0, E * A);
      for (TensorView* t : {&u.param, &u.grad, &u.m, &u.v}) *t = t->reshape({E, A, B});  // stacked, as the layer holds it
      gpu->adamw_quantize_blocks_grouped(u, {TensorView{}, ScalingMode::block_128x128, pow2, gg});
      for (std::int64_t e = 0; e < E; ++e) {
        const BlockGroup& ge = ga[static_cast<std::size_t>(e)];
        gpu->adamw_quantize_blocks(step(apart, e * A, A), {TensorView{}, ScalingMode::block_128x128, pow2, ge.rowwise,
                                                          ge.row_scale_inv, ge.colwise, ge.col_scale_inv});
      }
      for (auto [a, b] : {std::pair{&grouped.p, &apart.p}, {&grouped.m, &apart.m}, {&grouped.v, &apart.v}})
        CHECK(test::same_device_bytes(a->data(), b->data(), n * 4));
      CHECK(test::to_host<float>(grouped.p.data(), n) != p);
      CHECK(test::same_device_bytes(grouped.codes.data(), apart.codes.data(), 2 * n));
      CHECK(test::same_device_bytes(grouped.scales.data(), apart.scales.data(), scales * 4));
    }
}

TEST_CASE("CUDA's block-scaled grouped linear (a mixture of experts) matches the CPU emulation: forward, data and "
          "weight gradients, both weight layouts") {
  KILN_REQUIRE_CUDA_BLOCK();
  auto gpu = make_cuda_ops(nullptr);
  auto cpu = make_cpu_ops({.threads = 2});
  // Experts of 5 rows (not a multiple of 4: its products go through scratch), 130, 0 and 17; rows past theirs.
  const std::vector<std::int32_t> off = {0, 5, 135, 135, 152};
  const std::int64_t E = 4, R = 160, IC = 272, OC = 144;
  auto bf16_values = [](std::size_t n, std::uint64_t seed, float scale, std::vector<std::uint16_t>& bits) {
    auto v = test::normal_values(n, seed, scale);
    bits.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      bits[i] = float_to_bf16_bits(v[i]);
      v[i] = bf16_bits_to_float(bits[i]);
    }
    return v;
  };
  auto from_bf16 = [](const std::vector<std::uint16_t>& b) {
    std::vector<float> v(b.size());
    for (std::size_t i = 0; i < b.size(); ++i) v[i] = bf16_bits_to_float(b[i]);
    return v;
  };
  for (const bool in_out : {false, true})
    for (const bool two_d : {false, true}) {
      CAPTURE(in_out);
      CAPTURE(two_d);
      BlockRecipe recipe;
      recipe.wgrad_input_2d = two_d;
      std::vector<std::uint16_t> xb, wb, gb;
      auto x = bf16_values(static_cast<std::size_t>(R * IC), 801, 2.0f, xb);
      auto w = bf16_values(static_cast<std::size_t>(E * OC * IC), 802, 0.05f, wb);
      auto g = bf16_values(static_cast<std::size_t>(R * OC), 803, 1e-3f, gb);
      const Shape wshape = in_out ? Shape{E, IC, OC} : Shape{E, OC, IC};
      // The CPU emulation, f32.
      Fp8Workspace cws(*cpu);
      Fp8BlockGroupedLinear clin(*cpu, cws, recipe, "cpu.experts");
      auto hv = [](std::vector<float>& v, Shape s) { return TensorView(v.data(), s, DType::f32, Device::cpu); };
      std::vector<float> out(static_cast<std::size_t>(R * OC), 0.0f), dx(static_cast<std::size_t>(R * IC)),
          dw(static_cast<std::size_t>(E * OC * IC), 0.5f);
      clin.forward({hv(out, {R, OC}), hv(x, {R, IC}), hv(w, wshape), off.data(), in_out}, 1);
      clin.backward({.dx = hv(dx, {R, IC}), .dweight = hv(dw, wshape), .dout = hv(g, {R, OC}), .x = hv(x, {R, IC}),
                     .weight = hv(w, wshape), .offsets_host = off.data(), .weight_in_out = in_out});
      // CUDA, bf16 activations.
      Fp8Workspace gws(*gpu);
      Fp8BlockGroupedLinear glin(*gpu, gws, recipe, "cuda.experts");
      Buffer dxv = test::to_device(xb), dwv = test::to_device(wb), dgv = test::to_device(gb);
      Buffer dout = test::to_device(std::vector<std::uint16_t>(out.size(), 0)), ddx = test::to_device(std::vector<std::uint16_t>(dx.size(), 0x3f80));
      Buffer ddw = test::to_device(std::vector<float>(dw.size(), 0.5f));
      auto dv = [](Buffer& b, Shape s, DType t) { return TensorView(b.data(), s, t, Device::cuda); };
      glin.forward({dv(dout, {R, OC}, DType::bf16), dv(dxv, {R, IC}, DType::bf16), dv(dwv, wshape, DType::bf16),
                    off.data(), in_out},
                   1);
      glin.backward({.dx = dv(ddx, {R, IC}, DType::bf16),
                     .dweight = dv(ddw, wshape, DType::f32),
                     .dout = dv(dgv, {R, OC}, DType::bf16),
                     .x = dv(dxv, {R, IC}, DType::bf16),
                     .weight = dv(dwv, wshape, DType::bf16),
                     .offsets_host = off.data(),
                     .weight_in_out = in_out});
      const auto got_out = from_bf16(test::to_host<std::uint16_t>(dout.data(), out.size()));
      const auto got_dx = from_bf16(test::to_host<std::uint16_t>(ddx.data(), dx.size()));
      auto got_dw = test::to_host<float>(ddw.data(), dw.size());
      auto minus_half = [](std::vector<float> v) {
        for (auto& e : v) e -= 0.5f;
        return v;
      };
      const double e_out = test::rel_error(got_out, out), e_dx = test::rel_error(got_dx, dx),
                   e_dw = test::rel_error(minus_half(got_dw), minus_half(dw));
      MESSAGE("relative differences from the CPU: out " << e_out << ", dx " << e_dx << ", dweight " << e_dw);
      // The codes are the CPU's bit for bit; the products differ by bf16's rounding of the results and
      // the tensor cores' f32 accumulation.
      CHECK(e_out < 5e-3);
      CHECK(e_dx < 5e-3);
      CHECK(e_dw < 1e-3);
      for (std::int64_t r = off[E]; r < R; ++r) CHECK(got_dx[static_cast<std::size_t>(r * IC)] == 0.0f);
    }
}
