#include "cuda_backend.hpp"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <numeric>

#include "kiln/ops/formulas.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::ops {

bool cuda_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

std::unique_ptr<Backend> make_cuda_backend(int device_index, const CudaOptions& options) {
  if (!cuda_available()) KILN_THROW("no CUDA device is visible (engine.device = \"cuda\" needs a GPU)");
  auto b = std::make_unique<cuda_impl::CudaBackend>(device_index, options);
  return b;
}

namespace cuda_impl {

using cuda::bf16;

namespace {
constexpr std::size_t kWorkspaceBytes = 32u << 20;

void check_dev(const TensorView& t, DType dtype, const char* what) {
  if (t.device != Device::cuda || t.dtype != dtype || !t.contiguous())
    KILN_THROW(what, ": expected a contiguous ", name_of(dtype), " CUDA tensor, got ", t.str());
}

// The shape cuDNN's attention sees; kv_heads 0 is multi-head attention.
template <class Args>
CudnnAttention::Shape cudnn_shape(const AttentionDims& d, const Args& a) {
  const int H = i32(d.H);
  return {i32(d.B), i32(d.T), H, a.kv_heads != 0 ? a.kv_heads : H, i32(d.D)};
}
}  // namespace

CudaBackend::CudaBackend(int device, const CudaOptions& options)
    : device_(device),
      attention_(options.attention),
      attention_deterministic_(options.attention_deterministic),
      grouped_call_(options.grouped_gemm == GroupedGemmImpl::grouped),
      grouped_tune_(options.grouped_gemm_tune) {
  KILN_CUDA_CHECK(cudaSetDevice(device));
  std::size_t total = 0;
  KILN_CUDA_CHECK(cudaMemGetInfo(&free_at_start_, &total));
  cudaDeviceProp prop{};
  KILN_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  name_ = cat("cuda:", device, " ", prop.name);
  sm_count_ = prop.multiProcessorCount;
  std::string n = prop.name;
  // Dense bf16 tensor-core peak from the data sheets (SXM parts); used for MFU.
  if (n.find("H100") != std::string::npos || n.find("H200") != std::string::npos || n.find("GH200") != std::string::npos)
    peak_flops_ = 989.4e12;
  else if (n.find("A100") != std::string::npos)
    peak_flops_ = 312e12;
  KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  KILN_CUBLAS_CHECK(cublasLtCreate(&lt_));
  workspace_ = Buffer(Device::cuda, kWorkspaceBytes);
  gemm_ = std::make_unique<cuda::GemmRunner>(lt_, workspace_.data(), kWorkspaceBytes);
  gemm_->set_autotune(options.gemm_autotune, options.gemm_autotune_any_order);
}

CudaBackend::~CudaBackend() {
  cudaStreamSynchronize(stream_);
  for (auto& p : pending_) {
    cudaEventDestroy(p.start);
    cudaEventDestroy(p.end);
  }
  for (auto e : event_pool_) cudaEventDestroy(e);
  grouped_.reset();
  gemm_.reset();
  cudnn_.reset();
  if (lt_) cublasLtDestroy(lt_);
  if (stream_) cudaStreamDestroy(stream_);
}

int CudaBackend::begin_op(const char* op) {
  if (!profiling_) return -1;
  auto take = [&] {
    if (event_pool_.empty()) {
      cudaEvent_t e;
      KILN_CUDA_CHECK(cudaEventCreate(&e));
      return e;
    }
    auto e = event_pool_.back();
    event_pool_.pop_back();
    return e;
  };
  Pending p{op, take(), take()};
  KILN_CUDA_CHECK(cudaEventRecord(p.start, stream_));
  pending_.push_back(p);
  return static_cast<int>(pending_.size()) - 1;
}

void CudaBackend::end_op(int token) {
  if (token >= 0 && token < static_cast<int>(pending_.size())) cudaEventRecord(pending_[token].end, stream_);
}

std::vector<Backend::OpTime> CudaBackend::op_times() {
  KILN_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (auto& p : pending_) {
    float ms = 0;
    KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, p.start, p.end));
    auto& t = times_[p.op];
    t.op = p.op;
    t.ms += ms;
    ++t.calls;
    event_pool_.push_back(p.start);
    event_pool_.push_back(p.end);
  }
  pending_.clear();
  std::vector<OpTime> out;
  for (auto& [_, t] : times_) out.push_back(t);
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.ms > b.ms; });
  return out;
}

