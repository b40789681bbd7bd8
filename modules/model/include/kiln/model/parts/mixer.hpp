#pragma once
// What sits between a sublayer's norm and its residual add: attention, or an MLP. It starts with a
// column-parallel linear reading the norm's output and ends with a row-parallel linear whose output
// is summed over the tensor-parallel group (Megatron's layout), so it runs in two stages: `in` (up to
// the hidden activations) and `out` (the last linear); a recompute may run `in` alone.
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kiln/model/parts/activation_table.hpp"
#include "kiln/model/parts/norm.hpp"
#include "kiln/rng/tracker.hpp"

namespace kiln::model {

class Mixer {
 public:
  virtual ~Mixer() = default;
  // The linear reading the norm's output (the norm's consumer).
  virtual Entity input_linear() const = 0;
  // Declares its saved activations (written in `stage`, the sublayer's `in`), scratch and backward
  // scratch, once modules have attached their components. `key` names its rows.
  virtual void declare(ActivationTable::Rows& rows, const std::string& key, StageSet stage) = 0;
  // Draws the dropout masks of its own (attention probabilities) for a forward with dropout p: from
  // the tracker where p > 0, none where p = 0 (the tracker may then be null).
  virtual void draw(rng::RngStatesTracker* tracker, float p) { (void)tracker, (void)p; }
  // Stage `in`: from the normalised input to the hidden activations, with dropout p.
  virtual void forward_in(const NormOutput& x, float p) = 0;
  // Stage `out`: the last linear, summed over the TP group into this rank's rows `out_local` [Nl, C].
  virtual void forward_out(const TensorView& out_local) = 0;
  // From this rank's rows of the output's gradient `dout_local` [Nl, C] to the gradient of the input
  // (`x`: the norm's output as the forward read it), summed over TP into `dx_local` (or in place);
  // returns this rank's rows of it. Parameter gradients are accumulated.
  virtual TensorView backward(const TensorView& dout_local, const ops::LinearInput& x, const TensorView& dx_local,
                              float p) = 0;
  // The most scratch its linears may borrow in one call (nn::BlockScratch).
  virtual std::size_t scratch_bytes() const = 0;
  // Model FLOPs per trained token (forward and backward).
  virtual double flops_per_token() const = 0;
  // Parameters a token does not meet (a mixture of experts' unchosen experts): total minus active.
  virtual std::int64_t inactive_parameters() const { return 0; }

  // How many f32 numbers it accumulates on the device over a step; the model gives them their place
  // in one tensor of every part's (bind_device_stats) and reads it once per step.
  virtual std::int64_t device_stats() const { return 0; }
  virtual void bind_device_stats(const TensorView& slot) { (void)slot; }
  // The numbers it reports per step (a mixture of experts' losses and loads), given the values of
  // its device numbers: appended to `sums`, which the data-parallel ranks add up, and then forgotten.
  virtual void collect_stats(std::span<const float> device, std::vector<float>& sums) { (void)device, (void)sums; }
  // Named metrics from the summed numbers (its own from `at` on), and whatever it updates from them
  // (the same on every rank); returns where the next part's begin.
  virtual std::size_t end_step(std::span<const float> sums, std::size_t at, const std::string& name,
                               std::vector<std::pair<std::string, double>>& out) {
    (void)sums, (void)name, (void)out;
    return at;
  }
  // State that is neither a parameter nor an activation (a router's balancing bias), for checkpoints:
  // the same on every rank.
  virtual std::vector<float> state() const { return {}; }
  virtual void set_state(std::span<const float> values) { (void)values; }
};

}  // namespace kiln::model
