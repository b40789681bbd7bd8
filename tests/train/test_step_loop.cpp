// The train module in the step loop: micro-batches, tokens, the stop at train.steps, and the
// step's timing fields.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>
#include <vector>

#include "kiln/parallel/thread_ranks.hpp"
#include "train_fixture.hpp"

using namespace kiln;

namespace {

const char* kPipeline = R"(
[train]
steps = 3
batch_size = 8
micro_batch_size = 2
seq_len = 16
[parallel]
timeout_s = 30
)";

struct Seen {
  int micro_batches = 0, micro_batch_size = 0, ranks = 0, loop_micro_batches = 0;
  std::int64_t tokens_per_step = 0;
};

// Sets up kPipeline on `nproc` CPU-thread ranks (no step: without a model there are no gradients
// for the parallel module to reduce); what rank 0's TrainState and RunControl said.
Seen run_ranks(int nproc, std::vector<std::string> sets) {
  sets.push_back("train.steps=0");
  Seen seen;
  std::mutex m;
  const auto outcomes = parallel::run_thread_ranks(
      nproc, test::train_config(kPipeline, sets), test::train_registry(), {}, [&](World& w) {
        if (w.resource<RankInfo>().rank != 0) return;
        const auto& st = w.resource<train::TrainState>();
        std::lock_guard lk(m);
        seen = {st.micro_batches, st.micro_batch_size, st.ranks, w.resource<RunControl>().micro_batches,
                st.tokens_per_step};
      });
  INFO(parallel::describe_failures(outcomes));
  for (const auto& o : outcomes) REQUIRE(o.ok);
  return seen;
}

}  // namespace

TEST_CASE("one rank runs the batch in micro-batches of micro_batch_size") {
  auto w = test::train_world(kPipeline);
  const auto& st = w->resource<train::TrainState>();
  CHECK(st.micro_batch_size == 2);
  CHECK(st.micro_batches == 4);
  CHECK(st.ranks == 1);
  int data_phases = 0;
  w->systems().add({"test.count", Phase::data, [&](World&) { ++data_phases; }});
  run_pipeline(*w);
  CHECK(w->resource<RunControl>().micro_batches == 4);
  CHECK(data_phases == 3 * 4);
}

TEST_CASE("micro_batch_size 0 runs the whole per-rank batch at once") {
  auto w = test::train_world(kPipeline, {"train.micro_batch_size=0"});
  CHECK(w->resource<train::TrainState>().micro_batches == 1);
  CHECK(w->resource<train::TrainState>().micro_batch_size == 8);
}

TEST_CASE("data-parallel ranks split the batch before it is cut into micro-batches") {
  const Seen dp2 = run_ranks(2, {});
  CHECK(dp2.micro_batch_size == 2);
  CHECK(dp2.micro_batches == 2);  // 8 / 2 ranks = 4 sequences each, in micro-batches of 2
  CHECK(dp2.loop_micro_batches == 2);
  CHECK(dp2.ranks == 2);
  const Seen whole = run_ranks(2, {"train.micro_batch_size=0"});
  CHECK(whole.micro_batches == 1);
  CHECK(whole.micro_batch_size == 4);
}

TEST_CASE("tensor-parallel ranks share one batch: only data parallelism divides it") {
  const Seen tp2 = run_ranks(2, {"parallel.tp=2"});
  CHECK(tp2.micro_batches == 4);
  CHECK(tp2.micro_batch_size == 2);
  CHECK(tp2.ranks == 2);
}

TEST_CASE("tokens per step count the global batch, whatever the number of ranks") {
  auto w = test::train_world(kPipeline);
  CHECK(w->resource<train::TrainState>().tokens_per_step == 8 * 16);
  run_pipeline(*w);
  CHECK(w->resource<train::TrainState>().tokens_seen == 3 * 8 * 16);
  CHECK(run_ranks(2, {}).tokens_per_step == 8 * 16);
}

TEST_CASE("the run stops after train.steps steps") {
  auto w = test::train_world(kPipeline, {"train.steps=5"});
  std::vector<std::int64_t> steps;
  w->systems().add({"test.steps", Phase::step_end, [&](World& world) {
                      steps.push_back(world.resource<train::TrainState>().step);
                    }});
  run_pipeline(*w);
  const auto& ctl = w->resource<RunControl>();
  CHECK(steps == std::vector<std::int64_t>{1, 2, 3, 4, 5});
  CHECK(ctl.stop);
  CHECK(ctl.step == 5);
  CHECK(ctl.stop_reason == "train.steps reached");
}

