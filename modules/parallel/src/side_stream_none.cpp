// SideStream without CUDA: there is no device stream to overlap with.
#include "kiln/parallel/grad_buckets.hpp"

namespace kiln::parallel {

std::unique_ptr<SideStream> SideStream::create(void*, bool) { return nullptr; }

}  // namespace kiln::parallel

#include "kiln/parallel/stream_event.hpp"

namespace kiln::parallel {

StreamEvent::~StreamEvent() = default;
StreamEvent& StreamEvent::operator=(StreamEvent&& o) noexcept {
  event_ = o.event_;
  o.event_ = nullptr;
  return *this;
}
void StreamEvent::record(void*) {}
void StreamEvent::wait(void*) const {}
void StreamEvent::forget() {}
bool capturing(void*) { return false; }
void StreamEvent::synchronize() const {}

}  // namespace kiln::parallel
