#pragma once
// The "backend" module: picks the compute backend from `[engine] device` and owns it for the World.
#include <memory>

#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/module.hpp"
#include "kiln/ops/backend.hpp"

namespace kiln::ops {

struct BackendConfig {
  int cpu_threads = 0;
  bool cpu_round_bf16 = false;
  bool profile = false;
  int cuda_device = -1;
  bool gemm_autotune = false;
  bool gemm_autotune_any_order = false;
  AttentionImpl attention = AttentionImpl::auto_;
  bool attention_deterministic = true;
  GroupedGemmImpl grouped_gemm = GroupedGemmImpl::per_expert;
  bool grouped_gemm_tune = true;
  bool cuda_graph = false;
};
KILN_CONFIG(BackendConfig,
            (cpu_threads, "CPU backend threads per rank; 0 = hardware threads / local ranks"),
            (cpu_round_bf16, "CPU backend: round activations to bf16 where the CUDA backend stores bf16"),
            (profile, "time every op with CUDA events (or host clocks) and print a breakdown at the end"),
            (cuda_device, "GPU index; -1 = the rank's local rank"),
            (gemm_autotune,
             "CUDA: time up to 8 cuBLASLt algorithms per GEMM shape at its first use and keep the fastest of those "
             "whose result equals the heuristic's choice byte for byte (the same bits as false, reproducible)"),
            (gemm_autotune_any_order,
             "with gemm_autotune: the fastest of all the candidates, also those that sum in another order (faster; "
             "the bits then differ from an untuned run's and may differ between processes)"),
            (attention,
             "CUDA causal attention: auto (cuDNN's fused flash attention where libcudnn.so.9 loads and takes the "
             "shape, else kiln's kernels), kiln, or cudnn; attention with dropout always runs kiln's kernels"),
            (attention_deterministic,
             "cuDNN attention: bitwise-reproducible backward (false: cuDNN's fastest, dQ accumulated with atomics)"),
            (grouped_gemm,
             "CUDA mixture-of-experts GEMMs: per_expert (one cuBLASLt matmul per expert, over four streams: ~700 "
             "TFLOP/s on an H200 at moe-1b's shapes) or grouped (the data GEMMs as one cublasGemmGroupedBatchedEx call: 310 TFLOP/s there)"),
            (grouped_gemm_tune,
             "CUDA mixture-of-experts GEMMs (bf16 and FP8): time up to 8 cuBLASLt algorithms per bucket of row counts "
             "at its first use and keep the fastest of those whose result equals the heuristic's first bit for bit "
             "(results stay reproducible; false: the heuristic's first)"),
            (cuda_graph,
             "CUDA: capture each micro-batch's forward and backward as a CUDA graph at step 3 and replay it "
             "every later step (the optimizer runs eagerly); where capture cannot run (CPU, profiling, several "
             "ranks, FSDP, mixtures of experts) every step stays eager, said at start"))

// World resource: the backend every module computes with.
struct ActiveBackend {
  std::unique_ptr<Backend> backend;
  Backend& get() const { return *backend; }
};

void register_module(ModuleRegistry& registry);

}  // namespace kiln::ops
