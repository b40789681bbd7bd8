#pragma once
// The "train" module: the step loop's shape (steps, global batch, micro-batches, sequence length,
// master seed), the state every other module reports into, and the batch the data module fills.
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/module.hpp"

namespace kiln::train {

struct TrainConfig {
  std::int64_t steps = 100;
  std::uint64_t seed = 1337;
  std::int64_t batch_size = 8;
  std::int64_t micro_batch_size = 0;
  std::int64_t seq_len = 1024;
  std::int64_t exit_interval = 0;
  void validate(config::Checks& c) const {
    c.expect(steps >= 0, "steps", "must be >= 0");
    c.expect(batch_size > 0, "batch_size", "must be positive");
    c.expect(micro_batch_size >= 0, "micro_batch_size", "must be >= 0 (0: the whole per-rank batch at once)");
    c.expect(micro_batch_size == 0 || batch_size % micro_batch_size == 0, "micro_batch_size",
             "must divide train.batch_size");
    c.expect(seq_len > 0, "seq_len", "must be positive");
    c.expect(exit_interval >= 0, "exit_interval", "must be >= 0 (0: run to train.steps)");
  }
};
KILN_CONFIG(TrainConfig,
            (steps, "optimizer steps to run"),
            (seed, "master seed: weights, dropout and data order derive from it"),
            (batch_size, "global batch in sequences, whatever the number of ranks"),
            (micro_batch_size, "sequences per forward/backward on one rank; 0 = batch_size / dp"),
            (seq_len, "tokens per sequence"),
            (exit_interval,
             "stop this run after a step that is a multiple of this (as Megatron's --exit-interval), after the "
             "checkpoint module saved it; a later run resumes there; 0: run to train.steps"))

// The micro-batch in flight on this rank: B sequences of T tokens and their targets (host memory;
// the model uploads them). Filled in the data phase.
struct Batch {
  int B = 0, T = 0;
  std::vector<std::int32_t> inputs;   // [B * T]
  std::vector<std::int32_t> targets;  // [B * T]
  std::int64_t global_index = 0;      // index of the first sequence in the global batch of the step
  // Targets the loss is taken on in the step's whole global batch (every micro-batch of every
  // data-parallel rank): the loss is their mean. Targets of -1 are not among them (loss masks);
  // 0: all of them, batch_size x seq_len.
  std::int64_t step_targets = 0;
  // [B * T] or empty: where each input token's document starts in its sequence (packed documents,
  // data.attend_within_documents): attention stays within each document.
  std::vector<std::int32_t> doc_start;
};

// A fixed set of validation micro-batches, prepared once by the data module.
struct ValidationSet {
  std::vector<Batch> batches;
};

// Asks for a validation loss now (the model answers by filling TrainState::val_loss).
struct EvaluationRequested {
  std::int64_t step = 0;
};

// Asks for text generated from the current weights (the model answers by filling TrainState::sample).
struct SampleRequested {
  std::int64_t step = 0;
  std::string prompt;
  int tokens = 0;
};

// What the step reports: written by the modules that know (model: loss, flops; optimizer: lr,
// grad norm; train: timing), read by the log module.
struct TrainState {
  std::int64_t step = 0;
  std::int64_t tokens_seen = 0;
  std::int64_t tokens_per_step = 0;
  int micro_batches = 1;
  int micro_batch_size = 0;
  // The data carries loss masks: the step's number of trained targets (Batch::step_targets) varies.
  bool loss_mask = false;
  // The batches carry document starts (Batch::doc_start): attention stays within documents.
  bool documents = false;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  std::optional<double> val_loss;
  std::optional<std::string> sample;  // generated text, when a sample was requested
  double step_ms = 0;
  double tokens_per_s = 0;
  double flops_per_token = 0;  // model FLOPs per trained token (see docs/PERF.md)
  double peak_flops = 0;       // of this rank's device, 0 if unknown
  double mfu = 0;              // flops_per_token * tokens_per_s / (peak_flops * ranks)
  int ranks = 1;
  std::size_t peak_device_memory = 0;  // bytes this rank's device has taken, highest seen at a step end
  // Further numbers of the step a module reports (the mixture of experts' losses and loads), by
  // name, in the order given; the log module writes them to the metrics file. Rewritten each step.
  std::vector<std::pair<std::string, double>> metrics;
  std::chrono::steady_clock::time_point step_start;
  // Wall-clock seconds from this run's first step's start to this step's end: the time a loss took
  // to reach, validations and checkpoint saves between included (a resumed run counts from 0 again).
  double elapsed_s = 0;
  std::optional<std::chrono::steady_clock::time_point> run_start;
};

// One pass of a step as it ran on this rank (log.timeline): its compute, from when its inputs had
// arrived to its end, the device synchronised at both ends; steady-clock seconds (one clock for all
// the ranks of a host).
struct PassTime {
  bool forward = true;
  int micro_batch = 0, chunk = 0;
  double start_s = 0, end_s = 0;
};

// World resource (the log module's, with log.timeline): whether this step's passes are timed, and
// those timed so far. The model records its passes here.
struct PassTimeline {
  bool record = false;
  std::vector<PassTime> passes;
};

void register_module(ModuleRegistry& registry);

}  // namespace kiln::train
