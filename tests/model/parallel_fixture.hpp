#pragma once
// Runs a pipeline on N CPU-thread ranks and records, per step, the loss and every parameter's full
// logical gradient (TP shards and FSDP parts put back in place), and the final weights, for
// comparing runs of different layouts.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kiln/builtin.hpp"
#include "kiln/engine/config/pipeline.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/thread_ranks.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/train/train.hpp"
#include "host_floats.hpp"

namespace kiln::test {

// `--set` overrides of a test run; `a + b` is a's followed by b's.
using Sets = std::vector<std::string>;
inline Sets operator+(Sets a, const Sets& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct Trace {
  std::shared_ptr<std::mutex> m = std::make_shared<std::mutex>();
  std::vector<double> loss;
  std::vector<std::map<std::string, std::vector<float>>> grads;
  std::map<std::string, std::vector<float>> weights;  // the f32 master weights after the last step
};

// Writes the parts of every parameter that this rank holds, of a flat buffer laid out like the
// store's held elements (the gradients, the master weights), into the logical tensors of `out`:
// its tensor-parallel shard of each parameter, and of that its FSDP part. Ranks holding the same
// elements write the same values.
inline void write_held(World& w, const nn::ParamStore& store, const TensorView& device_flat,
                       std::map<std::string, std::vector<float>>& out) {
  std::vector<float> host = host_floats(w.resource<ops::ActiveBackend>().get(), device_flat);
  const TensorView flat(host.data(), device_flat.shape, DType::f32, Device::cpu);
  for (Entity e : store.order()) {
    const auto& p = w.get<nn::Param>(e);
    auto& full = out[p.name];
    full.resize(static_cast<std::size_t>(p.global_shape.numel()));
    store.for_each_held(p, [&](const nn::HeldPart& part) {
      const float* held = nn::ParamStore::held_view(flat, part).as<float>();
      p.shard.for_each_block(p.global_shape, part.first, part.first + part.count, [&](const TensorShard::Block& b) {
        std::copy(held + (b.local - part.first), held + (b.local - part.first) + b.count, full.begin() + b.global);
      });
    });
  }
}

// `extra` registers more modules (e.g. a test's own) next to kiln's. With `failures`, a failed run
// is not a test failure: its messages (describe_failures) go there ("" if every rank finished).
inline Trace run_ranks(const std::string& toml, int nproc, std::vector<std::string> sets,
                       void (*extra)(ModuleRegistry&) = nullptr, std::string* failures = nullptr) {
  ModuleRegistry reg;
  register_builtin_modules(reg);
  if (extra) extra(reg);
  auto doc = config::parse_toml_text(toml, "test.toml");
  config::apply_overrides(doc, sets);
  auto cfg = config::resolve(doc, "test.toml", reg);
  Trace trace;
  auto outcomes = parallel::run_thread_ranks(nproc, cfg, reg, [&trace](World& w) {
    w.systems().add({"test.trace", Phase::grad_sync,
                     [&trace](World& world) {
                       const auto step = static_cast<std::size_t>(world.resource<RunControl>().step);
                       const auto& store = world.resource<nn::ParamStore>();
                       std::lock_guard lk(*trace.m);
                       if (trace.grads.size() < step) {
                         trace.grads.resize(step);
                         trace.loss.resize(step);
                       }
                       write_held(world, store, store.grads_flat(), trace.grads[step - 1]);
                     },
                     {"parallel.dp_grad_sync", "parallel.tp_grad_sync"}});
    w.systems().add({"test.loss", Phase::step_end,
                     [&trace](World& world) {
                       const auto step = static_cast<std::size_t>(world.resource<RunControl>().step);
                       std::lock_guard lk(*trace.m);
                       trace.loss[step - 1] = world.resource<train::TrainState>().loss;
                     },
                     {"model.loss"}});
    w.systems().add({"test.weights", Phase::shutdown, [&trace](World& world) {
                       const auto& store = world.resource<nn::ParamStore>();
                       std::lock_guard lk(*trace.m);
                       write_held(world, store, store.master_flat(), trace.weights);
                     }});
  });
  if (failures) {
    *failures = parallel::describe_failures(outcomes);
    return trace;
  }
  INFO(parallel::describe_failures(outcomes));
  for (auto& o : outcomes) REQUIRE(o.ok);
  return trace;
}

// Worst relative difference of the loss and of the whole gradient over all steps, checked against
// `tolerance`; tolerance 0 asks for bit-identical losses and gradients.
inline void compare_traces(const Trace& a, const Trace& ref, const std::string& what, double tolerance) {
  REQUIRE(a.loss.size() == ref.loss.size());
  REQUIRE(!ref.loss.empty());
  double worst_loss = 0, worst_grad = 0;
  std::size_t differing = 0;
  for (std::size_t s = 0; s < ref.loss.size(); ++s) {
    worst_loss = std::max(worst_loss, std::fabs(a.loss[s] - ref.loss[s]) / std::fabs(ref.loss[s]));
    double num = 0, den = 0;
    for (auto& [name, g] : ref.grads[s]) {
      const auto& h = a.grads[s].at(name);
      REQUIRE(h.size() == g.size());
      for (std::size_t i = 0; i < g.size(); ++i) {
        num += double(h[i] - g[i]) * (h[i] - g[i]);
        den += double(g[i]) * g[i];
        differing += h[i] != g[i];
      }
    }
    worst_grad = std::max(worst_grad, std::sqrt(num / den));
  }
  MESSAGE(what << ": worst relative loss difference " << worst_loss << ", worst relative gradient difference "
               << worst_grad << ", " << differing << " gradient values not bit-identical, over " << ref.loss.size()
               << " steps");
  if (tolerance == 0) {
    CHECK(a.loss == ref.loss);
    CHECK(differing == 0);
  } else {
    CHECK(worst_loss <= tolerance);
    CHECK(worst_grad <= tolerance);
  }
}

}  // namespace kiln::test
