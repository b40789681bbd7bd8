// GemmRunner: kiln's row-major GEMMs on cuBLASLt's column-major API.
//
// A row-major [R, C] matrix is, byte for byte, a column-major [C, R] one. So the row-major
// D[M, N] = op(A) op(B) is computed as the column-major D^T[N, M] = op(B)^T op(A)^T: cuBLASLt's
// "A" is our B and its "B" is our A, and D's layout is [N rows, M columns], ld = N. In those terms
// a bias "per column of the row-major D" is cuBLASLt's bias per row of D (length N), and the GELU
// aux matrix is [N, M] with ld = N.
//
// Determinism: one plan per key (shape, flags, epilogue, alignment class), holding the heuristic's
// first algorithm, so a shape always runs the same kernel. The alignment class (16 bytes whenever
// every pointer allows it) keeps the choice independent of where the buffers happen to live.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/ops/cuda/cublaslt.hpp"
#include "kiln/ops/cuda/gemm.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {

using ops::Epilogue;

namespace detail {
// The elementwise part of an unfused epilogue (elementwise.cu), after a plain GEMM, on a row-major
// [M, N] bf16 d: bias adds bias per column, gelu writes gelu(aux), dgelu multiplies by gelu'(aux).
void gemm_epilogue_fallback(bf16* d, const bf16* aux, const bf16* bias, std::int64_t M, std::int64_t N,
                            Epilogue epilogue, cudaStream_t s);
}  // namespace detail

namespace {

std::string shape_of(const GemmDesc& g) {
  return cat("GEMM D[", g.M, ",", g.N, "] = ", g.trans_a ? "A^T" : "A", " @ ", g.trans_b ? "B^T" : "B", ", K=", g.K,
             ", D ", g.d_f32 ? "f32" : "bf16", g.accumulate ? " (accumulate)" : "", ", epilogue ",
             ops::name_of(g.epilogue));
}

// The largest power of two (at most 16) dividing the address; 16 for null.
int alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  int align = 16;
  while (align > 1 && (a % static_cast<unsigned>(align)) != 0) align /= 2;
  return align;
}

}  // namespace

struct GemmRunner::Plan : LtMatmulPlan {};

GemmRunner::GemmRunner(cublasLtHandle_t handle, void* workspace, std::size_t workspace_bytes)
    : handle_(handle), workspace_(workspace), workspace_bytes_(workspace_bytes) {}

GemmRunner::~GemmRunner() = default;

