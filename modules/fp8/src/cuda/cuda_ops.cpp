// Fp8Ops on CUDA: the kernels of cast_transpose.cu / grouped.cu / scaling.cu, cuBLASLt FP8 GEMMs, and kiln's
// deterministic bias-gradient reduction, all on one stream.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <variant>
#include <span>
#include <vector>
#include <cstring>

#include "kiln/core/overloaded.hpp"
#include "kiln/fp8/cuda/gemm.hpp"
#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/ops/cuda/lanes.hpp"
#include "kiln/ops/cuda/launchers.hpp"
#include "kiln/tensor/cuda_check.hpp"
#include "../ops_checks.hpp"

namespace kiln::fp8 {

namespace {

constexpr std::size_t kWorkspaceBytes = 32u << 20;

void check_input(const TensorView& t, const char* what) {
  if (t.device != Device::cuda || (t.dtype != DType::bf16 && t.dtype != DType::f32) || !t.contiguous())
    KILN_THROW(what, ": expected a contiguous bf16 or f32 CUDA tensor, got ", t.str());
}

// A LayerNorm input (x bf16 [R, C], weight and bias bf16 [C], mean and rstd f32 [R], all contiguous CUDA
// tensors) as the kernels take it.
cuda::LayerNormOfDev layernorm_of(const ops::LayerNormOnLoad& ln, const char* op) {
  const TensorView& x = ln.x;
  KILN_CHECK(x.device == Device::cuda && x.dtype == DType::bf16 && x.ndim() == 2 && x.contiguous(), op, " x ",
             x.str());
  const std::int64_t R = x.size(0), C = x.size(1);
  for (const TensorView* t : {&ln.weight, &ln.bias})
    KILN_CHECK(t->device == Device::cuda && t->dtype == DType::bf16 && t->numel() == C && t->contiguous(), op,
               " weight/bias ", t->str(), " for x ", x.str());
  for (const TensorView* t : {&ln.mean, &ln.rstd})
    KILN_CHECK(t->device == Device::cuda && t->dtype == DType::f32 && t->numel() == R && t->contiguous(), op,
               " mean/rstd ", t->str(), " for x ", x.str());
  cuda::LayerNormOfDev d;
  d.x = x.as<kiln::cuda::bf16>();
  d.weight = ln.weight.as<kiln::cuda::bf16>();
  d.bias = ln.bias.as<kiln::cuda::bf16>();
  d.mean = ln.mean.as<float>();
  d.rstd = ln.rstd.as<float>();
  return d;
}

int as_int(std::int64_t v, const char* what) {
  KILN_CHECK(v >= 0 && v <= 0x7fffffff, what, " = ", v, " does not fit a 32-bit int");
  return static_cast<int>(v);
}

// Host arrays (the plans of groupings of more experts than a kernel's parameters hold) copied to the
// device on the stream, asynchronously: each upload goes through its own slot of one pinned and one
// device arena, taken round-robin. A slot is written again only after the copy out of it has run
// (its event). There are enough slots for several steps of a mixture of experts' uploads (six a
// layer), so that wait does not throttle the host to the device: the host stays as far ahead as the
// model's own synchronisations let it. (With eight slots it waited ~17 ms a step on moe-1b, and the
// device idled behind it.) The device side needs no wait: the kernels reading a slot come before the
// next copy into it on the stream. Slots start with room for 340 experts' plans and grow on demand,
// with a synchronisation.
class HostUploads {
 public:
  explicit HostUploads(cudaStream_t stream) : stream_(stream) {
    for (auto& e : done_) KILN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    allocate(kInitialSlotBytes);
  }
  ~HostUploads() {
    for (auto& e : done_)
      if (e) cudaEventDestroy(e);
  }
  HostUploads(const HostUploads&) = delete;
  HostUploads& operator=(const HostUploads&) = delete;

  const void* upload(const void* host, std::size_t bytes) {
    if (bytes > slot_bytes_) {
      KILN_CUDA_CHECK(cudaStreamSynchronize(stream_));  // every slot may still be in use
      allocate((bytes + bytes / 2 + 255) / 256 * 256);
    }
    const int s = next_;
    next_ = (next_ + 1) % kSlots;
    if (used_[static_cast<std::size_t>(s)]) KILN_CUDA_CHECK(cudaEventSynchronize(done_[static_cast<std::size_t>(s)]));
    auto* h = static_cast<std::uint8_t*>(host_.data()) + static_cast<std::size_t>(s) * slot_bytes_;
    auto* d = static_cast<std::uint8_t*>(device_.data()) + static_cast<std::size_t>(s) * slot_bytes_;
    std::memcpy(h, host, bytes);
    KILN_CUDA_CHECK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, stream_));
    KILN_CUDA_CHECK(cudaEventRecord(done_[static_cast<std::size_t>(s)], stream_));
    used_[static_cast<std::size_t>(s)] = true;
    return d;
  }

