#pragma once
// Causal multi-head attention through cuDNN's fused flash attention: the SDPA operation graphs of
// cuDNN's backend API (matmul, scale, causal mask, softmax with statistics, matmul; and the flash
// backward), which its runtime-fusion engine compiles into one kernel each. Grouped-query attention
// (Hkv key / value heads shared by groups of H / Hkv query heads) as cuDNN's frontend builds it: the
// key / value gradients summed over each group inside the fused backward. Built on kiln's layouts
// without copies: qkv [B, T, H + 2 Hkv, D] ([B, T, 3, H, D] for multi-head attention), out
// [B, T, H, D], lse [B, H, T] (the natural-log
// log-sum-exp of each row of the scaled scores, the statistic kiln's own kernels keep, so either
// implementation's backward can follow the other's forward).
//
// libcudnn.so.9 is opened at run time (dlopen), not linked: a kiln built where cuDNN's headers are
// found still runs on machines without the library, and falls back to kiln's kernels there.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <string>

namespace kiln::ops::cuda_impl {

class CudnnAttention {
 public:
  // Opens libcudnn.so.9 and makes a cuDNN handle on `stream`; throws kiln::Error saying why not.
  CudnnAttention(cudaStream_t stream, bool deterministic);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  struct Shape {
    int B, T, H, Hkv, D;  // Hkv == H: multi-head attention
  };

  // "cuDNN 9.14.0" and the like.
  std::string version() const;
  // Builds (once per shape) the forward and backward plans; throws kiln::Error with cuDNN's reason
  // when it does not take the shape.
  void prepare(const Shape& s);
  // Device scratch (bytes) that forward / backward need for this shape (prepare()d).
  std::size_t forward_workspace_bytes(const Shape& s);
  std::size_t backward_workspace_bytes(const Shape& s);
  // bf16 pointers; workspace: device memory of the sizes above, 256-byte aligned.
  void forward(void* out, float* lse, const void* qkv, const Shape& s, float scale, void* workspace);
  void backward(void* dqkv, const void* dout, const void* out, const float* lse, const void* qkv, const Shape& s,
                float scale, void* workspace);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::ops::cuda_impl
