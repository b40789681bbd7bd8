#pragma once
// kiln's own block-scaled FP8 GEMM for Hopper (sm_90a), beside cuBLASLt's: D[M, N] = X[M, K] Y[N, K]^T
// with X's codes scaled per 1x128 block and Y's per 1x128 block (a weight gradient) or per 128x128
// block (a weight, in the forward and data-gradient products), the scales in kiln's BlockLayout
// (kiln/fp8/block.hpp). D is bf16 (with an optional bias), f32, or f32 accumulated (D += product; a
// subnormal sum is flushed to zero, as the device's f32 reductions do).
//
// Each 128-deep block of K is summed by the tensor cores apart, then scaled and added to an f32
// accumulator (the promotion block_gemm_reference describes, as DeepSeek-V3's kernels do it). Its
// bits differ from cuBLASLt's (another order of the same sums); a shape always runs the same kernel.
// Why it exists: cuBLASLt 13.0's block-scaled products run at 0.73-0.97x its per-tensor ones on an
// H200, the weight gradient's 1x128 x 1x128 at ~1,050 TFLOP/s (docs/PERF.md, issue 29). So far this
// kernel is slower still (0.76-0.96x cuBLASLt's block-scaled rate; its loads and products alone beat
// it, the promotions cost the rest: docs/PERF.md, "kiln's own block-scaled GEMM"), which is why
// fp8.block_gemm defaults to cuBLASLt's.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "kiln/fp8/ops.hpp"

namespace kiln::fp8::cuda {

class BlockGemm {
 public:
  BlockGemm();  // on the current device
  ~BlockGemm();
  BlockGemm(const BlockGemm&) = delete;
  BlockGemm& operator=(const BlockGemm&) = delete;
  // Whether run() takes the product: a Hopper device, X 1x128-scaled, Y 1x128 or 128x128. run() adds
  // a bias to a bf16 D and runs no other epilogue (Fp8GemmRunner runs GELU and dGELU after it). The
  // operands are as Fp8GemmRunner validates them (K-major, N and K multiples of 16, 16-byte aligned).
  bool takes(const GemmArgs& g) const;
  bool available() const;  // the device is a Hopper GPU (sm_90)
  void run(const GemmArgs& g, cudaStream_t stream);
  // For benchmarks that take the kernel apart (bench_fp8 block-probe): 1 skips the epilogue's stores,
  // 2 the promotions (the results are then wrong).
  void set_probe(int probe) { probe_ = probe; }
  // The tile a CTA computes at a time, rows x columns of D: 256 x 128 (two math warp groups of two
  // wgmma m64 row blocks each, summed one after the other) or 192 x 128 (three groups of one: more
  // products in flight an SM, smaller last rounds for some shapes). automatic (the default) picks one
  // a shape (automatic_tile); the others are for benchmarks.
  enum class Tile { automatic, m256n128, m192n128 };
  void set_tile(Tile t) { tile_ = t; }
  static Tile automatic_tile(std::int64_t M, std::int64_t N, int sms);  // automatic's tile for a [M, N] D

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int probe_ = 0;
  Tile tile_ = Tile::automatic;
};

}  // namespace kiln::fp8::cuda
