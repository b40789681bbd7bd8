// The fp8 module's fused AdamW + quantisation with a bf16 gradient (optim.grads = "bf16") on the CPU
// ops: per-tensor (adamw_quantize, stacked matrices too) and 128x128 blocks (adamw_quantize_blocks,
// adamw_quantize_blocks_grouped) must write, bit for bit, what the same calls write with an f32
// gradient of the same (bf16-representable, never zero) values; f32 and bf16 moments.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "fp8_test_util.hpp"
#include "kiln/fp8/block.hpp"
#include "kiln/fp8/ops.hpp"
#include "kiln/tensor/bf16.hpp"

using namespace kiln;
using namespace kiln::fp8;

namespace {

// One side's weight, gradient (f32 or bf16 bits), moments (f32 or bf16 bits), copies and scales.
struct Update {
  Shape shape;
  bool bf16_grad, bf16_moments;
  std::vector<float> p, g, m, v, meta = {300.0f, 0.0f};  // meta: scale, amax
  std::vector<std::uint16_t> g16, m16, v16;
  std::vector<std::uint8_t> row, col;
  std::vector<float> row_scales, col_scales;

  Update(Shape s, std::uint64_t seed, bool bf16g, bool bf16m) : shape(s), bf16_grad(bf16g), bf16_moments(bf16m) {
    const auto n = static_cast<std::size_t>(s.numel());
    p = test::normal_values(n, seed, 0.05f);
    g = test::normal_values(n, seed + 1, 0.01f);
    m = test::normal_values(n, seed + 2, 1e-3f);
    v = test::normal_values(n, seed + 3, 1e-3f);
    for (std::size_t i = 0; i < n; ++i) {
      if (g[i] == 0.0f) g[i] = 1e-3f;
      g[i] = round_bf16(g[i]);  // a bf16 value, held either way
      v[i] = v[i] * v[i] + 1e-8f;
      g16.push_back(float_to_bf16_bits(g[i]));
      m16.push_back(float_to_bf16_bits(m[i]));
      v16.push_back(float_to_bf16_bits(v[i]));
    }
    row.assign(n, 0);
    col.assign(n, 0);
  }
  TensorView grad() {
    return bf16_grad ? TensorView(g16.data(), shape, DType::bf16, Device::cpu) : TensorView(g.data(), shape, DType::f32, Device::cpu);
  }
  TensorView moment(std::vector<float>& f, std::vector<std::uint16_t>& b) {
    return bf16_moments ? TensorView(b.data(), shape, DType::bf16, Device::cpu) : TensorView(f.data(), shape, DType::f32, Device::cpu);
  }
  AdamWQuantizeArgs args() {
    AdamWQuantizeArgs a;
    a.param = TensorView(p.data(), shape, DType::f32, Device::cpu);
    a.grad = grad();
    a.m = moment(m, m16);
    a.v = moment(v, v16);
    a.lr = 3e-3f;
    a.weight_decay = 0.1f;
    a.grad_scale = 0.8f;
    a.step = 7;
    return a;
  }
  // The weight's rows and columns (stacked matrices: all their rows).
  std::int64_t rows() const { return shape.numel() / shape[-1]; }
  std::int64_t cols() const { return shape[-1]; }
  // The same state, whatever the gradient's dtype (the moments compared as held).
  bool same_state(const Update& o) const {
    const bool moments = bf16_moments ? m16 == o.m16 && v16 == o.v16 : test::same_bits(m, o.m) && test::same_bits(v, o.v);
    return test::same_bits(p, o.p) && moments && row == o.row && col == o.col && test::same_bits(meta, o.meta) &&
           test::same_bits(row_scales, o.row_scales) && test::same_bits(col_scales, o.col_scales);
  }
};

}  // namespace

