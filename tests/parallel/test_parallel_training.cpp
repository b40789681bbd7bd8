// Tensor and data parallel training on CPU threads against the single-rank run: the same global
// batch, so the same losses and the same (logical) gradients to fp32 rounding, step after step.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>

#include "kiln/builtin.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/engine/config/pipeline.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/parallel/launch.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/train/train.hpp"

using namespace kiln;

namespace {

const char* kTiny = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 1
[train]
steps = 20
seed = 5
batch_size = 8
seq_len = 32
[model]
n_layer = 2
n_head = 4
n_embd = 32
vocab_size = 96
max_seq_len = 32
[optim]
lr = 2e-3
warmup_steps = 3
[data]
synthetic_vocab = 96
[parallel]
timeout_s = 60
)";

// What a run records per step: the loss, and every parameter's full logical gradient.
struct Trace {
  std::shared_ptr<std::mutex> m = std::make_shared<std::mutex>();
  std::vector<double> loss;
  std::vector<std::map<std::string, std::vector<float>>> grads;
};

// Writes a rank's local gradient of `p` into the logical tensor `full`.
void scatter(const nn::Param& p, const float* local, std::vector<float>& full) {
  const std::int64_t cols = p.global_shape.ndim > 1 ? p.global_shape[1] : 1;
  const std::int64_t lcols = p.shape.ndim > 1 ? p.shape[1] : 1;
  if (!p.shard.sharded()) {
    std::copy(local, local + p.numel, full.begin());
    return;
  }
  if (p.shard.dim == 0) {
    std::int64_t at = 0;
    for (auto [b, e] : p.shard.ranges) {
      std::copy(local + at, local + at + (e - b) * cols, full.begin() + b * cols);
      at += (e - b) * cols;
    }
    return;
  }
  for (std::int64_t r = 0; r < p.shape[0]; ++r) {
    std::int64_t c0 = 0;
    for (auto [b, e] : p.shard.ranges) {
      std::copy(local + r * lcols + c0, local + r * lcols + c0 + (e - b), full.begin() + r * cols + b);
      c0 += e - b;
    }
  }
}

Trace run(int nproc, std::vector<std::string> sets) {
  ModuleRegistry reg;
  register_builtin_modules(reg);
  auto doc = config::parse_toml_text(kTiny, "tiny.toml");
  config::apply_overrides(doc, sets);
  auto cfg = config::resolve(doc, "tiny.toml", reg);
  Trace trace;
  auto outcomes = parallel::run_thread_ranks(nproc, cfg, reg, [&trace](World& w) {
    w.systems().add({"test.trace", Phase::grad_sync,
                     [&trace](World& world) {
                       const auto& par = world.resource<parallel::ParallelState>();
                       if (par.coords.dp != 0) return;  // after the DP sync every DP rank holds the same
                       const auto step = static_cast<std::size_t>(world.resource<RunControl>().step);
                       const auto& store = world.resource<nn::ParamStore>();
                       std::lock_guard lk(*trace.m);
                       if (trace.grads.size() < step) {
                         trace.grads.resize(step);
                         trace.loss.resize(step);
                       }
                       trace.loss[step - 1] = world.resource<train::TrainState>().loss;
                       for (Entity e : store.order) {
                         const auto& p = world.get<nn::Param>(e);
                         if (!p.shard.sharded() && par.coords.tp != 0) continue;
                         auto& full = trace.grads[step - 1][p.name];
                         full.resize(static_cast<std::size_t>(p.global_shape.numel()));
                         scatter(p, store.grad_view(p).as<float>(), full);
                       }
                     },
                     {"model.loss", "parallel.dp_grad_sync"}});
  });
  INFO(parallel::describe_failures(outcomes));
  for (auto& o : outcomes) REQUIRE(o.ok);
  return trace;
}

// Worst relative difference of the loss and of the whole gradient over all steps.
void compare(const Trace& a, const Trace& ref, const char* what) {
  REQUIRE(a.loss.size() == ref.loss.size());
  double worst_loss = 0, worst_grad = 0;
  for (std::size_t s = 0; s < ref.loss.size(); ++s) {
    worst_loss = std::max(worst_loss, std::fabs(a.loss[s] - ref.loss[s]) / std::fabs(ref.loss[s]));
    double num = 0, den = 0;
    for (auto& [name, g] : ref.grads[s]) {
      const auto& h = a.grads[s].at(name);
      REQUIRE(h.size() == g.size());
      for (std::size_t i = 0; i < g.size(); ++i) {
        num += double(h[i] - g[i]) * (h[i] - g[i]);
        den += double(g[i]) * g[i];
      }
    }
    worst_grad = std::max(worst_grad, std::sqrt(num / den));
  }
  MESSAGE(std::string(what) << ": worst relative loss difference " << worst_loss << ", worst relative gradient difference "
               << worst_grad << " over " << ref.loss.size() << " steps");
  CHECK(worst_loss <= 1e-5);
  CHECK(worst_grad <= 1e-5);
}

}  // namespace

