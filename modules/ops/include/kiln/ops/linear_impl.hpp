#pragma once
// A replacement for the backend's linear ops on one linear layer. A module (fp8, for example)
// attaches it as a component to a Linear entity; the model then calls it instead of
// Backend::linear_forward / linear_backward for that layer, and knows nothing else about it.
// The arguments and their contract are those of the backend ops; what an implementation adds is
// said by two values: the prologues it takes, and whether it keeps its own copy of its input.
#include <functional>

#include "kiln/ops/backend.hpp"

namespace kiln::ops {

struct LinearImpl {
  std::function<void(const LinearForward&)> forward;
  std::function<void(const LinearBackward&)> backward;
  // The operands it takes through a prologue (prologue.hpp), forward and backward alike: the model
  // may then hand it, say, a GELU's pre-activation instead of writing (or recomputing) the GELU's
  // output. The backend's own ops take the plain tensors alone.
  PrologueSet prologues = {Prologue::plain};
  // backward never reads LinearBackward::x: the forward kept what the backward needs (an FP8 copy
  // of the input, say), so the model need not store or recompute x for this layer.
  bool keeps_input = false;
};

// The backend's own linear ops as a LinearImpl (plain operands only), for layers that take one.
inline LinearImpl backend_linear_impl(Backend& be) {
  return {[&be](const LinearForward& a) { be.linear_forward(a); },
          [&be](const LinearBackward& a) { be.linear_backward(a); }};
}

}  // namespace kiln::ops
