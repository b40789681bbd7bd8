// CudaBackend's capture: the compute stream's work recorded as a CUDA graph (stream capture, this
// thread's work only, so other ranks' threads of the process go on), instantiated once and launched
// on the same stream.
#include "cuda_backend.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::ops::cuda_impl {

namespace {

class CudaGraph final : public CapturedWork {
 public:
  CudaGraph(cudaGraphExec_t exec, cudaStream_t stream) : exec_(exec), stream_(stream) {}
  ~CudaGraph() override { cudaGraphExecDestroy(exec_); }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  void launch() override { KILN_CUDA_CHECK(cudaGraphLaunch(exec_, stream_)); }

 private:
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
};

}  // namespace

void CudaBackend::begin_capture() {
  KILN_CHECK(can_capture(), "CUDA graph capture with backend.profile on (its per-op events cannot be captured)");
  KILN_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
}

std::unique_ptr<CapturedWork> CudaBackend::end_capture() {
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
  if (ended != cudaSuccess) {
    cudaGetLastError();  // clear the sticky capture error
    KILN_THROW("CUDA graph capture failed: ", cudaGetErrorString(ended),
               " (something in the captured work waited for the device or allocated)");
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiateWithFlags(&exec, graph, 0);
  cudaGraphDestroy(graph);
  KILN_CUDA_CHECK(made);
  return std::make_unique<CudaGraph>(exec, stream_);
}

}  // namespace kiln::ops::cuda_impl
