// What the Backend interface does for backends that do nothing better: capture is an error naming
// the backend, zero_many zeroes one tensor after another.
#include "kiln/core/error.hpp"
#include "kiln/ops/backend.hpp"

namespace kiln::ops {

void Backend::begin_capture() { KILN_THROW("this backend (", name_of(device()), ") cannot capture device work"); }

std::unique_ptr<CapturedWork> Backend::end_capture() {
  KILN_THROW("this backend (", name_of(device()), ") cannot capture device work");
}

void Backend::zero_many(std::span<const TensorView> ts) {
  for (const TensorView& t : ts) zero(t);
}

}  // namespace kiln::ops