void CudaBackend::reset_op_times() {
  op_times();
  times_.clear();
}

float* CudaBackend::scratch_floats(std::int64_t n) {
  std::size_t bytes = static_cast<std::size_t>(std::max<std::int64_t>(n, 1)) * sizeof(float);
  if (scratch_.bytes() < bytes) {
    KILN_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old scratch may still be in use
    scratch_ = Buffer(Device::cuda, bytes + bytes / 4);
  }
  return static_cast<float*>(scratch_.data());
}

unsigned* CudaBackend::tickets(std::int64_t n) {
  const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(unsigned);
  if (tickets_.bytes() < bytes) {
    KILN_CUDA_CHECK(cudaStreamSynchronize(stream_));
    tickets_ = Buffer(Device::cuda, std::max<std::size_t>(bytes, 4096));
    KILN_CUDA_CHECK(cudaMemsetAsync(tickets_.data(), 0, tickets_.bytes(), stream_));
  }
  return static_cast<unsigned*>(tickets_.data());
}

void CudaBackend::copy(const TensorView& dst, const TensorView& src) {
  KILN_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel() && dst.contiguous() && src.contiguous(), "copy ",
             src.str(), " -> ", dst.str());
  Timer t(*this, "copy");
  KILN_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDefault, stream_));
  if (dst.device == Device::cpu) KILN_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::copy_to_host_async(const TensorView& host_dst, const TensorView& src) {
  KILN_CHECK(host_dst.device == Device::cpu, "copy_to_host_async ", src.str(), " -> ", host_dst.str());
  Timer t(*this, "copy");
  copy_on(stream_, host_dst, src);  // checks the shapes
}

void CudaBackend::copy_on(void* stream, const TensorView& dst, const TensorView& src) {
  KILN_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel() && dst.contiguous() && src.contiguous() && stream,
             "copy_on ", src.str(), " -> ", dst.str());
  KILN_CUDA_CHECK(
      cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
}

void CudaBackend::convert(const TensorView& dst, const TensorView& src) {
  if (src.dtype == dst.dtype) return copy(dst, src);  // between devices too
  Timer t(*this, "convert");
  convert_on(stream_, dst, src);
}

void CudaBackend::convert_on(void* stream, const TensorView& dst, const TensorView& src) {
  KILN_CHECK(dst.numel() == src.numel(), "convert ", src.str(), " -> ", dst.str());
  auto* s = static_cast<cudaStream_t>(stream);
  if (src.dtype == DType::f32 && dst.dtype == DType::bf16) {
    check_dev(src, DType::f32, "convert src");
    check_dev(dst, DType::bf16, "convert dst");
    cuda::convert_f32_to_bf16(dptr<bf16>(dst), dptr<float>(src), src.numel(), s);
  } else if (src.dtype == DType::bf16 && dst.dtype == DType::f32) {
    check_dev(src, DType::bf16, "convert src");
    check_dev(dst, DType::f32, "convert dst");
    cuda::convert_bf16_to_f32(dptr<float>(dst), dptr<bf16>(src), src.numel(), s);
  } else if (src.dtype == dst.dtype) {
    KILN_CHECK(dst.device == Device::cuda && src.device == Device::cuda, "convert_on ", src.str(), " -> ", dst.str(),
               ": device tensors");
    KILN_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDeviceToDevice, s));
  } else {
    KILN_THROW("convert ", src.str(), " -> ", dst.str(), " is not supported");
  }
}

void CudaBackend::zero(const TensorView& t) {
  check_zero_args(t, kTarget);
  KILN_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.bytes(), stream_));
}

