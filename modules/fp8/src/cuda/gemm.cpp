// Fp8GemmRunner: kiln's row-major FP8 products on cuBLASLt's column-major, TN-only FP8 API (the
// mapping is described in kiln/fp8/cuda/gemm.hpp).
#include "kiln/fp8/cuda/gemm.hpp"

#include <cstdint>
#include <string>

#include "kiln/fp8/cuda/launchers.hpp"
#include "kiln/ops/cuda/cublaslt.hpp"
#include "kiln/tensor/alignment.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::fp8::cuda {

using kiln::cuda::lt_epilogue;
using kiln::cuda::set_attr;
using kiln::cuda::uses_aux;
using ops::Epilogue;

namespace {

std::string describe(const GemmArgs& g) {
  const char* modes[] = {"", " (1x128 blocks)", " (128x128 blocks)"};
  return cat("FP8 GEMM D", g.d.str(), " = X", g.x.str(), modes[static_cast<int>(g.x_mode)], " @ Y", g.y.str(), "^T",
             modes[static_cast<int>(g.y_mode)], g.accumulate ? " (accumulate)" : "",
             ", epilogue ", ops::name_of(g.epilogue), g.bias ? " with bias" : "", g.fast_accum ? ", fast accumulation" : "");
}

cudaDataType_t lt_type(DType t) {
  switch (t) {
    case DType::e4m3: return CUDA_R_8F_E4M3;
    case DType::e5m2: return CUDA_R_8F_E5M2;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f32: return CUDA_R_32F;
    default: KILN_THROW("FP8 GEMM: no cuBLASLt type for ", name_of(t));
  }
}

bool is_fp8(DType t) { return t == DType::e4m3 || t == DType::e5m2; }

std::int32_t lt_scale_mode(ScalingMode m) {
  switch (m) {
    case ScalingMode::block_1x128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case ScalingMode::block_128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    default: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  }
}

// A product's M, N, K.
struct Dims {
  std::int64_t M, N, K;
};
Dims dims_of(const GemmArgs& g) { return {g.x.size(0), g.y.size(0), g.x.size(1)}; }

}  // namespace

struct Fp8GemmRunner::Plan : kiln::cuda::LtMatmulPlan {
  bool verified = false;  // has run successfully once
};

Fp8GemmRunner::Fp8GemmRunner(cublasLtHandle_t handle, void* workspace, std::size_t workspace_bytes)
    : handle_(handle), workspace_(workspace), workspace_bytes_(workspace_bytes), one_(Device::cuda, 256) {
  const float one = 1.0f;
  KILN_CUDA_CHECK(cudaMemcpy(one_.data(), &one, sizeof(one), cudaMemcpyHostToDevice));
}

Fp8GemmRunner::~Fp8GemmRunner() {
  for (auto& [key, op] : ragged_ops_) cublasLtMatmulDescDestroy(op);
}