 private:
  static constexpr int kSlots = 256;
  static constexpr std::size_t kInitialSlotBytes = 4096;
  void allocate(std::size_t slot_bytes) {
    host_ = Buffer();
    device_ = Buffer();
    host_ = Buffer::pinned(slot_bytes * kSlots);
    device_ = Buffer(Device::cuda, slot_bytes * kSlots);
    slot_bytes_ = slot_bytes;
    used_.fill(false);
  }
  cudaStream_t stream_;
  Buffer host_, device_;
  std::size_t slot_bytes_ = 0;
  std::array<cudaEvent_t, kSlots> done_{};
  std::array<bool, kSlots> used_{};
  int next_ = 0;
};


class CudaOps final : public Fp8Ops {
 public:
  CudaOps(cudaStream_t stream, const CudaOpsOptions& options) : stream_(stream), uploads_(stream) {
    KILN_CUBLAS_CHECK(cublasLtCreate(&lt_));
    workspace_ = Buffer(Device::cuda, kWorkspaceBytes);
    gemm_ = std::make_unique<cuda::Fp8GemmRunner>(lt_, workspace_.data(), kWorkspaceBytes);
    gemm_->set_tune_grouped(options.tune_grouped);
    gemm_->set_block_kernel(options.block_gemm);
  }
  ~CudaOps() override {
    cudaStreamSynchronize(stream_);
    lanes_.reset();
    gemm_.reset();
    if (lt_) cublasLtDestroy(lt_);
  }

