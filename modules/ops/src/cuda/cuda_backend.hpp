#pragma once
// The CUDA backend: bf16 activations, cuBLASLt GEMMs, kiln's own kernels, one compute stream.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kiln/ops/backend.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "kiln/ops/cuda/gemm.hpp"
#include "kiln/ops/cuda/launchers.hpp"
#include "cudnn_attention.hpp"
#include "grouped_gemm.hpp"
#include "host_readback.hpp"
#include "../op_args.hpp"

namespace kiln::ops::cuda_impl {

// A tensor's data as the kernels take it.
template <class T>
T* dptr(const TensorView& t) {
  return static_cast<T*>(t.data);
}
// A dimension as the kernels take it: the op descriptions checked that it fits (kTarget.int32_dims).
inline int i32(std::int64_t v) { return static_cast<int>(v); }

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const CudaOptions& options);
  ~CudaBackend() override;

  Device device() const override { return Device::cuda; }
  DType act_dtype() const override { return DType::bf16; }
  std::string name() const override { return name_; }
  double peak_bf16_flops() const override { return peak_flops_; }

  Buffer alloc(std::size_t bytes) override { return Buffer(Device::cuda, bytes); }
  Buffer alloc_host(std::size_t bytes) override { return Buffer::pinned(bytes); }
  void copy(const TensorView& dst, const TensorView& src) override;
  void copy_to_host_async(const TensorView& host_dst, const TensorView& src) override;
  void convert(const TensorView& dst, const TensorView& src) override;
  void convert_on(void* stream, const TensorView& dst, const TensorView& src) override;
  void copy_on(void* stream, const TensorView& dst, const TensorView& src) override;
  void zero(const TensorView& t) override;
  void zero_many(std::span<const TensorView> ts) override;
  void synchronize() override;
  double sum_squares(const TensorView& x) override;
  std::vector<double> sum_squares_each(std::span<const TensorView> xs) override;
  void init_normal(const TensorView& dst, float std, rng::PhiloxArgs rng, std::int64_t global_offset) override;
  void fill(const TensorView& dst, float value) override;
  void add(const TensorView& dst, const TensorView& src) override;

  void embedding_forward(const EmbeddingForward& a) override;
  void embedding_backward(const EmbeddingBackward& a) override;
  void layernorm_forward(const LayerNormForward& a) override;
  void layernorm_backward(const LayerNormBackward& a) override;
  void linear_forward(const LinearForward& a) override;
  void linear_backward(const LinearBackward& a) override;
  void gelu_forward(const GeluForward& a) override;
  void gelu_backward(const GeluBackward& a) override;
  void rmsnorm_forward(const RmsNormForward& a) override;
  void rmsnorm_backward(const RmsNormBackward& a) override;
  void rope(const Rope& a) override;
  void swiglu_forward(const SwigluForward& a) override;
  void swiglu_backward(const SwigluBackward& a) override;
  void attention_forward(const AttentionForward& a) override;
  void attention_backward(const AttentionBackward& a) override;
  void attention_decode(const AttentionDecode& a) override;
  void residual_forward(const ResidualForward& a) override;
  void dropout_backward(const DropoutBackward& a) override;
  void cross_entropy(const CrossEntropy& a) override;
  void cross_entropy_stats(const CrossEntropyStats& a) override;
  void cross_entropy_finish(const CrossEntropyFinish& a) override;
  void adamw(const AdamW& a) override;
  void grad_clip(const GradClip& a) override;
  void sum_squares_parts(const SumSquaresParts& a) override;
  void moe_route(const MoeRoute& a) override;
  void moe_route_backward(const MoeRouteBackward& a) override;
  void moe_permute(const MoePermute& a) override;
  void moe_permute_backward(const MoePermuteBackward& a) override;
  void moe_combine(const MoeCombine& a) override;
  void moe_combine_backward(const MoeCombineBackward& a) override;
  void grouped_linear_forward(const GroupedLinearForward& a) override;
  void grouped_linear_backward(const GroupedLinearBackward& a) override;
  void moe_dropout(const MoeDropout& a) override;

  void set_profiling(bool on) override { profiling_ = on; }
  int begin_op(const char* op) override;
  void end_op(int token) override;
  std::vector<OpTime> op_times() override;
  void reset_op_times() override;
  void* stream() const override { return stream_; }
  void set_gemm_sm_margin(int sms) override { sm_margin_ = sms; }
  std::size_t device_memory_in_use() const override;
  bool can_capture() const override { return !profiling_; }  // profiling records events per op
  void begin_capture() override;
  std::unique_ptr<CapturedWork> end_capture() override;

 private:
  // What the op descriptions check: device tensors, bf16 activations, dimensions the kernels' ints hold.
  static constexpr ArgTarget kTarget{Device::cuda, DType::bf16, true};
  // Records CUDA events around one op while profiling.
  class Timer {
   public:
    Timer(CudaBackend& b, const char* op) : b_(b), index_(b.begin_op(op)) {}
    ~Timer() { b_.end_op(index_); }

   private:
    CudaBackend& b_;
    int index_ = -1;
  };
  // Whether attention of this shape runs on cuDNN (see AttentionImpl); opens cuDNN and builds the
  // shape's plans at first use. Forward and backward decide alike, so they always pair up.
  bool use_cudnn_attention(float dropout, const CudnnAttention::Shape& s);
  // Device scratch memory for temporaries of one op, grown on demand (stream-ordered).
  float* scratch_floats(std::int64_t n);
  // Counters that kernels leave zero (e.g. bias_grad's tickets), zeroed once.
  unsigned* tickets(std::int64_t n);
  // A small table kernels read (zero_many's pieces, AdamW's segments), kept on the device while its
  // contents stay the same: uploaded again only when they change (in practice once), so a captured
  // step's graph reads the same memory and holds no copy.
  template <class Row>
  struct DeviceTable {
    std::vector<Row> rows;
    Buffer device;
  };
  template <class Row>
  const Row* device_table(DeviceTable<Row>& t, const std::vector<Row>& rows) {
    if (rows != t.rows) {
      KILN_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old table may still be read
      t.device = Buffer(Device::cuda, std::max<std::size_t>(rows.size() * sizeof(Row), 1));
      KILN_CUDA_CHECK(cudaMemcpy(t.device.data(), rows.data(), rows.size() * sizeof(Row), cudaMemcpyHostToDevice));
      t.rows = rows;
    }
    return static_cast<const Row*>(t.device.data());
  }
  // The experts' grouped linears (a cuBLAS handle on stream_ with workspace_), made at first use.
  cuda::GroupedGemm& grouped_gemm();

  int device_;
  int sm_count_ = 0, sm_margin_ = 0;
  // The SMs the linear ops' GEMMs target: 0 (all) without a margin.
  int gemm_sms() const { return sm_margin_ > 0 && sm_margin_ < sm_count_ ? sm_count_ - sm_margin_ : 0; }
  std::size_t free_at_start_ = 0;  // cudaMemGetInfo's free bytes when the backend was made
  std::string name_;
  double peak_flops_ = 0;
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  Buffer workspace_;
  std::unique_ptr<cuda::GemmRunner> gemm_;
  std::unique_ptr<cuda::GroupedGemm> grouped_;
  Buffer scratch_;
  AttentionImpl attention_;
  bool attention_deterministic_;
  bool grouped_call_;  // the experts' data GEMMs as one cuBLAS grouped call (CudaOptions::grouped_gemm)
  bool grouped_tune_;  // their algorithms tuned (CudaOptions::grouped_gemm_tune)
  std::unique_ptr<CudnnAttention> cudnn_;
  bool cudnn_unavailable_ = false;                 // auto: libcudnn failed to open; kiln's kernels run
  std::set<std::tuple<int, int, int, int, int>> cudnn_refused_;  // auto: shapes cuDNN builds no plan for
  Buffer tickets_;
  Buffer embed_buckets_;  // embedding_backward's buckets and their scratch
  DeviceTable<cuda::ZeroRun> zero_table_;            // zero_many's pieces
  DeviceTable<cuda::AdamWSegmentDev> adamw_table_;  // AdamW's segments
  DeviceTable<cuda::SumSquaresPart> sum_squares_table_;  // sum_squares_parts' ranges
  DeviceTable<cuda::SumSquaresSegment> sum_squares_segments_;  // and its tensors
  cuda::HostReadback offsets_readback_;  // moe_permute's offsets for the host
  bool profiling_ = false;
  struct Pending {
    const char* op;
    cudaEvent_t start, end;
  };
  std::vector<Pending> pending_;
  std::vector<cudaEvent_t> event_pool_;
  std::map<std::string, OpTime> times_;
};

}  // namespace kiln::ops::cuda_impl
