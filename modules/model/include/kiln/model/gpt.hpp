#pragma once
// The decoder-only transformer, a thin stack of typed parts: embedding -> blocks -> final norm ->
// LM head -> loss (spec.hpp says which parts model.arch makes: GPT-2's or Llama's). It owns the
// stack's order, the layer events (LayerForwardBegin/End, LayerBackwardBegin/End for every unit),
// the token upload, the loss slots and the activation table its parts declare their tensors in;
// everything else is a part's. Every tensor op goes through the backend and every split over ranks
// through kiln::parallel's groups and tensor-parallel layers (the model calls no collective).
//
// Split into pipeline stages (PipelinePlan), a rank holds only its chunks of blocks, the embedding
// on the first stage and the head on the last, and runs one chunk per pass (forward_pass,
// backward_pass) in its schedule's order, trading the residual stream with the neighbouring stages
// around the passes. Its activations then exist once per micro-batch in flight. Whatever the split,
// every parameter starts from the draws one rank would give it and every block draws the dropout
// masks one rank would (each stage knows every other stage's number of draws).
#include <cstdint>
#include <memory>
#include <optional>
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
#include "kiln/model/pipeline_plan.hpp"
#include "kiln/model/stage_passes.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/parallel/data_parallel.hpp"
#include "kiln/parallel/pipeline_parallel.hpp"
#include "kiln/rng/tracker.hpp"
#include "kiln/train/train.hpp"

namespace kiln::model {

class GptModel {
 public:
  // Creates the ParamStore resource and the parameter, layer and linear entities in `world`, for
  // micro-batches of B sequences of T tokens, with room for `micro_batches` loss slots.
  GptModel(World& world, const ModelConfig& cfg, int B, int T, int micro_batches);
  // This rank's stage of a model split by `plan`.
  GptModel(World& world, const ModelConfig& cfg, int B, int T, int micro_batches, PipelinePlan plan);
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
  // The first block's input here: the residual stream each block keeps (its norm's backward reads it).
  const TensorView& residual_stream() const { return residuals_.at(static_cast<std::size_t>(plan_.begin(0))); }
  const PipelinePlan& pipeline() const { return plan_; }

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
  // (A pipeline stage keeps the inputs of every micro-batch of the step: `slot` is the micro-batch.)
  void load(const train::Batch& batch, int slot, bool training, rng::RngStatesTracker* tracker);
  void forward_loaded(int slot, bool training, rng::RngStatesTracker* tracker);
  // Backward of the last training forward; accumulates into the gradient buffer.
  void backward(const train::Batch& batch);
  // One pass of a step: micro-batch m's training forward or backward on chunk `chunk`, after the
  // transfers the pipeline schedule puts before it (and after the step's last pass, those after it).
  // Without pipeline stages, the whole model's forward_loaded(m) or backward.
  void forward_pass(int m, int chunk, rng::RngStatesTracker* tracker);
  void backward_pass(int m, int chunk);

  // Fills the master weights this rank holds from the tracker's default state (layout-invariant
  // draws, by global element index, and each parameter where one rank's draws would put it) and
  // refreshes the compute copy; learns where each block's dropout draws start (collective over the
  // pipeline stages).
  void initialise(rng::RngStatesTracker& tracker);
  // Mean loss over the first `slots` loss slots, and over the data-parallel replicas (synchronises):
  // over the step's trained targets (train::Batch::step_targets) when the data has loss masks.
  double mean_loss(int slots);
  // Queues the copy of the first `slots` loss slots to the host behind the step's device work
  // (Backend::copy_to_host_async): the next mean_loss of as many slots sums that copy after one
  // synchronisation, with no copy of its own.
  void queue_loss_read(int slots);
  // A training forward's losses are written by its backward (the LM head in chunks of rows,
  // model.head_chunk_rows > 0: ChunkedLossHead); an evaluation's by the forward, as always.
  bool losses_after_backward() const { return ctx_.cfg.head_chunk_rows > 0; }
  // Mean validation loss over the batches (forward only, no dropout; uses slot 0), over their
  // targets that are not -1 (loss masks).
  double evaluate(const std::vector<train::Batch>& batches);
  // The whole model's parameters (every rank's parts together; collective over the pipeline stages).
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
  // (With pipeline stages the whole model's, every stage's blocks in block order: part_state is
  // collective over the stages.)
  std::vector<float> part_state() const;
  std::size_t part_state_size() const;
  void set_part_state(std::span<const float> values);
  // The dloss every token's loss gets: 1 / tokens in the global batch (a training batch with
  // step_targets, loss masks, sets 1 / step_targets for its step instead).
  void set_loss_scale(float s) { dloss_ = s; }

