#pragma once
// What every architecture's model shares (GptModel, LlamaModel): its parameters as entities over
// the flat ParamStore, its linears, layers and their components, the layout-invariant
// initialisation, the token upload and the step's dropout states, the loss slots, evaluation. An
// architecture adds its blocks' forward and backward passes and its activation memory; everything
// it splits over ranks goes through kiln::tensor_parallel's layers.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kiln/engine/world.hpp"
#include "kiln/model/arena.hpp"
#include "kiln/model/config.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/ops/linear_impl.hpp"
#include "kiln/parallel/data_parallel.hpp"
#include "kiln/parallel/tensor_parallel.hpp"
#include "kiln/rng/tracker.hpp"
#include "kiln/train/train.hpp"

namespace kiln::model {

// A parameter the architecture does not have (Llama's biases); tensor() gives an empty view.
inline constexpr Entity kNoParam{~0u};

class ModelBase {
 public:
  // Creates the ParamStore resource in `world`; the architecture's constructor adds its parameters.
  ModelBase(World& world, const ModelConfig& cfg, int B, int T, int micro_batches);
  virtual ~ModelBase() = default;
  ModelBase(const ModelBase&) = delete;
  ModelBase& operator=(const ModelBase&) = delete;

  // Allocates the activation memory, after every module has been installed (their components on
  // the model's entities decide what is kept: recompute, FP8 layers keeping their inputs).
  virtual void allocate_activations() = 0;
  // Memory the model does not use while the blocks run (see nn::BlockScratch).
  virtual nn::BlockScratch block_scratch() const = 0;
  // One micro-batch forward; the per-token losses go to loss slot `slot`. With `training`, draws
  // dropout masks from the tracker and prepares the backward. Dropout masks are functions of the
  // step and of the token's place in the step's global batch (train::Batch::global_index), so any
  // split of the batch over data-parallel ranks and micro-batches draws what one rank would.
  virtual void forward(const train::Batch& batch, int slot, bool training, rng::RngStatesTracker* tracker) = 0;
  // Backward of the last training forward; accumulates into the gradient buffer.
  virtual void backward(const train::Batch& batch) = 0;
  // Model FLOPs per trained token (docs/PERF.md gives the formula).
  virtual double flops_per_token() const = 0;

  // Fills the master weights this rank holds from the tracker's default state (layout-invariant
  // draws, by global element index) and refreshes the compute copy.
  void initialise(rng::RngStatesTracker& tracker);
  // Mean loss over the first `slots` loss slots, and over the data-parallel replicas (synchronises).
  double mean_loss(int slots);
  // Mean validation loss over the batches (forward only, no dropout; uses slot 0).
  double evaluate(const std::vector<train::Batch>& batches);
  std::int64_t parameter_count() const;
  // Bytes of activation memory (the arena: saved activations, scratch and backward buffers).
  virtual std::size_t activation_bytes() const { return arena_.bytes(); }
  // The dloss every token's loss gets: 1 / tokens in the global batch.
  void set_loss_scale(float s) { dloss_ = s; }

 protected:
  Entity make_layer(int unit, nn::LayerKind kind, int block, const std::string& name);
  Entity add_param(const std::string& name, Shape global_shape, const TensorShard& shard, int unit, bool decay,
                   float std, float value, std::vector<Entity>& layer_params);
  // A norm's weight (or bias): replicated, but under sequence parallelism its gradient is this
  // rank's rows' part (nn::Param::tp_partial_grad).
  Entity add_norm_param(const std::string& name, int unit, float value, std::vector<Entity>& layer_params);
  Entity add_linear(const std::string& name, nn::LinearRole role, int unit, Entity w, std::optional<Entity> b,
                    std::int64_t in, std::int64_t out);
  // The linear's implementation: the backend's linear ops, or the ops::LinearImpl a module attached.
  const ops::LinearImpl& impl(Entity linear) const;
  // The backward arguments as given, with dweight_overwrite set on a step's first micro-batch for
  // the weights nothing else adds to (nn::GradWrittenFirst; the step's zeroing skipped them).
  ops::LinearBackward backward_args(Entity linear, ops::LinearBackward a) const;
  // Whether every given linear's implementation keeps its own copy of its input
  // (LinearImpl::keeps_input), so the model need not store it.
  bool inputs_kept(const std::vector<Entity>& linears) const;
  TensorView tensor(Entity e, bool grad) const;  // empty for kNoParam
  // Dropout on this rank's rows of the step's [batch tokens, C] hidden states.
  ops::DropoutArgs hidden_dropout(float p, const rng::PhiloxArgs& r) const;
  // Checks the batch's tokens against the vocabulary, uploads inputs and targets, and sets the
  // tracker to the states the step's first micro-batch started from (dropout `p` > 0). Returns p.
  float begin_forward(const train::Batch& batch, int slot, bool training, rng::RngStatesTracker* tracker);
  // Requests the token, target and loss-slot buffers from the arena.
  void request_io();

  World& world_;
  ModelConfig cfg_;
  ops::Backend& be_;
  parallel::TensorParallel tp_;
  parallel::DataParallel dp_;
  int B_, T_, slots_;
  std::int64_t N_;                // tokens of a micro-batch
  std::int64_t batch_sequences_;  // sequences of the step's global batch (all ranks, all micro-batches)
  std::int64_t seq_offset_ = 0;   // the global index of the current micro-batch's first sequence
  rng::RngSnapshot step_rng_;     // the tracker's states at the step's first micro-batch
  std::int64_t Nl_;               // this rank's tokens outside the TP regions (N without sequence parallelism)
  ops::LinearImpl backend_linear_;  // the backend's linear ops, for linears without a module's impl
  float dloss_ = 1.0f;
  std::vector<Entity> layers_;  // unit -> layer entity
  Arena arena_;
  TensorView tokens_, targets_, losses_;
  bool allocated_ = false;
  bool have_forward_ = false;
};

}  // namespace kiln::model
