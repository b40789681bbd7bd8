// A mixture of experts' grouped linears with FP8 block scaling on the CPU emulation: the padded
// outputs of block quantisation (zero rows appended), and Fp8BlockGroupedLinear against
// Fp8BlockLinear run on each expert's rows alone, for both weight layouts and both weight-gradient
// input options: experts whose rows are not multiples of 4 or 16, one across a 128-row block, one
// without rows, rows past the experts'.
#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "fp8_test_util.hpp"
#include "host_view.hpp"
#include "kiln/fp8/block.hpp"
#include "kiln/fp8/block_grouped_linear.hpp"
#include "kiln/fp8/block_linear.hpp"

using namespace kiln;
using kiln::test::view;
using namespace kiln::fp8;

namespace {

std::vector<float> rows(const std::vector<float>& v, std::int64_t r0, std::int64_t n, std::int64_t cols) {
  return {v.begin() + r0 * cols, v.begin() + (r0 + n) * cols};
}

}  // namespace

TEST_CASE("block quantisation into padded outputs equals quantising x with zero rows appended") {
  auto cpu = make_cpu_ops({.threads = 2});
  for (auto mode : {ScalingMode::block_1x128, ScalingMode::block_128x128})
    for (auto [R, Rr, Rc] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{5, 8, 16}, {130, 132, 144}, {128, 128, 256}}) {
      CAPTURE(R);
      CAPTURE(static_cast<int>(mode));
      const std::int64_t C = 200;
      auto x = test::normal_values(static_cast<std::size_t>(R * C), static_cast<std::uint64_t>(R) + 40, 3.0f);
      // The reference: x padded to max(Rr, Rc) rows of zeros, quantised unpadded.
      const std::int64_t P = std::max(Rr, Rc);
      std::vector<float> padded(static_cast<std::size_t>(P * C), 0.0f);
      std::copy(x.begin(), x.end(), padded.begin());
      const BlockLayout rl{mode, Rr, C}, cl{mode, C, Rc}, pl{mode, P, C}, ptl{mode, C, P};
      std::vector<std::uint8_t> pc(padded.size()), ptc(padded.size());
      std::vector<float> ps(static_cast<std::size_t>(pl.count())), pts(static_cast<std::size_t>(ptl.count()));
      cpu->quantize_blocks({view(padded, {P, C}), mode, false, TensorView(pc.data(), {P, C}, DType::e4m3, Device::cpu),
                            ps.data(), TensorView(ptc.data(), {C, P}, DType::e4m3, Device::cpu), pts.data()});
      std::vector<std::uint8_t> rc(static_cast<std::size_t>(Rr * C)), cc(static_cast<std::size_t>(C * Rc));
      std::vector<float> rs(static_cast<std::size_t>(rl.count()), -1.0f), cs(static_cast<std::size_t>(cl.count()), -1.0f);
      cpu->quantize_blocks({view(x, {R, C}), mode, false, TensorView(rc.data(), {Rr, C}, DType::e4m3, Device::cpu),
                            rs.data(), TensorView(cc.data(), {C, Rc}, DType::e4m3, Device::cpu), cs.data()});
      // Rowwise: the first Rr rows of the padded quantisation, and their scales.
      CHECK(std::vector<std::uint8_t>(pc.begin(), pc.begin() + Rr * C) == rc);
      for (std::int64_t r = 0; r < Rr; ++r)
        for (std::int64_t c = 0; c < C; c += kBlock) CHECK(rs[rl.index(r, c)] == ps[pl.index(r, c)]);
      // Colwise: the first Rc columns of each row of the padded transpose.
      for (std::int64_t c = 0; c < C; ++c)
        for (std::int64_t r = 0; r < Rc; ++r) {
          CHECK(cc[c * Rc + r] == ptc[c * P + r]);
          if (r % kBlock == 0) CHECK(cs[cl.index(c, r)] == pts[ptl.index(c, r)]);
        }
    }
  std::vector<float> x(10 * 32, 1.0f), db(32, 0.0f);
  std::vector<std::uint8_t> codes(16 * 32);
  std::vector<float> s(64);
  CHECK_THROWS_WITH_AS(cpu->quantize_blocks({view(x, {10, 32}), ScalingMode::block_1x128, false,
                                             TensorView(codes.data(), {8, 32}, DType::e4m3, Device::cpu), s.data()}),
                       doctest::Contains("rowwise"), Error);
  BlockQuantizeArgs with_dbias{view(x, {10, 32}), ScalingMode::block_1x128, false,
                               TensorView(codes.data(), {16, 32}, DType::e4m3, Device::cpu), s.data()};
  with_dbias.dbias = view(db, {32});
  CHECK_THROWS_WITH_AS(cpu->quantize_blocks(with_dbias), doctest::Contains("dbias"), Error);
}

