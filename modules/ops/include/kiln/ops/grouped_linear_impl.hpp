#pragma once
// A replacement for the backend's grouped linear ops (a mixture of experts' experts) on one grouped
// linear layer, as ops::LinearImpl is for a linear: a module (fp8, for example) attaches it as a
// component to an nn::GroupedLinear entity; the model then calls it instead of
// Backend::grouped_linear_forward / grouped_linear_backward, with the same arguments and contract.
#include <functional>

#include "kiln/ops/backend.hpp"

namespace kiln::ops {

struct GroupedLinearImpl {
  std::function<void(const GroupedLinearForward&)> forward;
  std::function<void(const GroupedLinearBackward&)> backward;
  // The prologues it takes (LinearImpl::prologues): the backend's ops take the plain tensors alone.
  PrologueSet prologues = {Prologue::plain};
  // backward never reads GroupedLinearBackward::x (LinearImpl::keeps_input).
  bool keeps_input = false;
};

// The backend's own grouped linear ops as a GroupedLinearImpl.
inline GroupedLinearImpl backend_grouped_linear_impl(Backend& be) {
  return {[&be](const GroupedLinearForward& a) { be.grouped_linear_forward(a); },
          [&be](const GroupedLinearBackward& a) { be.grouped_linear_backward(a); }};
}

}  // namespace kiln::ops
