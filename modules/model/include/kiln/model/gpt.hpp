#pragma once
// The decoder-only transformer, a thin stack of typed parts: embedding -> blocks -> final norm ->
// LM head -> loss (spec.hpp says which parts model.arch makes: GPT-2's or Llama's). It owns the
// stack's order, the layer events (LayerForwardBegin/End, LayerBackwardBegin/End for every unit),
// the token upload, the loss slots and the activation table its parts declare their tensors in;
// everything else is a part's. Every tensor op goes through the backend and every split over ranks
// through kiln::tensor_parallel's layers (the model calls no collective).
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kiln/model/config.hpp"
#include "kiln/model/parts/activation_table.hpp"
#include "kiln/model/parts/block.hpp"
#include "kiln/model/parts/context.hpp"
#include "kiln/model/parts/embedding.hpp"
#include "kiln/model/parts/output_head.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/parallel/data_parallel.hpp"
#include "kiln/rng/tracker.hpp"
#include "kiln/train/train.hpp"

namespace kiln::model {

class GptModel {
 public:
  // Creates the ParamStore resource and the parameter, layer and linear entities in `world`, for
  // micro-batches of B sequences of T tokens, with room for `micro_batches` loss slots.
  GptModel(World& world, const ModelConfig& cfg, int B, int T, int micro_batches);
  GptModel(const GptModel&) = delete;
  GptModel& operator=(const GptModel&) = delete;

  // Allocates the activation memory, after every module has been installed: their components on
  // the model's entities decide what the parts keep (recompute plans, implementations that compute
  // their inputs on load or keep their own copies).
  void allocate_activations();
  // Memory unused while the blocks run, forward, backward or recomputed (the logits buffer, less
  // the blocks' backward scratch placed in it): nn::BlockScratch.
  nn::BlockScratch block_scratch() const { return lent_; }
  std::size_t activation_bytes() const { return table_.bytes(); }
  const ActivationTable& activation_table() const { return table_; }
  // Block 0's input: the residual stream each block keeps (its norm's backward reads it).
  const TensorView& residual_stream() const { return residuals_.front(); }

  // One micro-batch forward; the per-token losses go to loss slot `slot`. With `training`, draws
  // dropout masks from the tracker and prepares the backward. Dropout masks are functions of the
  // step and of the token's place in the step's global batch (train::Batch::global_index): every
  // micro-batch draws from the states the step's first one started from, each element at its
  // global index, so any split of the batch over data-parallel ranks and micro-batches draws what
  // one rank with the whole batch would.
  void forward(const train::Batch& batch, int slot, bool training, rng::RngStatesTracker* tracker);
  // The same in two parts: load() checks the batch's tokens, uploads inputs and targets and sets the
  // tracker to the states the step's first micro-batch started from; forward_loaded() is the device
  // work of the forward alone (what a captured CUDA graph of it replays, StepGraph).
  void load(const train::Batch& batch, int slot, bool training, rng::RngStatesTracker* tracker);
  void forward_loaded(int slot, bool training, rng::RngStatesTracker* tracker);
  // Backward of the last training forward; accumulates into the gradient buffer.
  void backward(const train::Batch& batch);

  // Fills the master weights this rank holds from the tracker's default state (layout-invariant
  // draws, by global element index) and refreshes the compute copy.
  void initialise(rng::RngStatesTracker& tracker);
  // Mean loss over the first `slots` loss slots, and over the data-parallel replicas (synchronises):
  // over the step's trained targets (train::Batch::step_targets) when the data has loss masks.
  double mean_loss(int slots);
  // Mean validation loss over the batches (forward only, no dropout; uses slot 0), over their
  // targets that are not -1 (loss masks).
  double evaluate(const std::vector<train::Batch>& batches);
  // The whole model's parameters (every rank's parts together).
  std::int64_t parameter_count() const;
  // The parameters a token meets: all but a mixture of experts' unchosen experts.
  std::int64_t active_parameter_count() const;
  // Model FLOPs per trained token (docs/PERF.md gives the formula): the parts' sum (a mixture of
  // experts counts the experts a token meets: the active FLOPs).
  double flops_per_token() const;
  // The step's numbers the parts report (a mixture of experts' losses and loads), summed over the
  // data-parallel ranks (collective), by name; each part then updates what depends on them (a
  // router's balancing bias) and starts afresh.
  std::vector<std::pair<std::string, double>> step_metrics();
  // The parts' state that is neither parameter nor activation (routers' balancing biases), for
  // checkpoints: the same on every rank; empty where no part has any.
  std::vector<float> part_state() const;
  void set_part_state(std::span<const float> values);
  // The dloss every token's loss gets: 1 / tokens in the global batch (a training batch with
  // step_targets, loss masks, sets 1 / step_targets for its step instead).
  void set_loss_scale(float s) { dloss_ = s; }

 private:

  ModelContext ctx_;
  // This rank's losses of the first `slots` slots, summed on the host (synchronises).
  double loss_sum(int slots);

  parallel::DataParallel dp_;
  int slots_;
  std::int64_t step_targets_ = 0;  // of the last training batch loaded; 0: every target
  Embedding embedding_;
  std::vector<std::unique_ptr<TransformerBlock>> blocks_;
  OutputHead head_;
  ActivationTable table_;
  std::vector<TensorView> residuals_;     // L + 1 residual streams [Nl, C]: residuals_[l] is block l's input
  TensorView tokens_, targets_, losses_;  // [N] i32 on the device, twice; [slots, N] f32
  TensorView doc_start_;                  // [B, T] i32: the current batch's document starts, if it has them
  TensorView part_stats_;                 // every part's device numbers of the step (Mixer::device_stats)
  nn::BlockScratch lent_;
  rng::RngSnapshot step_rng_;  // the tracker's states at the step's first micro-batch
  float dloss_ = 1.0f;
  bool allocated_ = false, have_forward_ = false;
};

}  // namespace kiln::model