Fp8GemmRunner::Plan& Fp8GemmRunner::plan(const GemmArgs& g) {
  const auto [M, N, K] = dims_of(g);
  const Key key{M,
                N,
                K,
                static_cast<int>(g.x.dtype),
                static_cast<int>(g.y.dtype),
                static_cast<int>(g.d.dtype),
                g.accumulate,
                static_cast<int>(g.epilogue) | (g.bias ? 1 << 4 : 0) | (g.f32_result ? 1 << 5 : 0),
                g.fast_accum,
                static_cast<int>(g.x_mode) | static_cast<int>(g.y_mode) << 4};
  if (auto it = plans_.find(key); it != plans_.end()) return *it->second;

  auto p = std::make_unique<Plan>();
  // (Block-scaled products try their bias and GELU epilogues fused like the others: where cuBLASLt
  // has no algorithm for one, the plan runs the product and the epilogue kernel.)
  // cuBLASLt's FP8 kernels with the DGELU epilogue run at 190-350 TFLOP/s on an H200 against
  // 1,090-1,480 for the same GEMM without it (bench_fp8, FC2's data gradient of GPT-2 124M and
  // 1.3B): the plain GEMM and a separate dGELU kernel are 2.5-4x faster, so that epilogue is never
  // fused here. (bf16 GEMMs keep it fused: there the fused kernel wins.)
  if (g.epilogue == Epilogue::dgelu) {
    p->fused = false;
    return *plans_.emplace(key, std::move(p)).first->second;
  }
  KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_attr(p->op, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<std::int32_t>(CUBLAS_OP_T));
  set_attr(p->op, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<std::int32_t>(CUBLAS_OP_N));
  set_attr(p->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<std::int8_t>(g.fast_accum ? 1 : 0));
  // Real device pointers for the heuristic; run() sets the operands' own scale_inv.
  set_attr(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(one_.data()));
  set_attr(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(one_.data()));
  if (g.x_mode != ScalingMode::per_tensor) {
    set_attr(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, lt_scale_mode(g.y_mode));
    set_attr(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, lt_scale_mode(g.x_mode));
  }
  set_attr(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, lt_epilogue(g.epilogue, static_cast<bool>(g.bias)));
  // Bias and aux take D's type (bf16) by default, which is what kiln stores; the pointers shown
  // to the heuristic are placeholders with the alignment of the real ones (256 bytes).
  if (g.bias) set_attr(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(workspace_));
  if (uses_aux(g.epilogue)) {
    set_attr(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, workspace_);
    set_attr(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<std::int64_t>(N));
  }
  const auto uM = static_cast<std::uint64_t>(M), uN = static_cast<std::uint64_t>(N), uK = static_cast<std::uint64_t>(K);
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, lt_type(g.y.dtype), uK, uN, K));  // Y [N, K] row-major
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, lt_type(g.x.dtype), uK, uM, K));  // X [M, K] row-major
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->d, lt_type(g.d.dtype), uN, uM, N));  // D [M, N] row-major

  kiln::cuda::LtPreference pref;
  pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(workspace_bytes_));
  if (g.f32_result && g.d.dtype == DType::bf16) kiln::cuda::keep_partials_in_f32(pref);  // a bf16 gradient
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(handle_, p->op, p->a, p->b, p->d, p->d, pref.p, 1, &result, &found);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0 || result.state != CUBLAS_STATUS_SUCCESS) {
    if (g.epilogue != Epilogue::none) {
      p->release();
      p->fused = false;
      return *plans_.emplace(key, std::move(p)).first->second;
    }
    const char* why = st != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusName(st)
                      : found == 0                ? "the heuristic returned no algorithm"
                                                  : cublasLtGetStatusName(result.state);
    KILN_THROW("cuBLASLt has no algorithm for ", describe(g), " (workspace ", workspace_bytes_, " bytes): ", why);
  }
  p->algo = result.algo;
  return *plans_.emplace(key, std::move(p)).first->second;
}

