#pragma once
// The CPU reference backend: fp32 loops, parallel over independent outputs with OpenMP so results
// do not depend on the thread count. Optionally rounds every act output to bf16.
#include <chrono>
#include <map>

#include "kiln/ops/backend.hpp"
#include "../op_args.hpp"
#include "kiln/tensor/bf16.hpp"

namespace kiln::ops::cpu {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuOptions& o);
  Device device() const override { return Device::cpu; }
  DType act_dtype() const override { return DType::f32; }
  std::string name() const override { return "cpu"; }
  double peak_bf16_flops() const override { return 0; }

  Buffer alloc(std::size_t bytes) override { return Buffer(Device::cpu, bytes); }
  Buffer alloc_host(std::size_t bytes) override { return Buffer(Device::cpu, bytes); }
  void copy(const TensorView& dst, const TensorView& src) override;
  void convert(const TensorView& dst, const TensorView& src) override;
  void zero(const TensorView& t) override;
  void synchronize() override {}
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
  void reset_op_times() override { times_.clear(); }
  void* stream() const override { return nullptr; }
  std::size_t device_memory_in_use() const override { return 0; }

  // Rounds a value the way the CUDA backend stores act tensors (identity without round_bf16).
  float store(float v) const { return round_ ? round_bf16(v) : v; }
  int threads() const { return threads_; }

 private:
  // Times one op while profiling.
  class Timer {
   public:
    Timer(CpuBackend& b, const char* op) : b_(b), token_(b.begin_op(op)) {}
    ~Timer() { b_.end_op(token_); }

   private:
    CpuBackend& b_;
    int token_;
  };
  struct Open {
    const char* op;
    std::chrono::steady_clock::time_point t0;
  };
  std::vector<Open> open_;  // ops begun and not ended, by token

  static constexpr ArgTarget kTarget{Device::cpu, DType::f32, false};  // what the op descriptions check
  bool round_;
  int threads_;
  bool profiling_ = false;
  std::map<std::string, OpTime> times_;
};

// Element index of a dropout view (see DropoutArgs).
inline std::uint64_t dropout_index(const DropoutArgs& d, std::int64_t r, std::int64_t c, std::int64_t cols) {
  std::int64_t total = d.cols_total ? d.cols_total : cols;
  return static_cast<std::uint64_t>((d.row_offset + r) * total + d.col_offset + c);
}

}  // namespace kiln::ops::cpu
