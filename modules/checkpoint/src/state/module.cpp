// The "checkpoint" engine module: when to save and what to resume from.
#include <chrono>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <memory>

#include "kiln/checkpoint/reader.hpp"
#include "kiln/checkpoint/training_checkpoint.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/train/state.hpp"
#include "kiln/train/train.hpp"
#include "loader.hpp"
#include "saver.hpp"

namespace kiln::checkpoint {

namespace {

struct CheckpointRun {
  std::unique_ptr<Saver> saver;
};

void resume(World& w, const CheckpointConfig& cfg) {
  if (cfg.resume == "never") return;
  const bool rank0 = w.resource<RankInfo>().rank == 0;
  std::string dir;
  if (cfg.resume == "auto") {
    dir = latest_checkpoint(cfg.dir);
    if (dir.empty()) {
      if (rank0) std::cout << "checkpoint: none under " << cfg.dir << "; starting from step 0\n";
      return;
    }
  } else {
    dir = resolve_checkpoint(cfg.resume);
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::int64_t step = load_checkpoint(w, dir);
  if (rank0)
    std::cout << "checkpoint: resumed from " << dir << " at step " << step << " (loaded in " << std::fixed
              << std::setprecision(2) << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()
              << " s)\n"
              << std::defaultfloat;
  auto& ctl = w.resource<RunControl>();
  if (ctl.step >= w.resource<train::TrainConfig>().steps) ctl.request_stop("train.steps reached");
}

void install(World& w, const CheckpointConfig& cfg) {
  auto& run = w.emplace_resource<CheckpointRun>();
  run.saver = std::make_unique<Saver>(w, cfg);
  Saver* saver = run.saver.get();
  // After every other setup system: the state it loads must exist, and nothing may overwrite it.
  w.systems().add({"checkpoint.resume", Phase::setup, [cfg, saver](World& world) {
                     resume(world, cfg);
                     // A fresh run that takes no step (train.steps = 0: weights converted from
                     // Hugging Face files, say) still leaves its state, as step 0.
                     const auto& ctl = world.resource<RunControl>();
                     std::error_code ec;
                     if (cfg.at_end && ctl.stop && ctl.step == 0 &&
                         !std::filesystem::exists(std::filesystem::path(cfg.dir) / step_directory_name(0), ec)) {
                       saver->start(0);
                       saver->complete(true);
                     }
                     if (cfg.every <= 0) return;
                     const double s = saver->reserve();
                     if (world.resource<RankInfo>().rank == 0 && s > 0.5)
                       std::cout << "checkpoint: host staging memory for saves allocated in " << std::fixed
                                 << std::setprecision(2) << s << " s\n"
                                 << std::defaultfloat;
                   },
                   {kAllSystems}});
  w.systems().add({"checkpoint.save", Phase::checkpoint, [cfg, saver](World& world) {
                     const auto& ctl = world.resource<RunControl>();
                     saver->complete(false);  // a background save finished on every rank: make it complete
                     const bool due = (cfg.every > 0 && ctl.step % cfg.every == 0) || (ctl.stop && cfg.at_end);
                     const bool saving = saver->pending() && saver->pending_step() == ctl.step;
                     if (due && !saving && saver->last_saved() != ctl.step) saver->start(ctl.step);
                     if (ctl.stop) saver->complete(true);
                   }});
  w.systems().add({"checkpoint.finish", Phase::shutdown, [saver](World&) { saver->complete(true); }});
}

}  // namespace

void register_state_module(ModuleRegistry& registry) {
  registry.add(make_module<CheckpointConfig>(
      "checkpoint", "training-state checkpoints: sharded, atomic, checksummed, resumed on any layout",
      {"train", "model", "parallel"}, install));
}

}  // namespace kiln::checkpoint
