#include "kiln/ops/prologue.hpp"

#include "kiln/core/overloaded.hpp"

namespace kiln::ops {

Prologue prologue_of(const LinearInput& x) {
  return std::visit(Overloaded{[](const TensorView&) { return Prologue::plain; },
                               [](const LayerNormOnLoad&) { return Prologue::layernorm; },
                               [](const GeluOnLoad&) { return Prologue::gelu; },
                               [](const SwigluOnLoad&) { return Prologue::swiglu; }},
                    x);
}

Prologue prologue_of(const OutputGrad& dout) {
  return std::visit(Overloaded{[](const TensorView&) { return Prologue::plain; },
                               [](const DgeluOnLoad&) { return Prologue::dgelu; },
                               [](const DswigluOnLoad&) { return Prologue::dswiglu; },
                               [](const XentOnLoad&) { return Prologue::xent; }},
                    dout);
}

const char* name_of(Prologue p) {
  switch (p) {
    case Prologue::plain: return "plain";
    case Prologue::layernorm: return "layernorm-on-load";
    case Prologue::gelu: return "gelu-on-load";
    case Prologue::swiglu: return "swiglu-on-load";
    case Prologue::dgelu: return "dgelu-on-load";
    case Prologue::dswiglu: return "dswiglu-on-load";
    case Prologue::xent: return "cross-entropy-gradient-on-load";
  }
  return "?";
}

}  // namespace kiln::ops
