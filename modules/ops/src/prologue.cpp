#include "kiln/ops/prologue.hpp"

namespace kiln::ops {

namespace {
template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;  // clang 14 deduces no aggregate's arguments
}  // namespace

Prologue prologue_of(const LinearInput& x) {
  return std::visit(Overloaded{[](const TensorView&) { return Prologue::plain; },
                               [](const LayerNormOnLoad&) { return Prologue::layernorm; },
                               [](const GeluOnLoad&) { return Prologue::gelu; },
                               [](const SwigluOnLoad&) { return Prologue::swiglu; }},
                    x);
}

Prologue prologue_of(const OutputGrad& dout) {
  return std::holds_alternative<TensorView>(dout) ? Prologue::plain : Prologue::dgelu;
}

const char* name_of(Prologue p) {
  switch (p) {
    case Prologue::plain: return "plain";
    case Prologue::layernorm: return "layernorm-on-load";
    case Prologue::gelu: return "gelu-on-load";
    case Prologue::swiglu: return "swiglu-on-load";
    case Prologue::dgelu: return "dgelu-on-load";
  }
  return "?";
}

}  // namespace kiln::ops