TEST_CASE("tensor and data parallel runs on CPU threads match the single-rank run over 20 steps") {
  const Trace single = run(1, {});
  REQUIRE(single.loss.size() == 20);
  for (double l : single.loss) CHECK(std::isfinite(l));
  compare(run(2, {"parallel.tp=2"}), single, "tp=2");
  compare(run(4, {"parallel.tp=4"}), single, "tp=4");
  compare(run(2, {}), single, "dp=2");
  compare(run(4, {"parallel.tp=2"}), single, "tp=2 x dp=2");
  compare(run(4, {"parallel.tp=2", "train.micro_batch_size=2"}), single, "tp=2 x dp=2 with 2 micro-batches");
  compare(run(2, {"parallel.tp=2", "parallel.sequence_parallel=true"}), single, "tp=2, sequence parallel");
  compare(run(4, {"parallel.tp=4", "parallel.sequence_parallel=true"}), single, "tp=4, sequence parallel");
  compare(run(4, {"parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=2"}), single,
          "tp=2 x dp=2, sequence parallel, 2 micro-batches");
}

TEST_CASE("with dropout, tensor parallel runs match the single-rank run (layout-invariant masks)") {
  const Trace single = run(1, {"model.dropout=0.1"});
  compare(run(2, {"parallel.tp=2", "model.dropout=0.1"}), single, "tp=2, dropout 0.1");
  compare(run(4, {"parallel.tp=4", "model.dropout=0.1"}), single, "tp=4, dropout 0.1");
  compare(run(2, {"parallel.tp=2", "parallel.sequence_parallel=true", "model.dropout=0.1"}), single,
          "tp=2, sequence parallel, dropout 0.1");
}

TEST_CASE("sequence parallelism keeps only this rank's tokens in the residual stream") {
  ModuleRegistry reg;
  register_builtin_modules(reg);
  auto doc = config::parse_toml_text(kTiny, "tiny.toml");
  config::apply_overrides(doc, {"parallel.tp=2", "parallel.sequence_parallel=true", "train.steps=1"});
  auto cfg = config::resolve(doc, "tiny.toml", reg);
  int partial = 0;
  auto outcomes = parallel::run_thread_ranks(2, cfg, reg, {}, [&partial](World& w) {
    if (w.resource<RankInfo>().rank != 0) return;
    for (Entity e : w.view<nn::Param>()) partial += w.get<nn::Param>(e).tp_partial_grad;
  });
  for (auto& o : outcomes) REQUIRE(o.ok);
  CHECK(partial == 2 * 2 * 2 + 2);  // ln_1 and ln_2 of 2 blocks (weight and bias), and ln_f
}

TEST_CASE("a failing rank stops a CPU run and the others name it") {
  ModuleRegistry reg;
  register_builtin_modules(reg);
  auto doc = config::parse_toml_text(kTiny, "tiny.toml");
  config::apply_overrides(doc, {"parallel.tp=2", "train.steps=50"});
  auto cfg = config::resolve(doc, "tiny.toml", reg);
  auto outcomes = parallel::run_thread_ranks(2, cfg, reg, [](World& w) {
    if (w.resource<RankInfo>().rank != 1) return;
    w.systems().add({"test.die", Phase::forward, [](World& world) {
                       if (world.resource<RunControl>().step == 3) KILN_THROW("rank 1 was killed at step 3");
                     },
                     {}, {"model.forward"}});
  });
  REQUIRE_FALSE(outcomes[1].ok);
  REQUIRE_FALSE(outcomes[0].ok);
  CHECK(outcomes[1].error.find("killed at step 3") != std::string::npos);
  CHECK(outcomes[0].error.find("rank 1 failed") != std::string::npos);
  auto text = parallel::describe_failures(outcomes);
  CHECK(text.rfind("[rank 1]", 0) == 0);  // the root cause first
}
