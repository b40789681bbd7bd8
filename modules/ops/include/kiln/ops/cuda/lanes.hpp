#pragma once
// Streams that independent matmuls (a mixture of experts' experts) spread over: lane 0 is the
// owner's stream with the owner's cuBLASLt workspace, lanes 1..kLanes-1 are this object's streams,
// each with a workspace of the same size. fork(n) makes lanes 1..n-1 wait for the work queued on the
// owner's stream so far, join(n) makes the owner's stream wait for theirs (events: safe under stream
// capture). Whatever runs on a lane writes its own outputs; the buffers it reads and writes stay
// alive because the owner's stream, which frees them in order, waits at the join.
// TransformerEngine's grouped GEMM spreads its GEMMs over compute streams the same way.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <utility>

#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {

class LtLanes {
 public:
  static constexpr int kLanes = 4;

  // Made on the device that owns `stream` (the current one).
  LtLanes(cudaStream_t stream, void* workspace, std::size_t workspace_bytes)
      : stream_(stream), workspace_(workspace), bytes_(workspace_bytes) {
    try {
      KILN_CUDA_CHECK(cudaEventCreateWithFlags(&forked_, cudaEventDisableTiming));
      for (std::size_t i = 0; i < side_.size(); ++i) {
        KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&side_[i], cudaStreamNonBlocking));
        KILN_CUDA_CHECK(cudaEventCreateWithFlags(&joined_[i], cudaEventDisableTiming));
        side_ws_[i] = Buffer(Device::cuda, workspace_bytes);
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~LtLanes() { release(); }
  LtLanes(const LtLanes&) = delete;
  LtLanes& operator=(const LtLanes&) = delete;

  // The lanes `jobs` independent jobs use: one each, at most kLanes, at least 1.
  static int lanes_for(int jobs) { return std::clamp(jobs, 1, kLanes); }
  cudaStream_t stream(int lane) const { return lane == 0 ? stream_ : side_[static_cast<std::size_t>(lane - 1)]; }
  void* workspace(int lane) const {
    return lane == 0 ? workspace_ : side_ws_[static_cast<std::size_t>(lane - 1)].data();
  }
  std::size_t workspace_bytes() const { return bytes_; }

  void fork(int n) {
    if (n <= 1) return;
    KILN_CUDA_CHECK(cudaEventRecord(forked_, stream_));
    for (int i = 1; i < n; ++i) KILN_CUDA_CHECK(cudaStreamWaitEvent(stream(i), forked_, 0));
  }
  void join(int n) {
    for (int i = 1; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i - 1);
      KILN_CUDA_CHECK(cudaEventRecord(joined_[k], side_[k]));
      KILN_CUDA_CHECK(cudaStreamWaitEvent(stream_, joined_[k], 0));
    }
  }

 private:
  void release() noexcept {
    for (auto& s : side_)
      if (s) cudaStreamDestroy(std::exchange(s, nullptr));
    for (auto& e : joined_)
      if (e) cudaEventDestroy(std::exchange(e, nullptr));
    if (forked_) cudaEventDestroy(std::exchange(forked_, nullptr));
  }

  cudaStream_t stream_;
  void* workspace_;
  std::size_t bytes_;
  std::array<cudaStream_t, kLanes - 1> side_{};
  std::array<Buffer, kLanes - 1> side_ws_;
  cudaEvent_t forked_ = nullptr;
  std::array<cudaEvent_t, kLanes - 1> joined_{};
};

}  // namespace kiln::cuda
