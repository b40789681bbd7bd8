// SideStream on CUDA: a non-blocking stream and one reusable event per direction.
#include <cuda_runtime_api.h>

#include "kiln/parallel/grad_buckets.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::parallel {

namespace {
class CudaSideStream final : public SideStream {
 public:
  explicit CudaSideStream(cudaStream_t compute) : compute_(compute) {
    KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
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

 private:
  cudaStream_t compute_, side_ = nullptr;
  cudaEvent_t computed_ = nullptr, reduced_ = nullptr;
};
}  // namespace

std::unique_ptr<SideStream> SideStream::create(void* compute_stream) {
  if (!compute_stream) return nullptr;
  return std::make_unique<CudaSideStream>(static_cast<cudaStream_t>(compute_stream));
}

}  // namespace kiln::parallel