TEST_CASE("fp8 adamw_quantize with a bf16 gradient equals the f32 gradient's step and copies, bit for bit") {
  auto cpu = make_cpu_ops({.threads = 2});
  std::uint64_t seed = 7000;
  for (const Shape shape : {Shape{33, 47}, Shape{80, 48}, Shape{3, 48, 80}})
    for (const bool bf16m : {false, true}) {
      INFO(shape.str() << (bf16m ? " bf16 moments" : " f32 moments"));
      seed += 10;
      Update with32(shape, seed, false, bf16m), with16(shape, seed, true, bf16m);
      for (Update* u : {&with32, &with16}) {
        AdamWQuantizeArgs a = u->args();
        const std::int64_t R = u->rows() / (shape.ndim == 3 ? shape[0] : 1), C = u->cols();
        const Shape transposed = shape.ndim == 3 ? Shape{shape[0], C, R} : Shape{C, R};
        a.out.rowwise = TensorView(u->row.data(), shape, DType::e4m3, Device::cpu);
        a.out.colwise = TensorView(u->col.data(), transposed, DType::e4m3, Device::cpu);
        a.out.format = Format::e4m3;
        a.out.scale = u->meta.data();
        a.amax = u->meta.data() + 1;
        cpu->adamw_quantize(a);
      }
      CHECK(with16.same_state(with32));
      CHECK(with32.meta[1] > 0.0f);
    }
}

TEST_CASE("fp8 adamw_quantize_blocks and its grouped form with a bf16 gradient equal the f32 gradient's, bit for bit") {
  auto cpu = make_cpu_ops({.threads = 2});
  std::uint64_t seed = 7500;
  for (auto [R, C] : {std::pair<std::int64_t, std::int64_t>{300, 200}, {130, 129}})
    for (const bool bf16m : {false, true})
      for (const bool grouped : {false, true}) {
        INFO(R << " x " << C << (bf16m ? " bf16 moments" : " f32 moments") << (grouped ? " grouped" : ""));
        seed += 10;
        Update with32(Shape{R, C}, seed, false, bf16m), with16(Shape{R, C}, seed, true, bf16m);
        // Groups: rows [0, 70), none, [70, R) (one across a 128-row block).
        const std::int64_t split = 70;
        for (Update* u : {&with32, &with16}) {
          if (!grouped) {
            const BlockLayout l{ScalingMode::block_128x128, R, C}, tl{ScalingMode::block_128x128, C, R};
            u->row_scales.assign(static_cast<std::size_t>(l.count()), -1.0f);
            u->col_scales.assign(static_cast<std::size_t>(tl.count()), -1.0f);
            cpu->adamw_quantize_blocks(
                u->args(), BlockQuantizeArgs{TensorView{}, ScalingMode::block_128x128, false,
                                             TensorView(u->row.data(), {R, C}, DType::e4m3, Device::cpu),
                                             u->row_scales.data(),
                                             TensorView(u->col.data(), {C, R}, DType::e4m3, Device::cpu),
                                             u->col_scales.data()});
            continue;
          }
          const BlockLayout a{ScalingMode::block_128x128, split, C}, b{ScalingMode::block_128x128, R - split, C};
          const BlockLayout ta{ScalingMode::block_128x128, C, split}, tb{ScalingMode::block_128x128, C, R - split};
          u->row_scales.assign(static_cast<std::size_t>(a.count() + b.count()), -1.0f);
          u->col_scales.assign(static_cast<std::size_t>(ta.count() + tb.count()), -1.0f);
          std::uint8_t *row = u->row.data(), *col = u->col.data();
          float *rs = u->row_scales.data(), *cs = u->col_scales.data();
          const BlockGroup groups[] = {
              {0, split, TensorView(row, {split, C}, DType::e4m3, Device::cpu), rs,
               TensorView(col, {C, split}, DType::e4m3, Device::cpu), cs},
              {split, 0, {}, nullptr, {}, nullptr},
              {split, R - split, TensorView(row + split * C, {R - split, C}, DType::e4m3, Device::cpu), rs + a.count(),
               TensorView(col + split * C, {C, R - split}, DType::e4m3, Device::cpu), cs + ta.count()}};
          cpu->adamw_quantize_blocks_grouped(u->args(),
                                             GroupedBlockQuantizeArgs{TensorView{}, ScalingMode::block_128x128, false, groups});
        }
        CHECK(with16.same_state(with32));
        CHECK(with32.row_scales[0] > 0.0f);
      }
}

TEST_CASE("fp8 adamw_quantize refuses a gradient of another dtype, naming it") {
  auto cpu = make_cpu_ops();
  Update u(Shape{16, 16}, 1, false, false);
  std::vector<std::int32_t> ints(256, 1);
  AdamWQuantizeArgs a = u.args();
  a.grad = TensorView(ints.data(), {16, 16}, DType::i32, Device::cpu);
  CHECK_THROWS_WITH_AS(cpu->adamw_quantize(a), doctest::Contains("fp8 adamw_quantize grad: expected f32 or bf16"), Error);
}