void Fp8GemmRunner::validate(const GemmArgs& g) {
  KILN_CHECK(g.x.device == Device::cuda && g.y.device == Device::cuda && g.d.device == Device::cuda, describe(g),
             ": operands must be CUDA tensors");
  KILN_CHECK(is_fp8(g.x.dtype) && is_fp8(g.y.dtype), describe(g), ": X and Y must be e4m3 or e5m2");
  KILN_CHECK(g.x.dtype == DType::e4m3 || g.y.dtype == DType::e4m3, describe(g), ": E5M2 x E5M2 products are not supported");
  KILN_CHECK(g.x.ndim() == 2 && g.y.ndim() == 2 && g.d.ndim() == 2, describe(g), ": X, Y and D must be 2-D");
  const auto [M, N, K] = dims_of(g);
  KILN_CHECK(g.y.size(1) == K, describe(g), ": X and Y must share K");
  KILN_CHECK(g.d.shape == Shape({M, N}) && g.d.contiguous() && g.x.contiguous() && g.y.contiguous(), describe(g),
             ": D must be [", M, ",", N, "] and every operand contiguous");
  KILN_CHECK(M <= 0x7fffffff && N <= 0x7fffffff && K <= 0x7fffffff, describe(g), ": dimensions beyond 32 bits");
  KILN_CHECK(!g.accumulate || g.f32_result, describe(g), ": accumulating needs a gradient result (f32_result)");
  // A gradient (f32_result) is f32, or bf16 (optim.grads = "bf16": C and D bf16, the product in f32;
  // accumulated, cuBLASLt's kernel rounds as the bf16 GEMM's, docs/PERF.md); an activation bf16.
  KILN_CHECK(g.f32_result ? g.d.dtype == DType::f32 || g.d.dtype == DType::bf16 : g.d.dtype == DType::bf16, describe(g),
             ": D is bf16 (an activation) or f32 or bf16 (f32_result: a gradient, written or accumulated)");
  KILN_CHECK(!g.f32_result || g.epilogue == Epilogue::none, describe(g), ": epilogues write activations, not f32 results");
  KILN_CHECK(N % 16 == 0 && K % 16 == 0, describe(g), ": FP8 GEMMs need N and K to be multiples of 16");
  KILN_CHECK(aligned16(g.x.data) && aligned16(g.y.data) && aligned16(g.d.data), describe(g),
             ": FP8 GEMM operands must be 16-byte aligned");
  KILN_CHECK(g.x_scale_inv && g.y_scale_inv, describe(g), ": missing operand scales");
  // cuBLASLt refuses scale pointers that are not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED).
  KILN_CHECK(aligned16(g.x_scale_inv) && aligned16(g.y_scale_inv), describe(g),
             ": the operand scale pointers must be 16-byte aligned");
  const bool block_x = g.x_mode != ScalingMode::per_tensor, block_y = g.y_mode != ScalingMode::per_tensor;
  KILN_CHECK(block_x == block_y, describe(g), ": both operands block-scaled, or neither");
  KILN_CHECK(!block_x || !g.fast_accum, describe(g), ": a block-scaled product takes no fast accumulation");
  // cuBLASLt (13.0, H100) has no algorithm for 1x128-scaled rows that are not a multiple of 4.
  KILN_CHECK(g.x_mode != ScalingMode::block_1x128 || M % 4 == 0, describe(g),
             ": 1x128 block scaling needs X's rows (M) to be a multiple of 4");
  if (g.bias)
    KILN_CHECK(g.bias.dtype == DType::bf16 && g.bias.numel() == N && g.bias.device == Device::cuda, describe(g), ": bias ",
               g.bias.str());
  if (uses_aux(g.epilogue))
    KILN_CHECK(g.aux.dtype == DType::bf16 && g.aux.numel() == M * N && aligned16(g.aux.data), describe(g), ": aux ",
               g.aux.str());
}

