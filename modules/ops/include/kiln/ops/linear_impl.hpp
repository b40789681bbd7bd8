#pragma once
// A replacement for the backend's linear ops on one linear layer. A module (fp8, for example)
// attaches it as a component to a Linear entity; the model then calls it instead of
// Backend::linear_forward / linear_backward for that layer, and knows nothing else about it.
// The arguments and their contract are those of the backend ops, plus the capabilities below.
#include <functional>

#include "kiln/ops/backend.hpp"

namespace kiln::ops {

struct LinearImpl {
  std::function<void(const LinearForward&)> forward;
  std::function<void(const LinearBackward&)> backward;
  // backward takes LinearBackward::dout_gelu_pre: the model may then hand it the gradient of the
  // GELU output and leave the dGELU to it (fused with whatever it does to dout anyway).
  bool fuses_dout_gelu = false;
  // backward never reads LinearBackward::x: the forward kept what the backward needs (an FP8 copy
  // of the input, say), so the model need not store or recompute x for this layer.
  bool keeps_input = false;
  // forward and backward take LinearForward/LinearBackward::x_gelu_pre: the model may then hand the
  // pre-activation of a GELU instead of storing (or recomputing) the GELU's output.
  bool takes_gelu_input = false;
  // forward and backward take LinearForward/LinearBackward::x_ln (the input as the LayerNorm of the
  // block's residual): the model then neither writes nor recomputes that LayerNorm output.
  bool takes_layernorm_input = false;
  // forward and backward take LinearForward/LinearBackward::x_swiglu_pre: the model may then hand
  // FC1's [gate | up] output instead of storing (or recomputing) the SwiGLU's output.
  bool takes_swiglu_input = false;
};

// The backend's own linear ops as a LinearImpl (no capabilities), for layers that take one.
inline LinearImpl backend_linear_impl(Backend& be) {
  return {[&be](const LinearForward& a) { be.linear_forward(a); },
          [&be](const LinearBackward& a) { be.linear_backward(a); }};
}

}  // namespace kiln::ops
