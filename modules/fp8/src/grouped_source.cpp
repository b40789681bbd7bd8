// The shapes of quantisation sources (QuantizeSource, GroupedQuantizeArgs::x), checked.
#include <variant>

#include "kiln/core/error.hpp"
#include "kiln/core/overloaded.hpp"
#include "kiln/fp8/ops.hpp"

namespace kiln::fp8 {

namespace {

void expect_2d(const TensorView& t, const char* what, const char* arg) {
  KILN_CHECK(t && t.ndim() == 2, what, ": ", arg, " must be a 2-D tensor, got ", t.str());
}

}  // namespace

QuantizeSource to_source(const GroupedSource& x) {
  return std::visit([](const auto& v) { return QuantizeSource(v); }, x);
}
QuantizeSource to_source(const ops::LinearInput& x) {
  return std::visit([](const auto& v) { return QuantizeSource(v); }, x);
}
QuantizeSource to_source(const ops::OutputGrad& dout) {
  return std::visit(Overloaded{[](const ops::XentOnLoad&) -> QuantizeSource {
                                 KILN_THROW("a cross-entropy gradient on load is no grouped quantisation's source");
                               },
                               [](const auto& v) { return QuantizeSource(v); }},
                    dout);
}

QuantizeSource source_rows(const QuantizeSource& x, std::int64_t r0, std::int64_t n) {
  return std::visit(Overloaded{[&](const TensorView& t) { return QuantizeSource(t.rows(r0, n)); },
                              [&](const ops::LayerNormOnLoad& ln) {
                                ops::LayerNormOnLoad s = ln;
                                s.x = ln.x.rows(r0, n);
                                s.mean = ln.mean.rows(r0, n);
                                s.rstd = ln.rstd.rows(r0, n);
                                return QuantizeSource(s);
                              },
                              [&](const ops::GeluOnLoad& g) { return QuantizeSource(ops::GeluOnLoad{g.pre.rows(r0, n)}); },
                              [&](const ops::SwigluOnLoad& g) {
                                return QuantizeSource(ops::SwigluOnLoad{g.gate_up.rows(r0, n)});
                              },
                              [&](const ops::DgeluOnLoad& g) {
                                return QuantizeSource(ops::DgeluOnLoad{g.dgelu.rows(r0, n), g.pre.rows(r0, n)});
                              },
                              [&](const ops::DswigluOnLoad& g) {
                                return QuantizeSource(ops::DswigluOnLoad{g.dswiglu.rows(r0, n), g.gate_up.rows(r0, n)});
                              }},
                    x);
}

Shape source_shape(const QuantizeSource& x, const char* what) {
  return std::visit(
      Overloaded{[&](const TensorView& t) {
                   expect_2d(t, what, "x");
                   return t.shape;
                 },
                 [&](const ops::LayerNormOnLoad& ln) {
                   expect_2d(ln.x, what, "the LayerNorm's input");
                   const std::int64_t R = ln.x.size(0), C = ln.x.size(1);
                   KILN_CHECK(ln.weight.numel() == C && ln.bias.numel() == C && ln.mean.numel() == R &&
                                  ln.rstd.numel() == R && ln.mean.dtype == DType::f32 && ln.rstd.dtype == DType::f32,
                              what, ": the LayerNorm's weight ", ln.weight.str(), ", bias ", ln.bias.str(), ", mean ",
                              ln.mean.str(), " and rstd ", ln.rstd.str(), " for its input ", ln.x.str());
                   return ln.x.shape;
                 },
                 [&](const ops::GeluOnLoad& g) {
                   expect_2d(g.pre, what, "the GELU's pre-activation");
                   return g.pre.shape;
                 },
                 [&](const ops::SwigluOnLoad& g) {
                   expect_2d(g.gate_up, what, "the SwiGLU's input");
                   KILN_CHECK(g.gate_up.size(1) % 2 == 0, what, ": the SwiGLU's input ", g.gate_up.str(),
                              " needs an even column count (gate, then up)");
                   return Shape{g.gate_up.size(0), g.gate_up.size(1) / 2};
                 },
                 [&](const ops::DgeluOnLoad& g) {
                   expect_2d(g.pre, what, "the GELU's pre-activation");
                   KILN_CHECK(g.dgelu.shape == g.pre.shape && g.dgelu.dtype == g.pre.dtype, what,
                              ": the GELU output's gradient ", g.dgelu.str(), " for the pre-activation ", g.pre.str());
                   return g.pre.shape;
                 },
                 [&](const ops::DswigluOnLoad& g) {
                   expect_2d(g.gate_up, what, "the SwiGLU's input");
                   const std::int64_t R = g.gate_up.size(0), C = g.gate_up.size(1);
                   KILN_CHECK(C % 2 == 0 && g.dswiglu.shape == Shape({R, C / 2}) && g.dswiglu.dtype == g.gate_up.dtype,
                              what, ": the SwiGLU output's gradient ", g.dswiglu.str(), " for the SwiGLU's input ",
                              g.gate_up.str());
                   return g.gate_up.shape;
                 }},
      x);
}

Shape grouped_source_shape(const GroupedSource& x, const char* what) { return source_shape(to_source(x), what); }

}  // namespace kiln::fp8