void Fp8GemmRunner::run(const GemmArgs& desc, cudaStream_t stream, void* workspace) {
  GemmArgs g = desc;
  if (g.epilogue == Epilogue::bias && !g.bias) g.epilogue = Epilogue::none;
  if (g.epilogue != Epilogue::bias && g.epilogue != Epilogue::gelu) g.bias = {};
  if (!uses_aux(g.epilogue)) g.aux = {};
  validate(g);
  const auto [M, N, K] = dims_of(g);
  if (M == 0 || N == 0) return;

  if (kiln_block(g)) {  // kiln's kernel adds a bias itself; GELU and dGELU run after it
    if (g.epilogue == Epilogue::none || g.epilogue == Epilogue::bias)
      block_->run(g, stream);
    else
      run_unfused(g, stream, workspace);
    return;
  }
  Plan& p = plan(g);
  if (!p.fused) {
    run_unfused(g, stream, workspace);
    return;
  }
  set_attr(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(g.y_scale_inv));
  set_attr(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(g.x_scale_inv));
  if (g.bias) set_attr(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(g.bias.data));
  if (g.aux) set_attr(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux.data);
  const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
  const cublasStatus_t st = cublasLtMatmul(handle_, p.op, &alpha, g.y.data, p.a, g.x.data, p.b, &beta, g.d.data, p.d,
                                           g.d.data, p.d, &p.algo, workspace ? workspace : workspace_,
                                           workspace_bytes_, stream);
  if (st != CUBLAS_STATUS_SUCCESS) {
    // A fused epilogue the heuristic offered but the matmul refuses (validated on the host, before
    // any launch): from now on this plan runs unfused.
    if (g.epilogue != Epilogue::none && !p.verified) {
      p.release();
      p.fused = false;
      run(desc, stream, workspace);
      return;
    }
    KILN_THROW("cublasLtMatmul failed for ", describe(g), ": ", cublasLtGetStatusName(st));
  }
  p.verified = true;
}

bool Fp8GemmRunner::kiln_block(const GemmArgs& g) {
  if (g.x_mode == ScalingMode::per_tensor || block_kernel_ == BlockGemmKernel::cublaslt) return false;
  if (g.f32_result && g.d.dtype == DType::bf16) return false;  // kiln's kernel writes f32 gradients only
  if (block_kernel_ == BlockGemmKernel::kiln_wgrad && g.y_mode != ScalingMode::block_1x128) return false;
  if (!block_) {
    block_ = std::make_unique<BlockGemm>();
    KILN_CHECK(block_->available(), "fp8.block_gemm: kiln's block-scaled GEMM is a Hopper (sm_90) kernel and this "
                                    "device is not one; use fp8.block_gemm = \"cublaslt\"");
  }
  return block_->takes(g);
}

void Fp8GemmRunner::run_unfused(const GemmArgs& g, cudaStream_t stream, void* workspace) {
  const auto [M, N, K] = dims_of(g);
  GemmArgs plain = g;
  plain.aux = {};
  auto* d = static_cast<__nv_bfloat16*>(g.d.data);
  auto* aux = static_cast<__nv_bfloat16*>(g.aux.data);
  if (g.epilogue == Epilogue::bias) {
    plain.epilogue = Epilogue::none;
    plain.bias = {};
    run(plain, stream, workspace);
    gemm_epilogue(d, nullptr, static_cast<const __nv_bfloat16*>(g.bias.data), M, N, Epilogue::bias, stream);
  } else if (g.epilogue == Epilogue::gelu) {
    plain.epilogue = g.bias ? Epilogue::bias : Epilogue::none;
    plain.d = g.aux;  // the pre-activation, then D = gelu(aux)
    run(plain, stream, workspace);
    gemm_epilogue(d, aux, nullptr, M, N, Epilogue::gelu, stream);
  } else {
    plain.epilogue = Epilogue::none;
    run(plain, stream, workspace);
    gemm_epilogue(d, aux, nullptr, M, N, Epilogue::dgelu, stream);
  }
}

void Fp8GemmRunner::run_grouped(std::span<const GemmArgs> gs, kiln::cuda::LtLanes& lanes) {
  // The algorithms are chosen for this runner's workspace; every lane's must hold it.
  KILN_CHECK(lanes.workspace_bytes() >= workspace_bytes_, "grouped FP8 GEMMs: the lanes' workspaces of ",
             lanes.workspace_bytes(), " bytes are smaller than the runner's ", workspace_bytes_);
  int jobs = 0;
  for (const GemmArgs& g : gs) {
    validate(g);
    KILN_CHECK(g.epilogue == Epilogue::none && !g.bias, describe(g), ": a grouped FP8 GEMM takes no epilogue");
    jobs += g.x.size(0) > 0 && g.y.size(0) > 0 ? 1 : 0;
  }
  const int n = kiln::cuda::LtLanes::lanes_for(jobs);
  lanes.fork(n);
  int lane = 0;
  for (const GemmArgs& g : gs) {
    if (g.x.size(0) == 0 || g.y.size(0) == 0) continue;
    if (g.x_mode != ScalingMode::per_tensor)
      run(g, lanes.stream(lane), lanes.workspace(lane));
    else
      run_ragged(g, lanes.stream(lane), lanes.workspace(lane));
    lane = (lane + 1) % n;
  }
  lanes.join(n);
}