GemmRunner::Plan& GemmRunner::plan(const GemmDesc& g, cudaStream_t stream) {
  const int align = std::min({alignment_of(g.A), alignment_of(g.B), alignment_of(g.D), alignment_of(g.bias),
                        alignment_of(g.aux)});
  // Key: the epilogue, whether there is a bias, and the alignment class (16 or less).
  const int code = static_cast<int>(g.epilogue) | (g.bias ? 1 << 4 : 0) | (g.f32_partials ? 1 << 5 : 0) | (align << 8) |
                   (g.sm_count << 16);
  const Key key{g.M, g.N, g.K, g.trans_a, g.trans_b, g.d_f32, g.accumulate, code};
  if (auto it = plans_.find(key); it != plans_.end()) return *it->second;

  auto p = std::make_unique<Plan>();
  // The aux matrix's ld (N in the row-major view) must be a multiple of 8 (cuBLASLt docs of
  // CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD); we also ask for 16-byte-aligned aux and bias pointers.
  if (uses_aux(g.epilogue) && (g.N % 8 != 0 || align < 16)) {
    p->fused = false;
    return *plans_.emplace(key, std::move(p)).first->second;
  }

  const cublasOperation_t op_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our B
  const cublasOperation_t op_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's B is our A
  KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_attr(p->op, CUBLASLT_MATMUL_DESC_TRANSA, op_a);
  set_attr(p->op, CUBLASLT_MATMUL_DESC_TRANSB, op_b);
  const cublasLtEpilogue_t epilogue = lt_epilogue(g.epilogue, g.bias != nullptr);
  set_attr(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (g.sm_count > 0) set_attr(p->op, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, static_cast<std::int32_t>(g.sm_count));
  // The heuristic reads the bias/aux pointers only for their alignment, so it is shown a
  // placeholder of exactly the class alignment: the algorithm then suits every pointer of the class.
  void* placeholder = reinterpret_cast<void*>(static_cast<std::uintptr_t>(align) * 4096 + align);
  if (g.bias) {
    set_attr(p->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, CUDA_R_16BF);
    set_attr(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, placeholder);
  }
  if (uses_aux(g.epilogue)) {
    set_attr(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, placeholder);
    set_attr(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<std::int64_t>(g.N));
  }
  // Stored (pre-op) shapes in column-major terms: our row-major [r, c] is column-major [c, r].
  const std::uint64_t M = g.M, N = g.N, K = g.K;
  if (g.trans_b)  // our B is [N, K] row-major = [K, N] column-major, ld K
    KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, K, N, g.K));
  else  // our B is [K, N] row-major = [N, K] column-major, ld N
    KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, N, K, g.N));
  if (g.trans_a)  // our A is [K, M] row-major = [M, K] column-major, ld M
    KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, M, K, g.M));
  else  // our A is [M, K] row-major = [K, M] column-major, ld K
    KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, K, M, g.K));
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->d, g.d_f32 ? CUDA_R_32F : CUDA_R_16BF, N, M, g.N));

  LtPreference pref;
  pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(workspace_bytes_));
  const auto a32 = static_cast<std::uint32_t>(align);
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a32);
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, a32);
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, a32);
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, a32);
  if (g.f32_partials) keep_partials_in_f32(pref);
  constexpr int kCandidates = 8;
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, p->op, p->a, p->b, p->d, p->d, pref.p,
                                                           autotune_ ? kCandidates : 1, results, &found);
  const cublasLtMatmulHeuristicResult_t& result = results[0];
  if (st != CUBLAS_STATUS_SUCCESS || found == 0 || result.state != CUBLAS_STATUS_SUCCESS) {
    if (g.epilogue != Epilogue::none) {  // run the epilogue unfused instead
      p->release();
      p->fused = false;
      return *plans_.emplace(key, std::move(p)).first->second;
    }
    const char* why = st != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusName(st)
                      : found == 0                ? "the heuristic returned no algorithm"
                                                  : cublasLtGetStatusName(result.state);
    KILN_THROW("cuBLASLt has no algorithm for ", shape_of(g), " (pointer alignment ", align, " bytes, workspace ",
               workspace_bytes_, " bytes): ", why);
  }
  p->algo = result.algo;
  if (autotune_ && found > 1) p->algo = results[fastest(*p, g, results, found, stream)].algo;
  return *plans_.emplace(key, std::move(p)).first->second;
}

