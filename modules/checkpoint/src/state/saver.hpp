#pragma once
// Saving a training-state checkpoint, on every rank. start() copies this rank's state to host
// memory (the only part the step waits for when saving asynchronously) and starts writing its
// shard file on a background thread; finish() waits for it; once every rank's file is written,
// rank 0 writes the manifest, renames step_N.tmp to step_N and updates `latest` (complete()).
#include <cstdint>
#include <future>
#include <map>
#include <string>
#include <vector>

#include "kiln/checkpoint/training_checkpoint.hpp"
#include "kiln/engine/world.hpp"
#include "kiln/tensor/buffer.hpp"

namespace kiln::checkpoint {

class Saver {
 public:
  Saver(World& w, CheckpointConfig cfg) : w_(w), cfg_(std::move(cfg)) {}
  ~Saver();  // waits for a write in flight (never completes it: that takes every rank)

  // Allocates the host staging memory (pinned on CUDA) a save needs, if not yet done; returns
  // the seconds it took. Done at setup when saves are planned, so no step pays for pinning.
  double reserve();
  // Collective. Waits for a save in flight to complete, then starts saving `step`.
  void start(std::int64_t step);
  bool pending() const { return writing_.valid(); }
  std::int64_t pending_step() const { return step_; }
  std::int64_t last_saved() const { return last_saved_; }
  // Collective: completes the save in flight if every rank has written its file (wait = false),
  // or once they have (wait = true). A rank's failed write is an error on every rank.
  void complete(bool wait);

 private:
  void stage();
  void finalize(const std::string& fragment);
  World& w_;
  CheckpointConfig cfg_;
  Buffer staging_;  // the held buffers, one after the other (pinned host memory on CUDA)
  std::future<std::string> writing_;  // this rank's part of the manifest, as JSON
  std::int64_t step_ = 0, last_saved_ = -1;
  std::map<std::string, std::int64_t> counters_;
  double started_ = 0, blocked_s_ = 0;
};

}  // namespace kiln::checkpoint