TEST_CASE("zero steps stop the run before its first step") {
  auto w = test::train_world(kPipeline, {"train.steps=0"});
  int steps = 0;
  w->systems().add({"test.steps", Phase::step_begin, [&](World&) { ++steps; }});
  run_pipeline(*w);
  CHECK(steps == 0);
  CHECK(w->resource<RunControl>().step == 0);
  CHECK(w->resource<RunControl>().stop_reason == "train.steps reached");
}

TEST_CASE("a step's timing fields are filled at its end") {
  auto w = test::train_world(kPipeline, {"train.steps=1"});
  // A step that takes measurable time, and a model that reports its FLOPs and its device's peak.
  w->systems().add({"test.work", Phase::forward, [](World& world) {
                      std::this_thread::sleep_for(std::chrono::milliseconds(1));
                      auto& st = world.resource<train::TrainState>();
                      st.flops_per_token = 6e6;
                      st.peak_flops = 1e12;
                    }});
  auto& st = w->resource<train::TrainState>();
  CHECK(st.step_ms == 0);
  run_pipeline(*w);
  CHECK(st.step == 1);
  CHECK(st.step_ms > 0);
  CHECK(std::isfinite(st.tokens_per_s));
  CHECK(st.tokens_per_s == doctest::Approx(st.tokens_per_step / (st.step_ms / 1000.0)));
  CHECK(st.mfu == doctest::Approx(st.flops_per_token * st.tokens_per_s / (st.peak_flops * st.ranks)));
  CHECK(st.mfu > 0);
}

TEST_CASE("elapsed_s counts wall-clock time from the run's first step to each step's end") {
  auto w = test::train_world(kPipeline, {"train.steps=3"});
  std::vector<double> elapsed, step_ms;
  w->systems().add({"test.work", Phase::forward, [](World&) { std::this_thread::sleep_for(std::chrono::milliseconds(2)); }});
  // A slow step boundary (a validation, a save) counts towards the time, not towards step_ms.
  w->systems().add({"test.between", Phase::checkpoint, [&](World& world) {
                      const auto& st = world.resource<train::TrainState>();
                      elapsed.push_back(st.elapsed_s);
                      step_ms.push_back(st.step_ms);
                      std::this_thread::sleep_for(std::chrono::milliseconds(20));
                    }});
  run_pipeline(*w);
  REQUIRE(elapsed.size() == 3);
  CHECK(elapsed[0] == doctest::Approx(step_ms[0] / 1000.0).epsilon(0.01));
  CHECK(elapsed[1] >= elapsed[0] + 0.020 + step_ms[1] / 1000.0 * 0.99);
  CHECK(elapsed[2] >= elapsed[1] + 0.020 + step_ms[2] / 1000.0 * 0.99);
}

TEST_CASE("without a known peak the model FLOPs utilisation stays 0") {
  auto w = test::train_world(kPipeline, {"train.steps=1"});
  w->systems().add({"test.flops", Phase::forward, [](World& world) {
                      world.resource<train::TrainState>().flops_per_token = 6e6;
                    }});
  run_pipeline(*w);
  CHECK(w->resource<train::TrainState>().mfu == 0);
}

TEST_CASE("a validation loss lasts only for the step that measured it") {
  auto w = test::train_world(kPipeline, {"train.steps=2"});
  std::vector<bool> had_val_loss;
  w->systems().add({"test.read", Phase::forward, [&](World& world) {
                      if (world.resource<RunControl>().micro_batch == 0)
                        had_val_loss.push_back(world.resource<train::TrainState>().val_loss.has_value());
                    }});
  w->systems().add({"test.evaluate", Phase::step_end, [](World& world) {
                      world.resource<train::TrainState>().val_loss = 2.5;
                    }});
  run_pipeline(*w);
  CHECK(had_val_loss == std::vector<bool>{false, false});
  CHECK(w->resource<train::TrainState>().val_loss == 2.5);
}

TEST_CASE("the module provides the batch and the validation set for the data module to fill") {
  auto w = test::train_world(kPipeline);
  CHECK(w->has_resource<train::Batch>());
  CHECK(w->has_resource<train::ValidationSet>());
  CHECK(w->resource<train::ValidationSet>().batches.empty());
}