int GemmRunner::fastest(Plan& p, const GemmDesc& g, const cublasLtMatmulHeuristicResult_t* results, int n,
                        cudaStream_t stream) {
  // Scratch output (and aux, when the epilogue writes it), so the real tensors are untouched.
  const std::size_t d_bytes = static_cast<std::size_t>(g.M) * g.N * (g.d_f32 ? 4 : 2);
  const bool writes_aux = g.epilogue == Epilogue::gelu;
  const std::size_t aux_bytes = writes_aux ? static_cast<std::size_t>(g.M) * g.N * 2 : 0;
  const std::size_t aux_at = (d_bytes + 255) / 256 * 256, bytes = aux_at + aux_bytes;
  void* scratch = nullptr;
  KILN_CUDA_CHECK(cudaMalloc(&scratch, bytes));
  void* d = scratch;
  void* aux = writes_aux ? static_cast<void*>(static_cast<char*>(scratch) + aux_at) : static_cast<void*>(g.aux);
  if (g.bias) set_attr(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(g.bias));
  if (uses_aux(g.epilogue)) set_attr(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
  cudaEvent_t start = nullptr, stop = nullptr;
  KILN_CUDA_CHECK(cudaEventCreate(&start));
  KILN_CUDA_CHECK(cudaEventCreate(&stop));
  const float alpha = g.alpha, beta = g.accumulate ? 1.0f : 0.0f;
  auto launch = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(handle_, p.op, &alpha, g.B, p.a, g.A, p.b, &beta, d, p.d, d, p.d, &algo, workspace_,
                          workspace_bytes_, stream);
  };
  // Each candidate's result against the heuristic's first's, byte for byte, on the call's own operands
  // (an accumulating call adds to a copy of its real accumulator, so an algorithm that adds its
  // partial sums to it in another order shows): only an algorithm that sums in the same order is a
  // candidate (unless any_order_), so a tuned run has the untuned run's bits (reproducible, resumable).
  std::vector<std::uint8_t> first(bytes), got(bytes);
  int best = 0;
  float best_ms = 0;
  for (int i = 0; i < n; ++i) {
    KILN_CUDA_CHECK(cudaMemsetAsync(scratch, 0, bytes, stream));
    if (g.accumulate) KILN_CUDA_CHECK(cudaMemcpyAsync(d, g.D, d_bytes, cudaMemcpyDeviceToDevice, stream));
    if (results[i].state != CUBLAS_STATUS_SUCCESS || launch(results[i].algo) != CUBLAS_STATUS_SUCCESS) {
      if (i == 0) break;  // nothing to compare with: the heuristic's first stays
      continue;
    }
    KILN_CUDA_CHECK(cudaMemcpyAsync((i == 0 ? first : got).data(), scratch, bytes, cudaMemcpyDeviceToHost, stream));
    KILN_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (i > 0 && !any_order_ && got != first) continue;  // another summation order
    KILN_CUDA_CHECK(cudaEventRecord(start, stream));
    constexpr int kRuns = 3;
    bool ok = true;
    for (int r = 0; r < kRuns && ok; ++r) ok = launch(results[i].algo) == CUBLAS_STATUS_SUCCESS;
    KILN_CUDA_CHECK(cudaEventRecord(stop, stream));
    KILN_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (ok && (i == 0 || ms < best_ms)) {
      best = i;
      best_ms = ms;
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  KILN_CUDA_CHECK(cudaStreamSynchronize(stream));
  KILN_CUDA_CHECK(cudaFree(scratch));
  return best;
}

void GemmRunner::run(const GemmDesc& desc, cudaStream_t stream) {
  GemmDesc g = desc;
  if (g.epilogue == Epilogue::bias && !g.bias) g.epilogue = Epilogue::none;
  if (g.epilogue != Epilogue::gelu && g.epilogue != Epilogue::bias) g.bias = nullptr;
  if (!uses_aux(g.epilogue)) g.aux = nullptr;
  KILN_CHECK(g.M >= 0 && g.N >= 0 && g.K >= 0, "negative size in ", shape_of(g));
  if (g.M == 0 || g.N == 0) return;
  KILN_CHECK(g.K > 0, shape_of(g), ": K must be positive");
  KILN_CHECK(g.A && g.B && g.D, shape_of(g), ": null operand");
  KILN_CHECK(g.epilogue == Epilogue::none || (!g.d_f32 && !g.accumulate), shape_of(g),
             ": epilogues need a bf16 D that is written, not accumulated");
  KILN_CHECK(!uses_aux(g.epilogue) || g.aux, shape_of(g), ": the epilogue needs an aux matrix");
  KILN_CHECK(alignment_of(g.A) >= 2 && alignment_of(g.B) >= 2 && alignment_of(g.D) >= (g.d_f32 ? 4 : 2),
             shape_of(g), ": misaligned operand");

  Plan& p = plan(g, stream);
  if (!p.fused) {
    // Unfused: a plain GEMM (with the bias fused where possible), then an elementwise kernel.
    GemmDesc plain = g;
    plain.aux = nullptr;
    if (g.epilogue == Epilogue::bias) {
      plain.epilogue = Epilogue::none;
      plain.bias = nullptr;
      run(plain, stream);
      detail::gemm_epilogue_fallback(static_cast<bf16*>(g.D), nullptr, g.bias, g.M, g.N, Epilogue::bias, stream);
    } else if (g.epilogue == Epilogue::gelu) {
      plain.epilogue = g.bias ? Epilogue::bias : Epilogue::none;
      plain.D = g.aux;  // the pre-activation, then D = gelu(aux)
      run(plain, stream);
      detail::gemm_epilogue_fallback(static_cast<bf16*>(g.D), g.aux, nullptr, g.M, g.N, Epilogue::gelu, stream);
    } else {  // dgelu
      plain.epilogue = Epilogue::none;
      run(plain, stream);
      detail::gemm_epilogue_fallback(static_cast<bf16*>(g.D), g.aux, nullptr, g.M, g.N, Epilogue::dgelu, stream);
    }
    return;
  }

  if (g.bias) set_attr(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(g.bias));
  if (g.aux) set_attr(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<void*>(g.aux));
  const float alpha = g.alpha, beta = g.accumulate ? 1.0f : 0.0f;
  KILN_CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &alpha, g.B, p.a, g.A, p.b, &beta, g.D, p.d, g.D, p.d, &p.algo,
                                   workspace_, workspace_bytes_, stream));
}

}  // namespace kiln::cuda
