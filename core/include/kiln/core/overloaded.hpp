#pragma once
// std::visit over a variant with one lambda per alternative: std::visit(Overloaded{f, g, ...}, v).

namespace kiln {

template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;  // clang 14 deduces no aggregate's arguments

}  // namespace kiln
