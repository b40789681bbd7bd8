#pragma once
// FP8 GEMMs through cuBLASLt (kiln::fp8::GemmArgs: D[M, N] = deq(X)[M, K] @ deq(Y)[N, K]^T).
//
// Hopper runs FP8 only in the "TN" layout: cuBLASLt's A transposed, B not, i.e. both operands
// with K contiguous. kiln's row-major D[M, N] is cuBLASLt's column-major D^T [N, M], computed as
// op(A) op(B) with A = Y (stored K x N column-major, ld K, op T) and B = X (stored K x M, ld K, op N).
// The operand scales are A_SCALE_POINTER = Y's scale_inv and B_SCALE_POINTER = X's scale_inv; D is
// bf16 (C = D, beta 0) or f32 accumulated (C = D, beta 1). The bias is cuBLASLt's per-row bias of
// D^T (bf16). Epilogues cuBLASLt has no FP8 algorithm for run as a plain GEMM plus an
// elementwise kernel. Fast accumulation only where GemmArgs asks (the forward pass).
//
// Plans (descriptors, layouts, the heuristic's first algorithm) are cached per shape, types and
// epilogue, so a shape always runs the same kernel (deterministic results).
//
// Grouped (run_grouped): independent 2-D products without epilogue whose rows M or depth K change
// from call to call (a mixture of experts' experts), one cublasLtMatmul each, spread over the
// streams of a kiln::cuda::LtLanes; layouts made per call, algorithms from a
// kiln::cuda::LtRaggedAlgos (per shape rounded up to multiples of 128, checked against the exact one).
//
// M (the rows of X and D) may be any count; N and K must be multiples of 16 (Hopper's FP8 kernels
// want 16-byte aligned columns of both operands).
//
// Block-scaled grouped products run as run() plans them (per exact shape: cuBLASLt's block-scaled
// algorithms are chosen for the shape they run), each on its lane with the lane's workspace.
//
// Block-scaled products (GemmArgs::x_mode / y_mode, kiln/fp8/block.hpp) set cuBLASLt's
// A_SCALE_MODE (Y's) and B_SCALE_MODE (X's) to VEC128_32F (1x128) or BLK128x128_32F (128x128), the
// scale pointers to the block scales; no fast accumulation; epilogues fused where cuBLASLt has an
// algorithm for them, else run as a kernel after the product. set_block_kernel() hands them (all, or
// the 1x128 x 1x128 ones) to kiln's own kernel (kiln/fp8/cuda/block_gemm.hpp) instead, its GELU and
// dGELU epilogues then run as kernels after it.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <span>
#include <tuple>

#include "kiln/fp8/cuda/block_gemm.hpp"
#include "kiln/fp8/ops.hpp"
#include "kiln/ops/cuda/cublaslt.hpp"
#include "kiln/ops/cuda/lanes.hpp"

namespace kiln::fp8::cuda {

class Fp8GemmRunner {
 public:
  Fp8GemmRunner(cublasLtHandle_t handle, void* workspace, std::size_t workspace_bytes);
  ~Fp8GemmRunner();
  Fp8GemmRunner(const Fp8GemmRunner&) = delete;
  Fp8GemmRunner& operator=(const Fp8GemmRunner&) = delete;
  // workspace: workspace_bytes of device memory to use in place of the runner's (null: the runner's).
  void run(const GemmArgs& g, cudaStream_t stream, void* workspace = nullptr);
  void run_grouped(std::span<const GemmArgs> gs, kiln::cuda::LtLanes& lanes);
  // Grouped products' algorithms per bucket of rows: the fastest of the candidates with the
  // heuristic's first's bits (kiln::cuda::lt_fastest_same_bits; not for accumulating products).
  void set_tune_grouped(bool on) { tune_grouped_ = on; }
  // Which kernel runs block-scaled products (fp8::BlockGemmKernel; cuBLASLt's by default).
  void set_block_kernel(BlockGemmKernel k) { block_kernel_ = k; }

 private:
  // Throws naming the product unless cuBLASLt can run it (shapes, types, alignment, epilogue).
  static void validate(const GemmArgs& g);
  void run_ragged(const GemmArgs& g, cudaStream_t stream, void* workspace);
  // Whether kiln's kernel runs this block-scaled product.
  bool kiln_block(const GemmArgs& g);
  // The product without its epilogue (run() again), then the epilogue's kernel.
  void run_unfused(const GemmArgs& g, cudaStream_t stream, void* workspace);
  struct Plan;
  // M, N, K, x type, y type, d type, accumulate, epilogue | bias << 4, fast accumulation,
  // x scaling mode | y scaling mode << 4
  using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t, int, int, int, bool, int, bool, int>;
  Plan& plan(const GemmArgs& g);
  cublasLtHandle_t handle_;
  void* workspace_;
  std::size_t workspace_bytes_;
  Buffer one_;  // a device 1.0f: the scale pointers the heuristic is shown
  std::map<Key, std::unique_ptr<Plan>> plans_;
  // Grouped products: a descriptor per (x type, y type, d type, fast accumulation) and the algorithms.
  std::map<std::tuple<int, int, int, bool>, cublasLtMatmulDesc_t> ragged_ops_;
  kiln::cuda::LtRaggedAlgos ragged_algos_;
  bool tune_grouped_ = false;
  BlockGemmKernel block_kernel_ = BlockGemmKernel::cublaslt;
  std::unique_ptr<BlockGemm> block_;  // made at the first product it runs
};

}  // namespace kiln::fp8::cuda
