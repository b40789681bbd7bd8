#pragma once
// The "optim" module: fused AdamW over the flat parameter buffer (decoupled weight decay on
// matrices only), a cosine schedule with linear warm-up, global gradient-norm clipping, and a
// check that stops the run on a non-finite gradient, naming the tensor. Parameters another module
// marks nn::UpdatedBy are left to it: after its own update the optimizer publishes nn::AdamWStep.
#include <boost/describe/enum.hpp>
#include <cstdint>
#include <vector>

#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/module.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/tensor/buffer.hpp"

namespace kiln::optim {

enum class Schedule { cosine, constant };
BOOST_DESCRIBE_ENUM(Schedule, cosine, constant)

// How AdamW's moments are held: f32, or bf16 (read as f32, updated in f32, stored rounded to nearest
// even; ops::moment_load / moment_store), 4 bytes a parameter less, as Megatron-Core's
// precision-aware optimizer (exp_avg_dtype / exp_avg_sq_dtype) and DeepSeek-V3 keep them.
enum class MomentDType { f32, bf16 };
BOOST_DESCRIBE_ENUM(MomentDType, f32, bf16)

// How the parameters' gradients are held (nn::ParamStore::set_grad_dtype): f32, or bf16, 2 bytes a
// parameter less and 2 less read by the norm and the step, as Megatron-Core without
// accumulate_allreduce_grads_in_fp32. Each op computes its contribution in f32 and adds it rounded to
// nearest even (kiln's kernels once; cuBLASLt's accumulating weight gradients as if the product were
// rounded first, docs/ARCHITECTURE.md); the data-parallel all-reduce sums bf16 (FSDP accumulates each
// unit in f32 and reduces in fsdp.reduce_dtype). Refused where layers write f32 gradients only
// (fp8.recipe = "block", a mixture of experts).
enum class GradDType { f32, bf16 };
BOOST_DESCRIBE_ENUM(GradDType, f32, bf16)

struct OptimConfig {
  float lr = 6e-4f;
  float min_lr_ratio = 0.1f;
  std::int64_t warmup_steps = 0;
  Schedule schedule = Schedule::cosine;
  float weight_decay = 0.1f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float grad_clip = 1.0f;
  MomentDType moments = MomentDType::f32;
  GradDType grads = GradDType::f32;
  void validate(config::Checks& c) const {
    c.expect(lr > 0, "lr", "must be positive");
    c.expect(min_lr_ratio >= 0 && min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]");
    c.expect(warmup_steps >= 0, "warmup_steps", "must be >= 0");
    c.expect(weight_decay >= 0, "weight_decay", "must be >= 0");
    c.expect(beta1 >= 0 && beta1 < 1, "beta1", "must be in [0, 1)");
    c.expect(beta2 >= 0 && beta2 < 1, "beta2", "must be in [0, 1)");
    c.expect(eps > 0, "eps", "must be positive");
    c.expect(grad_clip >= 0, "grad_clip", "must be >= 0 (0 disables clipping)");
  }
};
KILN_CONFIG(OptimConfig,
            (lr, "peak learning rate"),
            (min_lr_ratio, "the cosine schedule decays to lr * min_lr_ratio at train.steps"),
            (warmup_steps, "linear warm-up steps from 0 to lr"),
            (schedule, "learning-rate schedule after warm-up: cosine or constant"),
            (weight_decay, "decoupled weight decay on weight matrices and embeddings (not biases or norms)"),
            (beta1, "AdamW first-moment decay"),
            (beta2, "AdamW second-moment decay"),
            (eps, "AdamW epsilon"),
            (grad_clip, "clip the global gradient norm to this; 0 = no clipping"),
            (moments, "AdamW's moments held in f32, or in bf16 (updated in f32, stored rounded: 4 bytes a "
                      "parameter less; checkpoints hold f32 either way)"),
            (grads, "the parameters' gradients held in f32, or in bf16 (each op adds its f32 contribution: 2 "
                    "bytes a parameter less; not with fp8.recipe = block or a mixture of experts yet)"))

// Learning rate at `step` (counted from 1) of `total` steps.
double learning_rate(const OptimConfig& cfg, std::int64_t step, std::int64_t total);

// World resource: AdamW moments, flat buffers with the parameter layout (f32 or bf16: optim.moments).
struct OptimState {
  Buffer m, v;
  DType moment_dtype = DType::f32;
  // Device memory: the step's ops::AdamW::scalars (learning rate, gradient scale, bias corrections),
  // then at byte kNormAt the gradient's global norm (double), made on the device, and at
  // kSumSquaresAt (f32) its square summed over the ranks where they share the gradient.
  Buffer scalars;
  Buffer scalars_host;  // their copy on the host (pinned), queued at the step's end (optim.read)
  static constexpr std::size_t kNormAt = 16;
  static constexpr std::size_t kSumSquaresAt = kNormAt + sizeof(double);
  float grad_scale = 1;  // the last step's gradient scale, read with the norm after the step
  std::int64_t steps_taken = 0;
  std::vector<ops::AdamWSegment> segments;  // made at the first step: decay, and parameters left to other modules
};

void register_module(ModuleRegistry& registry);

}  // namespace kiln::optim