TEST_CASE("Fp8BlockGroupedLinear equals Fp8BlockLinear on each expert's rows: forward, data and weight gradients") {
  auto cpu = make_cpu_ops({.threads = 2});
  // Experts of 5 rows (not a multiple of 4), 130 (across a block, not of 16), 0 and 17; rows past theirs.
  const std::vector<std::int32_t> off = {0, 5, 135, 135, 152};
  const int E = 4, R = 160, IC = 200, OC = 136;
  for (const bool in_out : {false, true})
    for (const bool two_d : {false, true})
      for (const bool keep : {false, true}) {
        CAPTURE(in_out);
        CAPTURE(two_d);
        CAPTURE(keep);
        BlockRecipe recipe;
        recipe.wgrad_input_2d = two_d;
        Fp8Workspace ws(*cpu);
        // keep: the input's transposes kept from the forward; the backward is given no input (and
        // the forward's input is overwritten in between).
        Fp8BlockGroupedLinear lin(*cpu, ws, recipe, "test.experts", keep);
        auto x = test::normal_values(R * IC, 61, 2.0f), w = test::normal_values(E * OC * IC, 62, 0.05f),
             dout = test::normal_values(R * OC, 63, 1e-3f);
        for (std::size_t i = 0; i < x.size(); i += 97) x[i] *= 50.0f;  // outliers: the blocks matter
        const Shape wshape = in_out ? Shape{E, IC, OC} : Shape{E, OC, IC};
        std::vector<float> out(R * OC, 7.0f), dx(R * IC, 3.0f), dw(E * OC * IC, 0.5f);
        std::vector<float> x_in = x;
        lin.forward({view(out, {R, OC}), view(x_in, {R, IC}), view(w, wshape), off.data(), in_out}, 1);
        if (keep) std::fill(x_in.begin(), x_in.end(), 1e6f);
        lin.backward({.dx = view(dx, {R, IC}),
                      .dweight = view(dw, wshape),
                      .dout = view(dout, {R, OC}),
                      .x = keep ? TensorView{} : view(x_in, {R, IC}),
                      .weight = view(w, wshape),
                      .offsets_host = off.data(),
                      .weight_in_out = in_out});
        for (int r = off[E]; r < R; ++r) {  // rows past the experts': out left alone, dx zero
          CHECK(out[r * OC] == 7.0f);
          CHECK(dx[r * IC] == 0.0f);
        }
        for (int e = 0; e < E; ++e) {
          CAPTURE(e);
          const std::int64_t n = off[e + 1] - off[e];
          // Expert e's weight as [OC, IC].
          std::vector<float> we(static_cast<std::size_t>(OC * IC));
          std::memcpy(we.data(), w.data() + e * OC * IC, we.size() * 4);
          if (in_out) we = test::transpose(we, IC, OC);
          std::vector<float> dwe(static_cast<std::size_t>(OC * IC));
          std::memcpy(dwe.data(), dw.data() + e * OC * IC, dwe.size() * 4);
          if (in_out) dwe = test::transpose(dwe, IC, OC);
          if (n == 0) {  // no rows: nothing added
            CHECK(dwe == std::vector<float>(dwe.size(), 0.5f));
            continue;
          }
          // The FC2's weight gradient takes x's transpose as its first operand: 1x128 there always.
          BlockRecipe one = recipe;
          one.wgrad_input_2d = two_d && !in_out;
          Fp8Workspace ws1(*cpu);
          Fp8BlockLinear ref(*cpu, ws1, one, "test.expert");
          auto xe = rows(x, off[e], n, IC), ge = rows(dout, off[e], n, OC);
          std::vector<float> oe(static_cast<std::size_t>(n * OC)), dxe(static_cast<std::size_t>(n * IC)),
              dwr(static_cast<std::size_t>(OC * IC), 0.5f);
          ref.forward({view(oe, {n, OC}), {}, view(xe, {n, IC}), view(we, {OC, IC}), {}}, 1);
          ref.backward(
              {view(dxe, {n, IC}), view(dwr, {OC, IC}), {}, view(ge, {n, OC}), view(xe, {n, IC}), view(we, {OC, IC})});
          CHECK(rows(out, off[e], n, OC) == oe);
          CHECK(rows(dx, off[e], n, IC) == dxe);
          // The weight gradient: the same blocks and sums, the zero padding adding nothing; an FC2's
          // operands swapped, so its scales are applied in the other order (f32 rounding).
          if (in_out)
            CHECK(test::rel_error(dwe, dwr) < 1e-6);
          else
            CHECK(dwe == dwr);
          CHECK(dwe != std::vector<float>(dwe.size(), 0.5f));
        }
      }
}
