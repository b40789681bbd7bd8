// Backend capture, for backends that cannot: an error naming it.
#include "kiln/core/error.hpp"
#include "kiln/ops/backend.hpp"

namespace kiln::ops {

void Backend::begin_capture() { KILN_THROW("this backend (", name_of(device()), ") cannot capture device work"); }

std::unique_ptr<CapturedWork> Backend::end_capture() {
  KILN_THROW("this backend (", name_of(device()), ") cannot capture device work");
}

}  // namespace kiln::ops