  Device device() const override { return Device::cuda; }
  DType act_dtype() const override { return DType::bf16; }
  Buffer alloc(std::size_t bytes) override { return Buffer(Device::cuda, bytes); }
  void copy(void* dst, const void* src, std::size_t bytes) override {
    KILN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    KILN_CUDA_CHECK(cudaStreamSynchronize(stream_));  // host memory on either side stays valid until now
  }
  void copy_on_device(void* dst, const void* src, std::size_t bytes) override {
    KILN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  void zero(void* dst, std::size_t bytes) override { KILN_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream_)); }
  void synchronize() override { KILN_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  void amax(const TensorView& x, float* amax) override {
    check_input(x, "fp8 amax x");
    cuda::amax(x.data, x.dtype, x.numel(), amax, stream_);
  }

  void scale_from_amax(const float* amax, float* scale, float* scale_inv, float fp8_max, int margin) override {
    cuda::scale_from_amax(amax, scale, scale_inv, fp8_max, margin, stream_);
  }

  void quantize_grouped(const GroupedQuantizeArgs& a) override {
    const Shape shape = grouped_source_shape(a.x, "fp8 quantize_grouped");
    KILN_CHECK(a.out.scale, "fp8 quantize_grouped: no scale");
    const std::int64_t R = shape[0], C = shape[1], E = a.experts;
    check_offsets(a.offsets_host, E, R, "fp8 quantize_grouped");
    const std::int64_t used = a.offsets_host[E], padded = segment_row(a.offsets_host, a.experts);
    check_copy(a.out.rowwise, a.out.format, {used, C}, "fp8 quantize_grouped: rowwise");
    check_copy(a.out.colwise, a.out.format, {padded * C}, "fp8 quantize_grouped: colwise");
    if (!a.out.rowwise && !a.out.colwise && !a.amax) return;
    cuda::GroupedCast k;
    if (const auto* t = std::get_if<TensorView>(&a.x)) {
      check_input(*t, "fp8 quantize_grouped x");
      k.x = t->data;
      k.x_dtype = t->dtype;
    } else if (const auto* g = std::get_if<ops::GeluOnLoad>(&a.x)) {
      k = source_of(cuda::CastSource::gelu, g->pre, {}, "fp8 quantize_grouped: the GELU's pre-activation");
    } else if (const auto* g = std::get_if<ops::SwigluOnLoad>(&a.x)) {
      k = source_of(cuda::CastSource::swiglu, g->gate_up, {}, "fp8 quantize_grouped: the SwiGLU's input");
    } else if (const auto* g = std::get_if<ops::DgeluOnLoad>(&a.x)) {
      k = source_of(cuda::CastSource::dgelu, g->pre, g->dgelu, "fp8 quantize_grouped: dgelu-on-load");
    } else {
      const auto& d = std::get<ops::DswigluOnLoad>(a.x);
      k = source_of(cuda::CastSource::dswiglu, d.gate_up, d.dswiglu, "fp8 quantize_grouped: dswiglu-on-load");
    }
    const std::int64_t load_cols = k.source == cuda::CastSource::dswiglu ? C / 2 : C;
    grouped_cast(k, cuda::grouped_cast_plan(a.offsets_host, a.experts, 0, load_cols), C, a.out, a.amax, true);
  }

  void quantize_blocks(const BlockQuantizeArgs& a) override {
    const Shape shape = source_shape(a.x, "fp8 quantize_blocks");
    const std::int64_t R = shape[0], C = shape[1];
    cuda::BlockCast k = block_source(a.x, a.mode, a.pow2, shape, "fp8 quantize_blocks");
    block_outputs(k, a, "fp8 quantize_blocks", true);
    if (a.dbias) {
      KILN_CHECK(a.dbias.device == Device::cuda && a.dbias.dtype == DType::f32 && a.dbias.numel() == C,
                 "fp8 quantize_blocks: dbias ", a.dbias.str(), " for x ", shape.str());
      k.dbias = a.dbias.as<float>();
      k.partial = scratch(cuda::block_partials(R, C));
    }
    cuda::quantize_blocks(k, stream_);
  }

  void quantize_blocks_grouped(const GroupedBlockQuantizeArgs& a) override {
    const Shape shape = source_shape(a.x, "fp8 quantize_blocks_grouped");
    cuda::BlockCast k = block_source(a.x, a.mode, a.pow2, shape, "fp8 quantize_blocks_grouped");
    const std::vector<cuda::BlockCastGroup> groups = block_groups(k, a, true, "fp8 quantize_blocks_grouped");
    cuda::quantize_blocks_grouped(k, groups, stream_);
  }

  void quantize(const TensorView& x, const Fp8TensorView& out, float* amax) override {
    check_input(x, "fp8 quantize x");
    KILN_CHECK(x.ndim() == 2 || x.ndim() == 3, "fp8 quantize: x must be [rows, cols] or [batch, rows, cols], got ",
               x.str());
    if (x.ndim() == 3) {  // each slice on its own: the grouped kernel with every expert full, one launch
      KILN_CHECK(out.scale, "fp8 quantize: no scale");
      const std::int64_t B = x.size(0), R = x.size(1), C = x.size(2);
      check_copy(out.rowwise, out.format, {B, R, C}, "fp8 quantize: rowwise");
      check_copy(out.colwise, out.format, {B, C, R}, "fp8 quantize: colwise");
      if (B > 0 && R > 0 && C > 0) grouped_cast(x, nullptr, as_int(B, "batch"), R, out, amax);
      return;
    }
    check_outputs(x, out, "fp8 quantize");
    const std::int64_t R = x.size(0), C = x.size(1);
    cuda::cast_transpose(x.data, x.dtype, out.rowwise.as<std::uint8_t>(), out.colwise.as<std::uint8_t>(), out.format,
                         out.scale, amax, R, C, stream_);
  }

  void quantize_gelu(const TensorView& pre, const Fp8TensorView& out, float* amax) override {
    KILN_CHECK(pre.device == Device::cuda && pre.dtype == DType::bf16 && pre.ndim() == 2 && pre.contiguous(),
               "fp8 quantize_gelu pre ", pre.str());
    check_outputs(pre, out, "fp8 quantize_gelu");
    cuda::cast_transpose_gelu(pre.as<kiln::cuda::bf16>(), out.rowwise.as<std::uint8_t>(), out.colwise.as<std::uint8_t>(),
                              out.format, out.scale, amax, pre.size(0), pre.size(1), stream_);
  }
  void amax_gelu(const TensorView& pre, float* amax) override {
    KILN_CHECK(pre.device == Device::cuda && pre.dtype == DType::bf16 && pre.ndim() == 2 && pre.contiguous(),
               "fp8 amax_gelu pre ", pre.str());
    cuda::cast_transpose_gelu(pre.as<kiln::cuda::bf16>(), nullptr, nullptr, Format::e4m3, amax, amax, pre.size(0),
                              pre.size(1), stream_);
  }

  void quantize_swiglu(const TensorView& pre, const Fp8TensorView& out, float* amax) override {
    check_swiglu_input(pre, "fp8 quantize_swiglu pre");
    const std::int64_t R = pre.size(0), F = pre.size(1) / 2;
    check_outputs(TensorView(pre.data, {R, F}, pre.dtype, pre.device), out, "fp8 quantize_swiglu");
    cuda::cast_transpose_swiglu(pre.as<kiln::cuda::bf16>(), out.rowwise.as<std::uint8_t>(),
                                out.colwise.as<std::uint8_t>(), out.format, out.scale, amax, R, F, stream_);
  }
  void amax_swiglu(const TensorView& pre, float* amax) override {
    check_swiglu_input(pre, "fp8 amax_swiglu pre");
    cuda::cast_transpose_swiglu(pre.as<kiln::cuda::bf16>(), nullptr, nullptr, Format::e4m3, amax, amax, pre.size(0),
                                pre.size(1) / 2, stream_);
  }

  void quantize_layernorm(const ops::LayerNormOnLoad& ln, const Fp8TensorView& out, float* amax) override {
    const cuda::LayerNormOfDev d = layernorm_of(ln, "fp8 quantize_layernorm");
    check_outputs(ln.x, out, "fp8 quantize_layernorm");
    cuda::cast_transpose_layernorm(d, out.rowwise.as<std::uint8_t>(), out.colwise.as<std::uint8_t>(), out.format,
                                   out.scale, amax, ln.x.size(0), ln.x.size(1), stream_);
  }

  void layernorm_stats(const ops::LayerNormOnLoad& ln, float* amax) override {
    const cuda::LayerNormOfDev d = layernorm_of(ln, "fp8 layernorm_stats");
    cuda::layernorm_stats(d, ln.mean.as<float>(), ln.rstd.as<float>(), amax, ln.x.size(0), ln.x.size(1), ln.eps,
                          stream_);
  }

  // An LM head's cross-entropy gradient on the device: checked, as the kernels take it.
  struct XentDev {
    const float* lse;
    const std::int32_t* targets;
    std::int64_t real_cols;
  };
  static XentDev xent_of(const ops::XentOnLoad& a) {
    const TensorView& l = a.logits;
    KILN_CHECK(l.device == Device::cuda && l.dtype == DType::bf16 && l.ndim() == 2 && l.contiguous() &&
                   a.lse.device == Device::cuda && a.lse.dtype == DType::f32 && a.lse.numel() == l.size(0) &&
                   a.targets.device == Device::cuda && a.targets.dtype == DType::i32 &&
                   a.targets.numel() == l.size(0) && a.vocab_begin >= 0,
               "fp8 cross-entropy gradient: logits ", l.str(), ", lse ", a.lse.str(), ", targets ", a.targets.str());
    return {a.lse.as<float>(), a.targets.as<std::int32_t>(),
            std::clamp<std::int64_t>(a.vocab_real - a.vocab_begin, 0, l.size(1))};
  }

  void quantize_grad(const GradQuantizeArgs& a) override {
    const TensorView& dy = a.dy;
    KILN_CHECK(dy.device == Device::cuda && dy.dtype == DType::bf16 && dy.ndim() == 2 && dy.contiguous(),
               "fp8 quantize_grad dy ", dy.str());
    const std::int64_t R = dy.size(0), C = dy.size(1);
    if (a.gelu_pre)
      KILN_CHECK(a.gelu_pre.device == Device::cuda && a.gelu_pre.dtype == DType::bf16 && a.gelu_pre.shape == dy.shape &&
                     a.gelu_pre.contiguous(),
                 "fp8 quantize_grad gelu_pre ", a.gelu_pre.str(), " for dy ", dy.str());
    KILN_CHECK(a.out.rowwise && a.out.colwise && a.out.scale, "fp8 quantize_grad: both copies and a scale are needed");
    for (const TensorView* t : {&a.out.rowwise, &a.out.colwise})
      KILN_CHECK(t->device == Device::cuda && t->dtype == dtype_of(a.out.format) && t->contiguous(),
                 "fp8 quantize_grad: output ", t->str(), " for format ", name_of(a.out.format));
    KILN_CHECK(a.out.rowwise.shape == Shape({R, C}) && a.out.colwise.shape == Shape({C, R}), "fp8 quantize_grad: copies ",
               a.out.rowwise.str(), " / ", a.out.colwise.str(), " for dy ", dy.str());
    if (a.dbias)  // a bias gradient: f32, or bf16 (optim.grads = "bf16")
      KILN_CHECK(a.dbias.device == Device::cuda && (a.dbias.dtype == DType::f32 || a.dbias.dtype == DType::bf16) &&
                     a.dbias.numel() == C && a.dbias.contiguous(),
                 "fp8 quantize_grad dbias: expected ", C, " f32 or bf16 on cuda, got ", a.dbias.str(), " for dy ",
                 dy.str());
    cuda::CastTransposeGrad k;
    k.dy = dy.as<kiln::cuda::bf16>();
    k.gelu_pre = a.gelu_pre ? a.gelu_pre.as<kiln::cuda::bf16>() : nullptr;
    k.rowwise = a.out.rowwise.as<std::uint8_t>();
    k.colwise = a.out.colwise.as<std::uint8_t>();
    k.format = a.out.format;
    k.scale = a.out.scale;
    k.amax = a.amax;
    const bool dbias_bf16 = a.dbias && a.dbias.dtype == DType::bf16;
    k.dbias = a.dbias && !dbias_bf16 ? a.dbias.as<float>() : nullptr;
    k.dbias_bf16 = dbias_bf16 ? a.dbias.as<__nv_bfloat16>() : nullptr;
    k.partial = a.dbias ? scratch(cuda::grad_partials(R, C)) : nullptr;
    k.rows = R;
    k.cols = C;
    if (a.xent) {
      KILN_CHECK(a.xent->logits.data == dy.data && !a.gelu_pre && !a.dbias,
                 "fp8 quantize_grad: a cross-entropy gradient reads its logits as dy, with no dGELU or bias");
      const XentDev x = xent_of(*a.xent);
      k.lse = x.lse;
      k.targets = x.targets;
      k.vocab_begin = a.xent->vocab_begin;
      k.real_cols = x.real_cols;
      k.dloss = a.xent->dloss;
    }
    if (cuda::cast_transpose_grad(k, stream_)) return;
    // Shapes the tiled kernel does not take: the same values in three passes.
    if (a.xent) xent_grad(*a.xent);
    if (a.gelu_pre) dgelu(dy, a.gelu_pre);
    quantize(dy, a.out, a.amax);
    if (a.dbias) bias_grad(a.dbias, dy);
  }

  void xent_grad(const ops::XentOnLoad& a) override {
    const XentDev x = xent_of(a);
    cuda::xent_grad(a.logits.as<kiln::cuda::bf16>(), x.lse, x.targets, a.vocab_begin, x.real_cols, a.dloss,
                    a.logits.size(0), a.logits.size(1), stream_);
  }

  void dgelu(const TensorView& dy, const TensorView& pre) override {
    KILN_CHECK(dy.device == Device::cuda && dy.dtype == DType::bf16 && dy.contiguous() && pre.device == Device::cuda &&
                   pre.dtype == DType::bf16 && pre.numel() == dy.numel() && pre.contiguous(),
               "fp8 dgelu: dy ", dy.str(), ", pre ", pre.str());
    const std::int64_t cols = dy.ndim() == 0 ? 1 : dy.size(dy.ndim() - 1);
    cuda::gemm_epilogue(dy.as<kiln::cuda::bf16>(), pre.as<kiln::cuda::bf16>(), nullptr, dy.numel() / std::max<std::int64_t>(cols, 1),
                        cols, ops::Epilogue::dgelu, stream_);
  }

  void dequantize(const TensorView& out, const TensorView& q, const float* scale_inv) override {
    KILN_CHECK(q.device == Device::cuda && (q.dtype == DType::e4m3 || q.dtype == DType::e5m2), "fp8 dequantize ", q.str());
    KILN_CHECK(out.device == Device::cuda && out.dtype == DType::f32 && out.numel() == q.numel(), "fp8 dequantize ",
               q.str(), " -> ", out.str());
    cuda::dequantize(out.as<float>(), q.as<std::uint8_t>(), q.dtype == DType::e4m3 ? Format::e4m3 : Format::e5m2,
                     q.numel(), scale_inv, stream_);
  }

  void transpose(const TensorView& out, const TensorView& in) override {
    check_transpose_args(out, in, Device::cuda);
    cuda::transpose_bytes(out.as<std::uint8_t>(), in.as<std::uint8_t>(), in.size(0), in.size(1), stream_);
  }

  void gemm(const GemmArgs& g) override { gemm_->run(g, static_cast<cudaStream_t>(stream_)); }

  void gemm_grouped(std::span<const GemmArgs> gs) override {
    if (!lanes_) lanes_ = std::make_unique<kiln::cuda::LtLanes>(stream_, workspace_.data(), kWorkspaceBytes);
    gemm_->run_grouped(gs, *lanes_);
  }

  void bias_grad(const TensorView& dbias, const TensorView& dy) override {
    KILN_CHECK(dy.device == Device::cuda && dy.dtype == DType::bf16 && dy.ndim() == 2 && dy.contiguous(),
               "fp8 bias_grad dy ", dy.str());
    KILN_CHECK(dbias.device == Device::cuda && (dbias.dtype == DType::f32 || dbias.dtype == DType::bf16) &&
                   dbias.numel() == dy.size(1) && dbias.contiguous(),
               "fp8 bias_grad dbias: expected ", dy.size(1), " f32 or bf16 (a gradient) on cuda, got ", dbias.str(),
               " for dy ", dy.str());
    const int N = as_int(dy.size(0), "rows"), C = as_int(dy.size(1), "columns");
    float* sums = scratch(kiln::cuda::bias_grad_scratch(N, C));
    unsigned* counters = tickets(kiln::cuda::bias_grad_tickets(C));
    if (dbias.dtype == DType::bf16)  // a bf16 gradient: added in f32, rounded once
      kiln::cuda::bias_grad(dbias.as<kiln::cuda::bf16>(), sums, counters, dy.as<kiln::cuda::bf16>(), N, C, stream_);
    else
      kiln::cuda::bias_grad(dbias.as<float>(), sums, counters, dy.as<kiln::cuda::bf16>(), N, C, stream_);
  }

  void update_delayed(const DelayedUpdateArgs& a) override { cuda::delayed_update(a, stream_); }

  void adamw_quantize(const AdamWQuantizeArgs& a) override {
    check_adamw_quantize_args(a, Device::cuda);
    const bool batched = a.param.ndim() == 3;
    const std::int64_t B = batched ? a.param.size(0) : 1, R = a.param.numel() / std::max<std::int64_t>(B, 1) /
                                                                std::max<std::int64_t>(a.param.size(-1), 1);
    if (a.out.rowwise && batched) {
      const std::int64_t C = a.param.size(2);
      check_copy(a.out.rowwise, a.out.format, {B, R, C}, "fp8 adamw_quantize: rowwise");
      check_copy(a.out.colwise, a.out.format, {B, C, R}, "fp8 adamw_quantize: colwise");
    } else if (a.out.rowwise) {
      check_outputs(a.param, a.out, "fp8 adamw_quantize");
    }
    cuda::AdamWQuantizeDev k = step_of(a);
    k.rowwise = a.out.rowwise.as<std::uint8_t>();
    k.colwise = a.out.colwise.as<std::uint8_t>();
    k.format = a.out.format;
    k.scale = a.out.scale;
    k.amax = a.amax;
    k.rows = B * R;
    k.cols = a.param.size(-1);
    k.batch = B;
    cuda::adamw_quantize(k, stream_);
  }

  void block_part_amax(const BlockPart& p, float* tile_amax) override { cuda::block_part_amax(p, tile_amax, stream_); }
  void block_scales(const float* tile_amax, std::int64_t rows, std::int64_t cols, Format f, bool pow2, float* scale,
                    float* row_scale_inv, float* col_scale_inv) override {
    cuda::block_scales(tile_amax, rows, cols, f, pow2, scale, row_scale_inv, col_scale_inv, stream_);
  }
  void quantize_block_part(const BlockPart& p, const float* scale, Format f, std::uint8_t* codes) override {
    cuda::quantize_block_part(p, scale, f, codes, stream_);
  }
  void adamw_quantize_blocks(const AdamWQuantizeArgs& u, const BlockQuantizeArgs& out) override {
    check_adamw_quantize_args(u, Device::cuda);
    KILN_CHECK(u.param.ndim() == 2 && !out.dbias, "fp8 adamw_quantize_blocks: a whole weight [rows, cols], got ",
               u.param.str());
    const std::int64_t R = u.param.size(0), C = u.param.size(1);
    cuda::BlockCast k;
    k.rows = R;
    k.cols = C;
    k.mode = out.mode;
    k.pow2 = out.pow2;
    block_outputs(k, out, "fp8 adamw_quantize_blocks", false);
    cuda::AdamWQuantizeDev d = step_of(u);
    d.rows = R;
    d.cols = C;
    cuda::quantize_blocks_adamw(k, d, stream_);
  }
  void adamw_quantize_blocks_grouped(const AdamWQuantizeArgs& u, const GroupedBlockQuantizeArgs& out) override {
    check_adamw_quantize_args(u, Device::cuda);
    KILN_CHECK(u.param.ndim() == 2 || u.param.ndim() == 3,
               "fp8 adamw_quantize_blocks_grouped: a [rows, cols] or [batch, rows, cols] weight, got ", u.param.str());
    const std::int64_t C = u.param.size(-1), R = u.param.numel() / std::max<std::int64_t>(C, 1);
    cuda::BlockCast k;
    k.rows = R;
    k.cols = C;
    k.mode = out.mode;
    k.pow2 = out.pow2;
    const std::vector<cuda::BlockCastGroup> groups = block_groups(k, out, false, "fp8 adamw_quantize_blocks_grouped");
    cuda::AdamWQuantizeDev d = step_of(u);
    d.rows = R;
    d.cols = C;
    cuda::quantize_blocks_adamw_grouped(k, d, groups, stream_);
  }

 private:
  // A block quantisation's source (x [shape] or the tensors its values are computed from on load).
  static cuda::BlockCast block_source(const QuantizeSource& x, ScalingMode mode, bool pow2, const Shape& shape,
                                      const char* what) {
    cuda::BlockCast k;
    k.rows = shape[0];
    k.cols = shape[1];
    k.mode = mode;
    k.pow2 = pow2;
    const auto bf16_input = [what](const TensorView& t, const char* name) {
      KILN_CHECK(t.device == Device::cuda && t.dtype == DType::bf16 && t.contiguous(), what, ": ", name,
                 " must be a contiguous bf16 CUDA tensor, got ", t.str());
      return t.data;
    };
    std::visit(Overloaded{[&](const TensorView& t) {
                            check_input(t, what);
                            k.x = t.data;
                            k.x_dtype = t.dtype;
                          },
                          [&](const ops::LayerNormOnLoad& ln) {
                            k.source = ops::Prologue::layernorm;
                            k.x = bf16_input(ln.x, "the LayerNorm's input");
                            k.ln_weight = bf16_input(ln.weight, "the LayerNorm's weight");
                            k.ln_bias = bf16_input(ln.bias, "the LayerNorm's bias");
                            KILN_CHECK(ln.mean.device == Device::cuda && ln.rstd.device == Device::cuda,
                                       what, ": the LayerNorm's statistics must be CUDA tensors");
                            k.mean = ln.mean.as<float>();
                            k.rstd = ln.rstd.as<float>();
                          },
                          [&](const ops::GeluOnLoad& g) {
                            k.source = ops::Prologue::gelu;
                            k.x = bf16_input(g.pre, "the GELU's pre-activation");
                          },
                          [&](const ops::SwigluOnLoad& g) {
                            k.source = ops::Prologue::swiglu;
                            k.x = bf16_input(g.gate_up, "the SwiGLU's input");
                          },
                          [&](const ops::DgeluOnLoad& g) {
                            k.source = ops::Prologue::dgelu;
                            k.x = bf16_input(g.dgelu, "the GELU output's gradient");
                            k.aux = bf16_input(g.pre, "the GELU's pre-activation");
                          },
                          [&](const ops::DswigluOnLoad& g) {
                            k.source = ops::Prologue::dswiglu;
                            k.x = bf16_input(g.dswiglu, "the SwiGLU output's gradient");
                            k.aux = bf16_input(g.gate_up, "the SwiGLU's input");
                          }},
               x);
    return k;
  }
  // A grouped quantisation's groups on device pointers, each group's copies checked as
  // block_outputs checks a whole quantisation's (k's format set from them).
  static std::vector<cuda::BlockCastGroup> block_groups(cuda::BlockCast& k, const GroupedBlockQuantizeArgs& a,
                                                        bool padded, const char* what) {
    std::vector<cuda::BlockCastGroup> groups;
    groups.reserve(a.groups.size());
    for (const BlockGroup& g : a.groups) {
      KILN_CHECK(g.first >= 0 && g.rows >= 0 && g.first + g.rows <= k.rows, what, ": a group of rows ", g.first, "..",
                 g.first + g.rows, " of ", k.rows);
      if (g.rows == 0) continue;
      cuda::BlockCast kg = k;
      kg.rows = g.rows;
      block_outputs(kg, {{}, a.mode, a.pow2, g.rowwise, g.row_scale_inv, g.colwise, g.col_scale_inv}, what, padded);
      KILN_CHECK(groups.empty() || kg.format == k.format, what, ": every group's codes in one format");
      k.format = kg.format;
      groups.push_back({g.first, g.rows, kg.row_rows, kg.col_cols, kg.rowwise, kg.row_scale_inv, kg.colwise,
                        kg.col_scale_inv});
    }
    return groups;
  }
  // A block quantisation's copies and their scales (codes [rows, cols] and the transpose's [cols,
  // rows], one format; with `padded`, [Rr >= rows, cols] and [cols, Rc >= rows]) into k, checked
  // against k's shape.
  static void block_outputs(cuda::BlockCast& k, const BlockQuantizeArgs& out, const char* what, bool padded) {
    // Padded copies (more rows, or columns of the transpose, than x has rows) where `padded`.
    k.row_rows = padded && out.rowwise.ndim() == 2 ? std::max(k.rows, out.rowwise.size(0)) : k.rows;
    k.col_cols = padded && out.colwise.ndim() == 2 ? std::max(k.rows, out.colwise.size(1)) : k.rows;
    const Shape shapes[2] = {{k.row_rows, k.cols}, {k.cols, k.col_cols}};
    const TensorView* copies[2] = {&out.rowwise, &out.colwise};
    float* scales[2] = {out.row_scale_inv, out.col_scale_inv};
    for (int i = 0; i < 2; ++i) {
      const TensorView& t = *copies[i];
      if (!t) continue;
      KILN_CHECK(t.shape == shapes[i] && t.contiguous() && t.device == Device::cuda &&
                     (t.dtype == DType::e4m3 || t.dtype == DType::e5m2) && scales[i],
                 what, ": ", i == 0 ? "rowwise" : "colwise", " codes ", t.str(), " (and their scales) for [", k.rows,
                 ", ", k.cols, "]");
      k.format = t.dtype == DType::e4m3 ? Format::e4m3 : Format::e5m2;
    }
    KILN_CHECK(!out.rowwise || !out.colwise || out.rowwise.dtype == out.colwise.dtype, what,
               ": both copies in one format");
    k.rowwise = out.rowwise ? out.rowwise.as<std::uint8_t>() : nullptr;
    k.row_scale_inv = out.rowwise ? out.row_scale_inv : nullptr;
    k.colwise = out.colwise ? out.colwise.as<std::uint8_t>() : nullptr;
    k.col_scale_inv = out.colwise ? out.col_scale_inv : nullptr;
  }
  // The optimizer step's tensors and numbers of an AdamWQuantizeArgs (its copies left to the caller).
  static cuda::AdamWQuantizeDev step_of(const AdamWQuantizeArgs& a) {
    cuda::AdamWQuantizeDev k;
    k.param = a.param.as<float>();
    k.grad = a.grad.data;
    k.bf16_grad = a.grad.dtype == DType::bf16;
    k.m = a.m.data;
    k.v = a.v.data;
    k.bf16_moments = a.m.dtype == DType::bf16;
    k.lr = a.lr;
    k.beta1 = a.beta1;
    k.beta2 = a.beta2;
    k.eps = a.eps;
    k.weight_decay = a.weight_decay;
    k.grad_scale = a.grad_scale;
    k.step = a.step;
    k.scalars = a.scalars;
    return k;
  }
  static void check_swiglu_input(const TensorView& pre, const char* what) {
    KILN_CHECK(pre.device == Device::cuda && pre.dtype == DType::bf16 && pre.ndim() == 2 && pre.size(1) % 2 == 0 &&
                   pre.contiguous(),
               what, ": expected a contiguous bf16 CUDA tensor [rows, 2 F], got ", pre.str());
  }
  // An optional FP8 copy: a contiguous CUDA tensor of the format's dtype and the given shape.
  static void check_copy(const TensorView& t, Format f, const Shape& shape, const char* what) {
    if (!t) return;
    KILN_CHECK(t.device == Device::cuda && t.dtype == dtype_of(f) && t.contiguous() && t.shape == shape, what, " ",
               t.str(), ": expected a contiguous CUDA ", name_of(f), shape.str());
  }
  // The grouped cast of x's experts (offsets on the host; or, without, `rows_each` rows each, no
  // padding) into out's copies, its plan uploaded on the stream.
  void grouped_cast(const TensorView& x, const std::int32_t* offsets, int experts, std::int64_t rows_each,
                    const Fp8TensorView& out, float* amax) {
    const std::int64_t cols = x.size(x.ndim() - 1);
    cuda::GroupedCast k;
    k.x = x.data;
    k.x_dtype = x.dtype;
    grouped_cast(k, cuda::grouped_cast_plan(offsets, experts, rows_each, cols), cols, out, amax,
                 offsets != nullptr || rows_each % 16 == 0);
  }
  // k (its source set) completed with a plan of cols-wide rows and launched.
  void grouped_cast(cuda::GroupedCast& k, const std::vector<std::int32_t>& plan, std::int64_t cols,
                    const Fp8TensorView& out, float* amax, bool tiled) {
    const std::size_t E = plan.size() / 3 - 1;
    k.experts = static_cast<int>(E);
    k.used_rows = plan[E];
    k.padded_rows = plan[2 * E + 1];
    k.tiles = plan[3 * E + 2];
    k.tiled = tiled;
    k.cols = cols;
    k.rowwise = out.rowwise.as<std::uint8_t>();
    k.colwise = out.colwise.as<std::uint8_t>();
    k.format = out.format;
    k.scale = out.scale;
    k.amax = amax;
    if (E <= static_cast<std::size_t>(cuda::kInlinePlanExperts))
      std::copy(plan.begin(), plan.end(), k.inline_plan.v);
    else if (k.rowwise || k.colwise || k.source != cuda::CastSource::plain)
      k.plan = static_cast<const std::int32_t*>(uploads_.upload(plan.data(), plan.size() * sizeof(std::int32_t)));
    cuda::cast_transpose_grouped(k, stream_);
  }
  // A grouped cast computing its values from x (and grad) as it loads them: contiguous bf16 CUDA tensors.
  static cuda::GroupedCast source_of(cuda::CastSource source, const TensorView& x, const TensorView& grad,
                                     const char* what) {
    const auto check = [what](const TensorView& t) {
      KILN_CHECK(t.device == Device::cuda && t.dtype == DType::bf16 && t.contiguous(), what,
                 ": expected a contiguous bf16 CUDA tensor, got ", t.str());
    };
    check(x);
    if (source == cuda::CastSource::dgelu || source == cuda::CastSource::dswiglu) check(grad);
    cuda::GroupedCast k;
    k.x = x.data;
    k.x_dtype = DType::bf16;
    k.source = source;
    k.grad = grad ? grad.data : nullptr;
    return k;
  }

  static void check_outputs(const TensorView& x, const Fp8TensorView& out, const char* what) {
    KILN_CHECK(out.scale, what, ": no scale");
    const std::int64_t R = x.size(0), C = x.size(1);
    for (const TensorView* t : {&out.rowwise, &out.colwise})
      if (*t) KILN_CHECK(t->device == Device::cuda && t->dtype == dtype_of(out.format) && t->contiguous(), what,
                         ": output ", t->str(), " for format ", name_of(out.format));
    if (out.rowwise) KILN_CHECK(out.rowwise.shape == Shape({R, C}), what, ": rowwise ", out.rowwise.str(), " for x ", x.str());
    if (out.colwise) KILN_CHECK(out.colwise.shape == Shape({C, R}), what, ": colwise ", out.colwise.str(), " for x ", x.str());
  }

  float* scratch(std::int64_t n) {
    const std::size_t bytes = static_cast<std::size_t>(std::max<std::int64_t>(n, 1)) * sizeof(float);
    if (scratch_.bytes() < bytes) {
      synchronize();  // the old scratch may still be in use
      scratch_ = Buffer(Device::cuda, bytes + bytes / 4);
    }
    return static_cast<float*>(scratch_.data());
  }

  // bias_grad's counters: zeroed once, left zero by every call.
  unsigned* tickets(std::int64_t n) {
    const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(unsigned);
    if (tickets_.bytes() < bytes) {
      synchronize();
      tickets_ = Buffer(Device::cuda, std::max<std::size_t>(bytes, 4096));
      KILN_CUDA_CHECK(cudaMemsetAsync(tickets_.data(), 0, tickets_.bytes(), stream_));
    }
    return static_cast<unsigned*>(tickets_.data());
  }

  cudaStream_t stream_;
  cublasLtHandle_t lt_ = nullptr;
  Buffer workspace_;
  std::unique_ptr<cuda::Fp8GemmRunner> gemm_;
  std::unique_ptr<kiln::cuda::LtLanes> lanes_;  // made by the first grouped GEMM
  Buffer scratch_;
  Buffer tickets_;
  HostUploads uploads_;
};

}  // namespace

std::unique_ptr<Fp8Ops> make_cuda_ops(void* stream, const CudaOpsOptions& options) {
  return std::make_unique<CudaOps>(static_cast<cudaStream_t>(stream), options);
}

}  // namespace kiln::fp8
