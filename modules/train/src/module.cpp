#include "kiln/engine/engine_module.hpp"
#include "kiln/train/layout.hpp"
#include "kiln/train/state.hpp"
#include "kiln/train/train.hpp"

namespace kiln::train {

namespace {
void install(World& w, const TrainConfig& cfg) {
  // The parallel module (installed first) says how many data-parallel ranks split the batch; a World
  // without one is a single rank.
  const auto* layout = w.try_resource<ParallelLayout>();
  const std::int64_t dp = layout ? layout->dp : 1;
  if (cfg.batch_size % dp != 0)
    throw config_error(w, "train.batch_size", cat(cfg.batch_size, " is not divisible by the ", dp, " data-parallel ranks"));
  const std::int64_t per_rank = cfg.batch_size / dp;
  const std::int64_t mbs = cfg.micro_batch_size > 0 ? cfg.micro_batch_size : per_rank;
  if (per_rank % mbs != 0)
    throw config_error(w, "train.micro_batch_size", cat(mbs, " does not divide the per-rank batch of ", per_rank,
                                                        " sequences (train.batch_size ", cfg.batch_size, " / dp ", dp, ")"));
  auto& st = w.emplace_resource<TrainState>();
  st.micro_batch_size = static_cast<int>(mbs);
  st.micro_batches = static_cast<int>(per_rank / mbs);
  st.tokens_per_step = cfg.batch_size * cfg.seq_len;
  st.ranks = layout ? layout->world : 1;
  auto& saved = w.emplace_resource<TrainingState>();
  saved.counters.push_back({"train.tokens_seen", [&st] { return st.tokens_seen; },
                            [&st](std::int64_t v) { st.tokens_seen = v; }});
  w.emplace_resource<Batch>();
  w.emplace_resource<ValidationSet>();

  w.systems().add({"train.setup", Phase::setup, [](World& world) {
                     auto& ctl = world.resource<RunControl>();
                     auto& st = world.resource<TrainState>();
                     ctl.micro_batches = st.micro_batches;
                     const auto& c = world.resource<TrainConfig>();
                     if (ctl.step >= c.steps) ctl.request_stop("train.steps reached");
                   }});
  w.systems().add({"train.step_begin", Phase::step_begin, [](World& world) {
                     auto& st = world.resource<TrainState>();
                     st.step = world.resource<RunControl>().step;
                     st.val_loss.reset();
                     st.step_start = std::chrono::steady_clock::now();
                     if (!st.run_start) st.run_start = st.step_start;
                   }});
  w.systems().add({"train.step_end", Phase::step_end, [](World& world) {
                     auto& st = world.resource<TrainState>();
                     auto now = std::chrono::steady_clock::now();
                     st.step_ms = std::chrono::duration<double, std::milli>(now - st.step_start).count();
                     st.elapsed_s = std::chrono::duration<double>(now - *st.run_start).count();
                     st.tokens_seen += st.tokens_per_step;
                     st.tokens_per_s = st.tokens_per_step / (st.step_ms / 1000.0);
                     st.mfu = st.peak_flops > 0 ? st.flops_per_token * st.tokens_per_s / (st.peak_flops * st.ranks) : 0;
                     auto& ctl = world.resource<RunControl>();
                     const auto& c = world.resource<TrainConfig>();
                     if (ctl.step >= c.steps) ctl.request_stop("train.steps reached");
                     else if (c.exit_interval > 0 && ctl.step % c.exit_interval == 0)
                       ctl.request_stop(cat("train.exit_interval: stopping after step ", ctl.step));
                   }});
}
}  // namespace

void register_module(ModuleRegistry& registry) {
  // "parallel" installs first (it emplaces the ParallelLayout); nothing of it is linked.
  registry.add(make_module<TrainConfig>("train", "the training loop: steps, batch sizes, sequence length, master seed",
                                        {"parallel"}, install));
}

}  // namespace kiln::train
