// SideStream on CUDA: a non-blocking stream and one reusable event per direction.
#include <cuda_runtime_api.h>

#include "kiln/parallel/grad_buckets.hpp"
#include "kiln/parallel/stream_event.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::parallel {

namespace {
class CudaSideStream final : public SideStream {
 public:
  CudaSideStream(cudaStream_t compute, bool high_priority) : compute_(compute) {
    int least = 0, greatest = 0;
    if (high_priority) KILN_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    KILN_CUDA_CHECK(cudaStreamCreateWithPriority(&side_, cudaStreamNonBlocking, high_priority ? greatest : least));
    KILN_CUDA_CHECK(cudaEventCreateWithFlags(&computed_, cudaEventDisableTiming));
    KILN_CUDA_CHECK(cudaEventCreateWithFlags(&reduced_, cudaEventDisableTiming));
  }
  ~CudaSideStream() override {
    cudaStreamSynchronize(side_);
    cudaEventDestroy(computed_);
    cudaEventDestroy(reduced_);
    cudaStreamDestroy(side_);
  }
  void* stream() const override { return side_; }
  // cudaStreamWaitEvent waits for the event's most recent record, so one event serves every bucket.
  void wait_for_compute() override {
    KILN_CUDA_CHECK(cudaEventRecord(computed_, compute_));
    KILN_CUDA_CHECK(cudaStreamWaitEvent(side_, computed_, 0));
  }
  void compute_waits() override {
    KILN_CUDA_CHECK(cudaEventRecord(reduced_, side_));
    KILN_CUDA_CHECK(cudaStreamWaitEvent(compute_, reduced_, 0));
  }
  bool capturing() const override { return parallel::capturing(side_); }

 private:
  cudaStream_t compute_, side_ = nullptr;
  cudaEvent_t computed_ = nullptr, reduced_ = nullptr;
};
}  // namespace

std::unique_ptr<SideStream> SideStream::create(void* compute_stream, bool high_priority) {
  if (!compute_stream) return nullptr;
  return std::make_unique<CudaSideStream>(static_cast<cudaStream_t>(compute_stream), high_priority);
}


StreamEvent::~StreamEvent() {
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

StreamEvent& StreamEvent::operator=(StreamEvent&& o) noexcept {
  if (this != &o) {
    if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
    event_ = o.event_;
    o.event_ = nullptr;
  }
  return *this;
}

void StreamEvent::record(void* stream) {
  if (!stream) return;
  if (!event_) {
    cudaEvent_t e = nullptr;
    KILN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    event_ = e;
  }
  KILN_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream)));
}

void StreamEvent::wait(void* stream) const {
  if (!stream || !event_) return;
  KILN_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event_), 0));
}

void StreamEvent::forget() {
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
  event_ = nullptr;
}

bool capturing(void* stream) {
  if (!stream) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  KILN_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  return status != cudaStreamCaptureStatusNone;
}

void StreamEvent::synchronize() const {
  if (event_) KILN_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)));
}

}  // namespace kiln::parallel