void Fp8GemmRunner::run_ragged(const GemmArgs& g, cudaStream_t stream, void* workspace) {
  const auto [M, N, K] = dims_of(g);
  const auto key = std::make_tuple(static_cast<int>(g.x.dtype), static_cast<int>(g.y.dtype), static_cast<int>(g.d.dtype),
                                   g.fast_accum);
  auto it = ragged_ops_.find(key);
  if (it == ragged_ops_.end()) {
    cublasLtMatmulDesc_t op = nullptr;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    set_attr(op, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<std::int32_t>(CUBLAS_OP_T));
    set_attr(op, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<std::int32_t>(CUBLAS_OP_N));
    set_attr(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<std::int8_t>(g.fast_accum ? 1 : 0));
    it = ragged_ops_.emplace(key, op).first;
  }
  cublasLtMatmulDesc_t op = it->second;
  set_attr(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(g.y_scale_inv));
  set_attr(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(g.x_scale_inv));
  struct Layouts {
    kiln::cuda::LtLayout a, b, c;
  };
  // cuBLASLt's (m, n, k) = kiln's (N, M, K): A = Y [K, N] ld K, B = X [K, M] ld K, D [N, M] ld N.
  auto layouts = [&](int m, int n, int k) {
    return Layouts{kiln::cuda::LtLayout(lt_type(g.y.dtype), k, m, k), kiln::cuda::LtLayout(lt_type(g.x.dtype), k, n, k),
                   kiln::cuda::LtLayout(lt_type(g.d.dtype), m, n, m)};
  };
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const Layouts exact = layouts(m, n, k);
  const std::int64_t kind = (static_cast<std::int64_t>(g.x.dtype) << 24) | (static_cast<std::int64_t>(g.y.dtype) << 16) |
                            (static_cast<std::int64_t>(g.d.dtype) << 8) | (g.fast_accum ? 2 : 0) | (g.accumulate ? 1 : 0);
  const char* why = "";
  kiln::cuda::LtRaggedAlgos::Tuner tuner;
  if (tune_grouped_ && !g.accumulate)
    tuner = [&](std::span<const cublasLtMatmulAlgo_t> algos) {
      return kiln::cuda::lt_fastest_same_bits({handle_, op, g.y.data, g.x.data, exact.a.l, exact.b.l, exact.c.l,
                                               g.d.bytes(), workspace, workspace_bytes_, stream},
                                              algos);
    };
  const cublasLtMatmulAlgo_t* algo =
      ragged_algos_.find(handle_, op, kind, m, n, k, g.f32_result ? kiln::cuda::LtRagged::k : kiln::cuda::LtRagged::n,
                         layouts, exact, workspace_bytes_, &why, tuner);
  KILN_CHECK(algo, "cuBLASLt has no algorithm for ", describe(g), " (workspace ", workspace_bytes_, " bytes): ", why);
  const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
  const cublasStatus_t st = cublasLtMatmul(handle_, op, &alpha, g.y.data, exact.a.l, g.x.data, exact.b.l, &beta,
                                           g.d.data, exact.c.l, g.d.data, exact.c.l, algo, workspace, workspace_bytes_,
                                           stream);
  KILN_CHECK(st == CUBLAS_STATUS_SUCCESS, "cublasLtMatmul failed for ", describe(g), ": ", cublasLtGetStatusName(st));
}

}  // namespace kiln::fp8::cuda
