#pragma once
// What a training-state checkpoint holds besides the parameters' master weights, registered by the
// modules that own it (the optimizer its moments, the data module its position, the RNG and FP8
// modules their per-rank state), so that the checkpoint module saves and restores it without
// knowing any of them. A user's module registers its own the same way.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kiln/tensor/tensor.hpp"

namespace kiln::train {

// A rank's blobs of one name from a checkpoint being loaded.
struct SavedBlobs {
  std::string checkpoint;            // its directory, for messages
  bool same_layout = false;          // saved under this run's topology
  const std::string* own = nullptr;  // same_layout: what this rank saved (null if it saved none)
  std::vector<std::string> all;      // what every rank saved, in rank order (ranks without one left out)
};

// World resource (made by the train module).
struct TrainingState {
  // f32 (or bf16) buffers laid out like the parameter store's held buffers (nn::ParamStore): saved
  // per parameter in f32 as "<name>/<parameter name>" by global shape and resharded like the weights.
  struct HeldBuffer {
    std::string name;  // e.g. "optimizer/exp_avg"
    std::function<TensorView()> view;
    DType dtype = DType::f32;  // the view's, known at install (memory reports before it is allocated)
  };
  // Integers equal on every rank (the data position, the optimizer's step count): saved once.
  struct Counter {
    std::string name;  // e.g. "data.position"
    std::function<std::int64_t()> get;
    std::function<void(std::int64_t)> set;
  };
  // Bytes of one rank (its RNG tracker's states, its FP8 scaling state). On load, `prepare` checks
  // what was saved and returns what applies it; it throws (a FileError) if the bytes do not fit, and
  // changes nothing itself, so that a bad checkpoint leaves the run's state untouched.
  struct RankBlob {
    std::string name;  // e.g. "rng"
    std::function<std::string()> save;
    std::function<std::function<void()>(const SavedBlobs&)> prepare;
    // Whether this rank saves it (others hold the same bytes: replicas); empty: every rank.
    std::function<bool()> saved_here = {};
  };
  std::vector<HeldBuffer> held;
  std::vector<Counter> counters;
  std::vector<RankBlob> blobs;

  // The step of the checkpoint this run resumed from; 0 for a fresh start.
  std::int64_t resumed_from = 0;
};

}  // namespace kiln::train