void CudaBackend::zero_many(std::span<const TensorView> ts) {
  std::vector<cuda::ZeroRun> runs;
  std::int64_t work = 0;
  for (const TensorView& t : ts) {
    KILN_CHECK((t.dtype == DType::f32 || t.dtype == DType::bf16) && t.device == Device::cuda && t.contiguous(),
               "zero_many: ", t.str(), " is not a contiguous f32 or bf16 device tensor");
    if (t.numel() == 0) continue;
    // Zero bits are 0 in either dtype: a bf16 piece of whole aligned words is zeroed as f32 words (a
    // gradient buffer's pieces are: parameters start at multiples of nn::kParamAlign), another apart.
    std::int64_t words = t.numel();
    if (t.dtype == DType::bf16) {
      if (t.numel() % 2 != 0 || reinterpret_cast<std::uintptr_t>(t.data) % 4 != 0) {
        zero(t);
        continue;
      }
      words = t.numel() / 2;
    }
    runs.push_back({static_cast<float*>(t.data), words, work});
    work += (words + 3) / 4 * 4;
  }
  if (runs.empty()) return;
  Timer timer(*this, "zero_many");
  cuda::zero_many(device_table(zero_table_, runs), static_cast<int>(runs.size()), work, stream_);
}

void CudaBackend::synchronize() { KILN_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

namespace {

// The sum_squares partials of a checked f32 or bf16 tensor (a gradient) into `partials`.
void sum_squares_into(float* partials, const TensorView& x, cudaStream_t s) {
  if (x.dtype == DType::bf16)
    cuda::sum_squares_bf16(partials, static_cast<const std::uint16_t*>(x.data), x.numel(), s);
  else
    cuda::sum_squares_f32(partials, dptr<float>(x), x.numel(), s);
}

}  // namespace

double CudaBackend::sum_squares(const TensorView& x) { return sum_squares_each(std::span(&x, 1)).front(); }

// Each tensor's partials go to its own range of the scratch; one copy back and one synchronisation
// for all of them; each total is summed over its own partials in order (as for a single tensor).
std::vector<double> CudaBackend::sum_squares_each(std::span<const TensorView> xs) {
  Timer t(*this, "sum_squares");
  std::vector<std::int64_t> first(xs.size() + 1, 0);
  for (std::size_t i = 0; i < xs.size(); ++i) {
    first[i + 1] = first[i] + cuda::sum_squares_partials(check_grad_tensor("sum_squares", "x", xs[i], kTarget));
  }
  float* partials = scratch_floats(first.back());
  for (std::size_t i = 0; i < xs.size(); ++i) sum_squares_into(partials + first[i], xs[i], stream_);
  std::vector<float> host(static_cast<std::size_t>(first.back()));
  KILN_CUDA_CHECK(cudaMemcpyAsync(host.data(), partials, host.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  KILN_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::vector<double> out(xs.size(), 0.0);
  for (std::size_t i = 0; i < xs.size(); ++i)
    for (std::int64_t k = first[i]; k < first[i + 1]; ++k) out[i] += host[static_cast<std::size_t>(k)];
  return out;
}

void CudaBackend::init_normal(const TensorView& dst, float std, rng::PhiloxArgs r, std::int64_t global_offset) {
  const std::int64_t n = check_f32_tensor("init_normal", "dst", dst, kTarget);
  cuda::init_normal_f32(dptr<float>(dst), n, std, r, global_offset, stream_);
}

void CudaBackend::fill(const TensorView& dst, float value) {
  const std::int64_t n = check_f32_tensor("fill", "dst", dst, kTarget);
  cuda::fill_f32(dptr<float>(dst), value, n, stream_);
}

void CudaBackend::add(const TensorView& dst, const TensorView& src) {
  Timer t(*this, "add");
  const std::int64_t n = check_add_args(dst, src, kTarget);
  if (dst.dtype == DType::bf16)  // bf16 gradients (the check made src bf16 too)
    cuda::add_bf16(dptr<bf16>(dst), dptr<bf16>(src), n, stream_);
  else
    cuda::add_f32(dptr<float>(dst), dptr<float>(src), n, stream_);
}

void CudaBackend::embedding_forward(const EmbeddingForward& a) {
  Timer t(*this, "embedding_forward");
  const EmbeddingDims d = check_args(a, kTarget);
  cuda::embedding_forward(dptr<bf16>(a.out), dptr<std::int32_t>(a.tokens), dptr<bf16>(a.wte), dptr<bf16>(a.wpe),
                          i32(d.N), a.T, i32(d.C), a.vocab_begin, i32(d.V), a.positions, stream_);
}

void CudaBackend::embedding_backward(const EmbeddingBackward& a) {
  Timer t(*this, "embedding_backward");
  const EmbeddingDims d = check_args(a, kTarget);
  const int N = i32(d.N), C = i32(d.C), V = i32(d.V);
  // The kernel writes dwte rows by token id: an id outside the table would write out of bounds (the
  // buckets leave such tokens out as well).
  check_tokens("embedding_backward", "tokens_host", a.tokens_host, N, d.vocab_total);
  // This table's positions bucketed by token on the device (stable), so the kernel sums each token's
  // rows in order: nothing of the step's tokens passes through the host.
  const std::size_t words = 3 * static_cast<std::size_t>(N) + 1;
  const std::size_t bytes = words * sizeof(std::int32_t) + cuda::embedding_buckets_scratch(N, V);
  if (embed_buckets_.bytes() < bytes) {
    KILN_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old buffer may still be in use
    embed_buckets_ = Buffer(Device::cuda, bytes);
  }
  auto* order = static_cast<std::int32_t*>(embed_buckets_.data());
  std::int32_t *ends = order + N, *tokens = ends + N;
  int* runs = tokens + N;
  cuda::embedding_buckets(order, ends, tokens, runs, dptr<std::int32_t>(a.tokens), a.vocab_begin, V, N, runs + 1,
                          bytes - words * sizeof(std::int32_t), stream_);
  if (a.dwte.dtype == DType::bf16)  // bf16 gradients (the check made dwpe match)
    cuda::embedding_backward(dptr<bf16>(a.dwte), dptr<bf16>(a.dwpe), dptr<bf16>(a.dout), order, ends, tokens, runs, V,
                             N, a.T, C, stream_);
  else
    cuda::embedding_backward(dptr<float>(a.dwte), dptr<float>(a.dwpe), dptr<bf16>(a.dout), order, ends, tokens, runs,
                             V, N, a.T, C, stream_);
}

void CudaBackend::layernorm_forward(const LayerNormForward& a) {
  Timer t(*this, "layernorm_forward");
  const RowDims d = check_args(a, kTarget);
  cuda::layernorm_forward(dptr<bf16>(a.out), dptr<float>(a.mean), dptr<float>(a.rstd), dptr<bf16>(a.x),
                          dptr<bf16>(a.weight), dptr<bf16>(a.bias), i32(d.N), i32(d.C), a.eps, stream_);
}

void CudaBackend::layernorm_backward(const LayerNormBackward& a) {
  Timer t(*this, "layernorm_backward");
  const RowDims d = check_args(a, kTarget);
  const int N = i32(d.N), C = i32(d.C);
  float* scratch = scratch_floats(cuda::layernorm_backward_scratch(N, C));
  if (a.dweight.dtype == DType::bf16)  // bf16 gradients (the check made dbias match)
    cuda::layernorm_backward(dptr<bf16>(a.dx), dptr<bf16>(a.dweight), dptr<bf16>(a.dbias), scratch,
                             dptr<bf16>(a.dout), dptr<bf16>(a.x), dptr<bf16>(a.weight), dptr<float>(a.mean),
                             dptr<float>(a.rstd), N, C, stream_);
  else
    cuda::layernorm_backward(dptr<bf16>(a.dx), dptr<float>(a.dweight), dptr<float>(a.dbias), scratch,
                             dptr<bf16>(a.dout), dptr<bf16>(a.x), dptr<bf16>(a.weight), dptr<float>(a.mean),
                             dptr<float>(a.rstd), N, C, stream_);
}

void CudaBackend::linear_forward(const LinearForward& a) {
  Timer t(*this, a.pre_gelu ? "linear_forward_gelu" : "linear_forward");
  const LinearDims d = check_args(a, kTarget);
  cuda::GemmDesc g;
  g.M = i32(d.N);
  g.N = i32(d.OC);
  g.K = i32(d.IC);
  g.A = dptr<bf16>(d.x);
  g.B = dptr<bf16>(a.weight);
  g.trans_b = true;  // out = x @ W^T
  g.D = a.out.data;
  g.sm_count = gemm_sms();
  if (a.pre_gelu) {
    g.epilogue = Epilogue::gelu;  // without a bias, cuBLASLt's GELU_AUX
    g.aux = dptr<bf16>(a.pre_gelu);
    g.bias = a.bias ? dptr<bf16>(a.bias) : nullptr;
  } else if (a.bias) {
    g.epilogue = Epilogue::bias;
    g.bias = dptr<bf16>(a.bias);
  }
  gemm_->run(g, stream_);
}

void CudaBackend::linear_backward(const LinearBackward& a) {
  Timer t(*this, a.dx_gelu_pre ? "linear_backward_dgelu" : "linear_backward");
  const LinearDims d = check_args(a, kTarget);
  const int N = i32(d.N), IC = i32(d.IC), OC = i32(d.OC);
  if (a.dx) {
    cuda::GemmDesc g;  // dx[N, IC] = dout[N, OC] @ W[OC, IC]
    g.M = N;
    g.N = IC;
    g.K = OC;
    g.A = dptr<bf16>(d.dout);
    g.B = dptr<bf16>(a.weight);
    g.D = a.dx.data;
    g.sm_count = gemm_sms();
    if (a.dx_gelu_pre) {
      g.epilogue = Epilogue::dgelu;
      g.aux = dptr<bf16>(a.dx_gelu_pre);
    }
    gemm_->run(g, stream_);
    if (a.dgrad_queued) a.dgrad_queued();
  }
  if (!a.dweight) return;  // dx alone
  cuda::GemmDesc w;  // dW[OC, IC] += dout^T[OC, N] @ x[N, IC] (or =)
  w.M = OC;
  w.N = IC;
  w.K = N;
  w.A = dptr<bf16>(d.dout);
  w.trans_a = true;
  w.B = dptr<bf16>(d.x);
  w.D = a.dweight.data;
  // A bf16 gradient (optim.grads = "bf16"): D and C bf16, split-K partial sums in f32. Written, the
  // product is rounded once; accumulated, cuBLASLt's kernel rounds as if the product were rounded
  // before the old value is added (docs/PERF.md, "bf16 gradients").
  const bool bf16_grads = a.dweight.dtype == DType::bf16;
  w.d_f32 = !bf16_grads;
  w.f32_partials = bf16_grads;
  w.accumulate = !a.dweight_overwrite;
  w.sm_count = gemm_sms();
  gemm_->run(w, stream_);
  if (a.dbias) {
    float* scratch = scratch_floats(cuda::bias_grad_scratch(N, OC));
    unsigned* counters = tickets(cuda::bias_grad_tickets(OC));
    if (bf16_grads)  // the check made dbias bf16 too
      cuda::bias_grad(dptr<bf16>(a.dbias), scratch, counters, dptr<bf16>(d.dout), N, OC, stream_);
    else
      cuda::bias_grad(dptr<float>(a.dbias), scratch, counters, dptr<bf16>(d.dout), N, OC, stream_);
  }
}

void CudaBackend::gelu_forward(const GeluForward& a) {
  Timer t(*this, "gelu_forward");
  const std::int64_t n = check_args(a, kTarget);
  cuda::gelu_forward(dptr<bf16>(a.out), dptr<bf16>(a.x), n, stream_);
}

void CudaBackend::gelu_backward(const GeluBackward& a) {
  Timer t(*this, "gelu_backward");
  const std::int64_t n = check_args(a, kTarget);
  cuda::gelu_backward(dptr<bf16>(a.dx), dptr<bf16>(a.dout), dptr<bf16>(a.x), n, stream_);
}

void CudaBackend::rmsnorm_forward(const RmsNormForward& a) {
  Timer t(*this, "rmsnorm_forward");
  const RowDims d = check_args(a, kTarget);
  cuda::rmsnorm_forward(dptr<bf16>(a.out), dptr<float>(a.rstd), dptr<bf16>(a.x), dptr<bf16>(a.weight), i32(d.N),
                        i32(d.C), a.eps, stream_);
}

void CudaBackend::rmsnorm_backward(const RmsNormBackward& a) {
  Timer t(*this, "rmsnorm_backward");
  const RowDims d = check_args(a, kTarget);
  const int N = i32(d.N), C = i32(d.C);
  float* scratch = scratch_floats(cuda::rmsnorm_backward_scratch(N, C));
  if (a.dweight.dtype == DType::bf16)  // a bf16 gradient
    cuda::rmsnorm_backward(dptr<bf16>(a.dx), dptr<bf16>(a.dweight), scratch, dptr<bf16>(a.dout), dptr<bf16>(a.x),
                           dptr<bf16>(a.weight), dptr<float>(a.rstd), N, C, stream_);
  else
    cuda::rmsnorm_backward(dptr<bf16>(a.dx), dptr<float>(a.dweight), scratch, dptr<bf16>(a.dout), dptr<bf16>(a.x),
                           dptr<bf16>(a.weight), dptr<float>(a.rstd), N, C, stream_);
}

void CudaBackend::rope(const Rope& a) {
  Timer t(*this, "rope");
  const RopeDims d = check_args(a, kTarget);
  cuda::rope(dptr<bf16>(a.x), i32(d.B), i32(d.T), i32(d.heads), a.rotated_heads, i32(d.D), a.theta, a.scaling,
             a.pos_offset, a.inverse, stream_);
}

void CudaBackend::swiglu_forward(const SwigluForward& a) {
  Timer t(*this, "swiglu_forward");
  const RowDims d = check_args(a, kTarget);
  cuda::swiglu_forward(dptr<bf16>(a.out), dptr<bf16>(a.x), d.N, i32(d.C), stream_);
}

void CudaBackend::swiglu_backward(const SwigluBackward& a) {
  Timer t(*this, "swiglu_backward");
  const RowDims d = check_args(a, kTarget);
  cuda::swiglu_backward(dptr<bf16>(a.dx), dptr<bf16>(a.dout), dptr<bf16>(a.x), d.N, i32(d.C), stream_);
}

std::size_t CudaBackend::device_memory_in_use() const {
  // Device-wide free memory is all CUDA reports; its drop since construction is what this process
  // (mostly this backend and its model) has taken, other processes on the GPU aside.
  std::size_t free_now = 0, total = 0;
  if (cudaMemGetInfo(&free_now, &total) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return free_at_start_ > free_now ? free_at_start_ - free_now : 0;
}

bool CudaBackend::use_cudnn_attention(float dropout, const CudnnAttention::Shape& s) {
  if (attention_ == AttentionImpl::kiln || dropout != 0.0f || cudnn_unavailable_) return false;
  const auto shape = std::make_tuple(s.B, s.T, s.H, s.Hkv, s.D);
  if (cudnn_refused_.count(shape)) return false;
  try {
    if (!cudnn_) cudnn_ = std::make_unique<CudnnAttention>(stream_, attention_deterministic_);
  } catch (const Error& e) {
    if (attention_ == AttentionImpl::cudnn) throw;
    std::cerr << "[kiln] backend.attention = auto: " << e.what() << "; attention runs kiln's kernels\n";
    cudnn_unavailable_ = true;
    return false;
  }
  try {
    cudnn_->prepare(s);
  } catch (const Error& e) {
    if (attention_ == AttentionImpl::cudnn) throw;
    std::cerr << "[kiln] backend.attention = auto: " << cudnn_->version() << " takes no attention of B=" << s.B
              << " T=" << s.T << " H=" << s.H << " kv_heads=" << s.Hkv << " D=" << s.D << " (" << e.what()
              << "); kiln's kernels run it\n";
    cudnn_refused_.insert(shape);
    return false;
  }
  return true;
}

void CudaBackend::attention_forward(const AttentionForward& a) {
  Timer t(*this, "attention_forward");
  const AttentionDims d = check_args(a, kTarget);
  const CudnnAttention::Shape s = cudnn_shape(d, a);
  // Packed documents (doc_start) run kiln's kernels, as dropout does: cuDNN takes whole sequences.
  if (!a.doc_start && use_cudnn_attention(a.dropout, s)) {
    void* ws = scratch_floats(static_cast<std::int64_t>(cudnn_->forward_workspace_bytes(s) / sizeof(float)));
    cudnn_->forward(a.out.data, dptr<float>(a.lse), a.qkv.data, s, a.scale, ws);
    return;
  }
  cuda::attention_forward(dptr<bf16>(a.out), dptr<float>(a.lse), dptr<bf16>(a.qkv), s.B, s.T, s.H, s.D, a.scale,
                          a.dropout, a.rng, a.head_offset, i32(d.heads_total), a.seq_offset, stream_, a.kv_heads,
                          a.doc_start ? dptr<std::int32_t>(a.doc_start) : nullptr);
}

void CudaBackend::attention_backward(const AttentionBackward& a) {
  Timer t(*this, "attention_backward");
  const AttentionDims d = check_args(a, kTarget);
  const CudnnAttention::Shape s = cudnn_shape(d, a);
  if (!a.doc_start && use_cudnn_attention(a.dropout, s)) {
    void* ws = scratch_floats(static_cast<std::int64_t>(cudnn_->backward_workspace_bytes(s) / sizeof(float)));
    cudnn_->backward(a.dqkv.data, a.dout.data, a.out.data, dptr<float>(a.lse), a.qkv.data, s, a.scale, ws);
    return;
  }
  float* scratch = scratch_floats(cuda::attention_backward_scratch(s.B, s.T, s.H, s.D, a.kv_heads));
  cuda::attention_backward(dptr<bf16>(a.dqkv), scratch, dptr<bf16>(a.dout), dptr<bf16>(a.out), dptr<float>(a.lse),
                           dptr<bf16>(a.qkv), s.B, s.T, s.H, s.D, a.scale, a.dropout, a.rng, a.head_offset,
                           i32(d.heads_total), a.seq_offset, stream_, a.kv_heads,
                           a.doc_start ? dptr<std::int32_t>(a.doc_start) : nullptr);
}

void CudaBackend::attention_decode(const AttentionDecode& a) {
  Timer t(*this, "attention_decode");
  const AttentionDecodeDims d = check_args(a, kTarget);
  const int B = i32(d.B), H = i32(d.H), D = i32(d.D), length = i32(d.length);
  float* scratch = scratch_floats(cuda::attention_decode_scratch(B, H, D, length));
  cuda::attention_decode(dptr<bf16>(a.out), scratch, dptr<bf16>(a.qkv), B, i32(d.Tmax), H, D, length, a.scale, stream_,
                         a.kv_heads);
}

void CudaBackend::residual_forward(const ResidualForward& a) {
  Timer t(*this, "residual_forward");
  const RowDims d = check_args(a, kTarget);
  cuda::residual_forward(dptr<bf16>(a.out), dptr<bf16>(a.residual), dptr<bf16>(a.x), i32(d.N), i32(d.C), a.dropout,
                         stream_);
}

void CudaBackend::dropout_backward(const DropoutBackward& a) {
  Timer t(*this, "dropout_backward");
  const RowDims d = check_args(a, kTarget);
  cuda::dropout_backward(dptr<bf16>(a.dx), dptr<bf16>(a.dout), i32(d.N), i32(d.C), a.dropout, stream_);
}

void CudaBackend::cross_entropy(const CrossEntropy& a) {
  Timer t(*this, "cross_entropy");
  const CrossEntropyDims d = check_args(a, kTarget);
  cuda::cross_entropy(dptr<float>(a.losses), dptr<bf16>(a.logits), dptr<std::int32_t>(a.targets), i32(d.N), i32(d.V),
                      a.vocab_real, a.dloss, stream_);
}

void CudaBackend::cross_entropy_stats(const CrossEntropyStats& a) {
  Timer t(*this, "cross_entropy_stats");
  const CrossEntropyDims d = check_args(a, kTarget);
  cuda::cross_entropy_stats(dptr<float>(a.stats), dptr<bf16>(a.logits), dptr<std::int32_t>(a.targets), i32(d.N),
                            i32(d.V), a.vocab_real, a.vocab_begin, stream_);
}

void CudaBackend::cross_entropy_finish(const CrossEntropyFinish& a) {
  Timer t(*this, "cross_entropy_finish");
  const CrossEntropyDims d = check_args(a, kTarget);
  cuda::cross_entropy_finish(dptr<float>(a.losses), a.lse ? dptr<float>(a.lse) : nullptr, dptr<bf16>(a.logits),
                             dptr<std::int32_t>(a.targets), dptr<float>(a.all_stats), i32(d.ranks), i32(d.N), i32(d.V),
                             a.vocab_real, a.vocab_begin, a.dloss, a.write_dlogits, stream_);
}

void CudaBackend::adamw(const AdamW& a) {
  Timer t(*this, "adamw");
  // The kernel gets the segments it updates, end to end in its work space (each rounded up to a
  // multiple of 4): a table on the device, the same every step.
  const AdamWPlan plan = check_args(a, kTarget);
  std::vector<cuda::AdamWSegmentDev> table;
  std::int64_t work = 0;
  for (const AdamWSegment& s : plan.segments) {
    if (!s.update) continue;
    const std::int64_t act = !a.params_act || s.act == AdamWSegment::kNoAct ? -1
                             : s.act == AdamWSegment::kActAtOffset     ? s.offset
                                                                       : s.act;
    table.push_back({s.offset, s.count, s.decay ? a.weight_decay : 0.0f, work, act});
    work += (s.count + 3) / 4 * 4;
  }
  if (table.empty()) return;
  const cuda::AdamWSegmentDev* segments = device_table(adamw_table_, table);
  float bc1 = 0, bc2 = 0;
  adamw_bias_corrections(a.beta1, a.beta2, a.step, bc1, bc2);
  cuda::adamw(dptr<float>(a.params), a.params_act ? dptr<bf16>(a.params_act) : nullptr, a.grads.data,
              a.grads.dtype == DType::bf16, a.m.data, a.v.data, a.m.dtype == DType::bf16, segments,
              static_cast<int>(table.size()), work, a.lr, a.beta1, a.beta2, a.eps, a.grad_scale, bc1, bc2, a.scalars,
              stream_);
}

void CudaBackend::grad_clip(const GradClip& a) {
  Timer t(*this, "grad_clip");
  KILN_CHECK(a.scalars && a.norm, "grad_clip: scalars and norm are required");
  if (a.sum_squares) {
    cuda::grad_clip_from_sum(a.sum_squares, a.max_norm, a.scalars, a.norm, stream_);
    return;
  }
  const std::int64_t n = check_grad_tensor("grad_clip", "grads", a.grads, kTarget);
  const std::int64_t count = cuda::sum_squares_partials(n);
  float* partials = scratch_floats(count);
  sum_squares_into(partials, a.grads, stream_);
  cuda::grad_clip_finish(partials, count, a.max_norm, a.scalars, a.norm, stream_);
}

// Each counted part's partials in their own range of the scratch (as sum_squares_each), added up on
// the device; the table of ranges stays on the device while the parts do.
void CudaBackend::sum_squares_parts(const SumSquaresParts& a) {
  Timer t(*this, "sum_squares_parts");
  check_args(a, kTarget);
  std::vector<cuda::SumSquaresPart> table(a.parts.size());
  std::int64_t at = 0;
  for (std::size_t i = 0; i < a.parts.size(); ++i) {
    const std::int64_t count = a.divisors[i] > 0 ? cuda::sum_squares_partials(a.parts[i].numel()) : 0;
    table[i] = {at, at + count, a.divisors[i]};
    at += count;
  }
  // The partials, then the parts' quotients (doubles, 8-byte aligned).
  const std::int64_t quotients_at = (at + 1) / 2 * 2;
  float* partials = scratch_floats(quotients_at + 2 * static_cast<std::int64_t>(table.size()));
  std::vector<cuda::SumSquaresSegment> segs;
  for (std::size_t i = 0; i < a.parts.size(); ++i)
    if (table[i].end > table[i].first)
      segs.push_back({a.parts[i].data, a.parts[i].numel(), table[i].first, a.parts[i].dtype == DType::bf16});
  // One launch for every part (a step's gradient under tensor parallelism has hundreds).
  if (!segs.empty())
    cuda::sum_squares_many(partials, device_table(sum_squares_segments_, segs), static_cast<int>(segs.size()), at,
                           stream_);
  cuda::sum_squares_parts_finish(partials, device_table(sum_squares_table_, table), static_cast<int>(table.size()),
                                 reinterpret_cast<double*>(partials + quotients_at), dptr<float>(a.out), stream_);
}

}  // namespace cuda_impl
}  // namespace kiln::ops