 private:

  // A micro-batch's inputs, kept from its load to its last pass.
  struct Inputs {
    std::vector<std::int32_t> tokens;  // on the host (the embedding's backward reads them there)
    std::int64_t seq_offset = 0;
    bool documents = false;
  };

  ModelContext ctx_;
  // This rank's losses of the first `slots` slots, summed on the host (synchronises); with
  // `use_queued`, from queue_loss_read's copy where it holds as many slots.
  double loss_sum(int slots, bool use_queued = false);
  // Which of the kept inputs micro-batch m uses (all of them on a pipeline stage, else one).
  int inputs_index(int m) const { return plan_.pipelined() ? m : 0; }
  // Points the context and the activation table at micro-batch m.
  void use(int m);
  void forward_chunk(int chunk, int m, bool training, rng::RngStatesTracker* tracker);
  void backward_chunk(int chunk, int m);
  double pass_clock();
  void record_pass(bool forward, int m, int chunk, double start);
  // Where a message of the stage's transfers lives (StagePasses): an activation in its micro-batch's
  // copy of the chunk's first or last residual stream, a gradient in grad_in_ / grad_out_.
  TensorView transfer_buffer(const parallel::PipelineMessage& msg, bool send);
  // A forward-only pass of the whole model over the stages (validation), into loss slot 0.
  void forward_stages(const train::Batch& batch);
  // The tracker's states where block l's draws start, and where a whole forward leaves them.
  rng::RngSnapshot states_before_block(int l) const;
  void learn_dropout_draws(rng::RngStatesTracker& tracker);
  std::int64_t sum_over_stages(std::int64_t local) const;
  // The step's numbers of every stage, a name several report summed (collective over the stages).
  std::vector<std::pair<std::string, double>> merge_over_stages(
      const std::vector<std::pair<std::string, double>>& mine) const;
  void learn_part_state_layout();

  PipelinePlan plan_;
  std::optional<parallel::PipelineParallel> pipe_;  // with pipeline stages
  std::optional<StagePasses> stage_;               // with pipeline stages: the schedule's passes and transfers
  parallel::DataParallel dp_;
  int slots_;
  std::int64_t step_targets_ = 0;  // of the last training batch loaded; 0: every target
  std::unique_ptr<Embedding> embedding_;                   // on the first stage
  std::vector<std::unique_ptr<TransformerBlock>> blocks_;  // by block index: this rank's, else null
  std::unique_ptr<OutputHead> head_;                       // on the last stage
  std::optional<Entity> tied_;  // the embedding table, where a stage holds it for the other (TiedAcrossStages)
  ActivationTable table_;
  std::vector<TensorView> residuals_;     // L + 1 residual streams [Nl, C]: residuals_[l] is block l's input
  TensorView tokens_all_, targets_all_;   // [inputs, N] i32 on the device
  TensorView doc_all_;                    // [inputs, B, T] i32: the batches' document starts, if they have them
  TensorView losses_;                     // [slots, N] f32
  Buffer losses_host_;                    // queue_loss_read's copy (pinned), of queued_loss_slots_ slots
  int queued_loss_slots_ = 0;
  TensorView part_stats_;                 // every part's device numbers of the step (Mixer::device_stats)
  TensorView grad_in_, grad_out_;         // [Nl, C]: the residual gradient received from / sent to a stage
  TensorView lent_host_;                  // without the head: the blocks' borrowed scratch
  std::vector<Inputs> inputs_;
  nn::BlockScratch lent_;
  rng::RngSnapshot step_rng_;  // the tracker's states at the step's first micro-batch
  // Each block's draws from each of the tracker's states in a training forward (default first).
  std::vector<std::vector<std::uint64_t>> block_draws_;
  // Each block's part state: its size, the pipeline rank holding it; each stage's total.
  std::vector<std::size_t> block_state_sizes_, block_state_sizes_by_stage_;
  std::vector<int> block_state_owner_;
  float dloss_ = 1.0f;
  int head_forward_ = -1;  // the micro-batch whose dlogits the head holds
  bool allocated_ = false, have_forward_ = false;
};

}  // namespace kiln::model
