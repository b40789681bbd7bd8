#pragma once
// Timing for kiln's benchmarks: the median of single calls between two CUDA events, after warm-up,
// optionally with L2 evicted before each call (a 256 MiB memset: H100/H200 L2 is 50-60 MB).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::bench {

class EventTimer {
 public:
  EventTimer(cudaStream_t s, bool flush_l2, int warmup, int iters)
      : s_(s), warmup_(warmup), iters_(iters), flush_(flush_l2 ? Buffer(Device::cuda, 256u << 20) : Buffer()) {
    KILN_CUDA_CHECK(cudaEventCreate(&a_));
    KILN_CUDA_CHECK(cudaEventCreate(&b_));
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  ~EventTimer() {
    cudaEventDestroy(a_);
    cudaEventDestroy(b_);
  }

  double median_ms(const std::function<void()>& f) {
    for (int i = 0; i < warmup_; ++i) f();
    std::vector<float> t;
    for (int i = 0; i < iters_; ++i) {
      if (flush_) KILN_CUDA_CHECK(cudaMemsetAsync(flush_.data(), i, flush_.bytes(), s_));
      KILN_CUDA_CHECK(cudaEventRecord(a_, s_));
      f();
      KILN_CUDA_CHECK(cudaEventRecord(b_, s_));
      KILN_CUDA_CHECK(cudaEventSynchronize(b_));
      float ms = 0;
      KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, a_, b_));
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }

 private:
  cudaStream_t s_;
  int warmup_, iters_;
  Buffer flush_;
  cudaEvent_t a_, b_;
};

}  // namespace kiln::bench
