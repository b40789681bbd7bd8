#pragma once
// A replacement for the backend's linear ops on one linear layer. A module (fp8, for example)
// attaches it as a component to a Linear entity; the model then calls it instead of
// Backend::linear_forward / linear_backward for that layer, and knows nothing else about it.
// The arguments and their contract are exactly those of the backend ops.
#include <functional>

#include "kiln/ops/backend.hpp"

namespace kiln::ops {

struct LinearImpl {
  std::function<void(const LinearForward&)> forward;
  std::function<void(const LinearBackward&)> backward;
};

}  // namespace kiln::ops
