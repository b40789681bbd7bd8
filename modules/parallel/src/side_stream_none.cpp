// SideStream without CUDA: there is no device stream to overlap with.
#include "kiln/parallel/grad_buckets.hpp"

namespace kiln::parallel {

std::unique_ptr<SideStream> SideStream::create(void*) { return nullptr; }

}  // namespace kiln::parallel
