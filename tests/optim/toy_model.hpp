#pragma once
// A stand-in "model" module for the optimizer's tests: five parameters shaped like one attention
// layer's (a fused QKV weight and bias split by rows under tensor parallelism, a projection split
// by columns, a replicated bias and norm weight), initial weights and per-step gradients drawn
// from fixed seeds over the logical tensors, so every TP layout sees the same numbers. The
// backward phase writes the step's gradients.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kiln/engine/config/pipeline.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/engine/runner.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/optim/optim.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/train/train.hpp"

namespace kiln::test {

struct ToyModelConfig {
  std::int64_t width = 6;
  std::uint64_t seed = 11;
  double grad_gain = 1;
  std::string non_finite_grad;
  std::string updated_elsewhere;
};
KILN_CONFIG(ToyModelConfig,
            (width, "C: QKV is [3C, C], the projection [C, C]; divisible by parallel.tp"),
            (seed, "seeds the initial weights and every step's gradients"),
            (grad_gain, "every gradient is multiplied by this"),
            (non_finite_grad, "this parameter's gradient gets a NaN"),
            (updated_elsewhere, "this parameter is marked nn::UpdatedBy{\"test\"}"))

enum class Split { qkv_rows, columns, none };

struct ToyParamSpec {
  std::string name;
  Shape global;
  bool decay;
  Split split;
};

inline std::vector<ToyParamSpec> toy_params(std::int64_t C) {
  return {{"qkv.weight", {3 * C, C}, true, Split::qkv_rows},
          {"qkv.bias", {3 * C}, false, Split::qkv_rows},
          {"proj.weight", {C, C}, true, Split::columns},
          {"proj.bias", {C}, false, Split::none},
          {"ln.weight", {C}, false, Split::none}};
}

inline TensorShard toy_shard(Split split, std::int64_t C, int tp, int r) {
  if (tp == 1 || split == Split::none) return {};
  const std::int64_t b = r * C / tp, e = (r + 1) * C / tp;
  if (split == Split::columns) return {1, {{b, e}}};
  return {0, {{b, e}, {C + b, C + e}, {2 * C + b, 2 * C + e}}};
}

// The logical tensor of parameter `index`: its initial weights (step 0) or step `step`'s gradient.
inline std::vector<float> toy_values(std::uint64_t seed, std::size_t index, std::int64_t step, std::int64_t numel) {
  std::mt19937_64 gen(seed * 1000003u + index * 1009u + static_cast<std::uint64_t>(step));
  std::normal_distribution<float> normal(0.0f, step == 0 ? 0.5f : 1.0f);
  std::vector<float> v(static_cast<std::size_t>(numel));
  for (auto& x : v) x = normal(gen);
  return v;
}

// This rank's part of a logical tensor.
inline std::vector<float> local_part(const TensorShard& s, const Shape& global, const std::vector<float>& logical) {
  std::vector<float> out(static_cast<std::size_t>(s.local_shape(global).numel()));
  s.for_each_block(global, [&](const TensorShard::Block& b) {
    for (std::int64_t k = 0; k < b.count; ++k)
      out[static_cast<std::size_t>(b.local + k)] = logical[static_cast<std::size_t>(b.global + k)];
  });
  return out;
}

inline std::vector<float> to_vector(const TensorView& v) {
  const float* p = v.as<float>();
  return std::vector<float>(p, p + v.numel());
}

namespace detail {
inline void install_toy_model(World& w, const ToyModelConfig& cfg) {
  const auto& par = w.resource<parallel::ParallelState>();
  const int tp = par.tp_size(), r = par.coords.tp;
  KILN_CHECK(cfg.width % tp == 0, "model.width ", cfg.width, " must divide by parallel.tp ", tp);
  auto& store = w.emplace_resource<nn::ParamStore>();
  const auto specs = toy_params(cfg.width);
  for (const auto& spec : specs) {
    nn::Param p;
    p.name = spec.name;
    p.global_shape = spec.global;
    p.shard = toy_shard(spec.split, cfg.width, tp, r);
    p.shape = p.shard.local_shape(spec.global);
    p.weight_decay = spec.decay;
    p.unit = 1;
    const Entity e = store.add(w, std::move(p));
    if (spec.name == cfg.updated_elsewhere) w.emplace<nn::UpdatedBy>(e, nn::UpdatedBy{"test"});
  }
  const bool marked = !w.view<nn::Param, nn::UpdatedBy>().empty();
  KILN_CHECK(cfg.updated_elsewhere.empty() || marked, "no parameter '", cfg.updated_elsewhere, "'");
  // Laid out and allocated in Phase::setup, as the model does ("params.allocate").
  w.systems().add({"params.allocate", Phase::setup, [seed = cfg.seed](World& world) {
                     auto& store = world.resource<nn::ParamStore>();
                     auto& be = world.resource<ops::ActiveBackend>().get();
                     store.lay_out(world);
                     const auto n = static_cast<std::size_t>(store.held());
                     store.allocate({be.alloc(n * 4), be.alloc(n * size_of(be.act_dtype())), be.alloc(n * 4),
                                     be.act_dtype(), be.stream()});
                     be.zero(store.master_flat());
                     be.zero(store.grads_flat());
                     be.zero(store.compute_flat());
                     for (std::size_t i = 0; i < store.order().size(); ++i) {
                       const auto& p = world.get<nn::Param>(store.order()[i]);
                       const auto init =
                           local_part(p.shard, p.global_shape, toy_values(seed, i, 0, p.global_shape.numel()));
                       std::copy(init.begin(), init.end(), store.master_view(p).as<float>());
                       std::copy(init.begin(), init.end(), store.compute_view(p).as<float>());
                     }
                   }});
  w.systems().add({"model.backward", Phase::backward, [cfg](World& world) {
                     const auto step = world.resource<RunControl>().step;
                     auto& store = world.resource<nn::ParamStore>();
                     for (std::size_t i = 0; i < store.order().size(); ++i) {
                       const auto& p = world.get<nn::Param>(store.order()[i]);
                       auto g = local_part(p.shard, p.global_shape, toy_values(cfg.seed, i, step, p.global_shape.numel()));
                       float* out = store.grad_view(p).as<float>();
                       for (std::size_t k = 0; k < g.size(); ++k) out[k] = static_cast<float>(g[k] * cfg.grad_gain);
                       if (p.name == cfg.non_finite_grad) out[0] = std::numeric_limits<float>::quiet_NaN();
                     }
                   }});
}
}  // namespace detail

// The registry of the toy pipeline: the engine, the modules the optimizer installs with, the toy
// model and the optimizer, nothing else.
inline ModuleRegistry toy_registry() {
  ModuleRegistry reg;
  register_engine_module(reg);
  ops::register_module(reg);
  parallel::register_module(reg);
  train::register_module(reg);
  reg.add(make_module<ToyModelConfig>("model", "a toy model for the optimizer's tests", {"backend", "train", "parallel"},
                                      detail::install_toy_model));
  optim::register_module(reg);
  return reg;
}

inline const char* kToyPipeline = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 1
[train]
steps = 3
batch_size = 1
seq_len = 1
[model]
width = 6
[optim]
lr = 0.05
warmup_steps = 2
weight_decay = 0.1
grad_clip = 0
[parallel]
timeout_s = 30
)";

inline config::PipelineConfig toy_config(std::vector<std::string> sets) {
  auto doc = config::parse_toml_text(kToyPipeline, "toy.toml");
  config::apply_overrides(doc, sets);
  return config::resolve(doc, "toy.toml", toy_registry());
}

// A one-rank World with the toy pipeline installed (nothing run yet).
inline std::unique_ptr<World> toy_world(std::vector<std::string> sets = {}) {
  auto w = std::make_unique<World>();
  install_pipeline(*w, toy_config(std::move(sets)), toy_registry());
  return w;
}

// Where AdamW takes one logical parameter over `steps` steps, from the formula itself: the toy
// model's weights and gradients, ops::adamw_update with the optimizer's schedule, decay only where
// the parameter decays, and step s's gradient scaled by grad_scales[s - 1].
struct AdamWReference {
  std::vector<float> p, m, v;
};
inline AdamWReference adamw_reference(const ToyModelConfig& model, const optim::OptimConfig& oc, std::int64_t total_steps,
                                      std::size_t index, const std::vector<float>& grad_scales) {
  const auto spec = toy_params(model.width)[index];
  const auto n = spec.global.numel();
  AdamWReference r{toy_values(model.seed, index, 0, n), std::vector<float>(static_cast<std::size_t>(n)),
                   std::vector<float>(static_cast<std::size_t>(n))};
  for (std::size_t s = 1; s <= grad_scales.size(); ++s) {
    const auto step = static_cast<std::int64_t>(s);
    const auto g = toy_values(model.seed, index, step, n);
    const float lr = static_cast<float>(optim::learning_rate(oc, step, total_steps));
    float bc1 = 0, bc2 = 0;
    ops::adamw_bias_corrections(oc.beta1, oc.beta2, step, bc1, bc2);
    for (std::size_t k = 0; k < r.p.size(); ++k) {
      const float grad = static_cast<float>(g[k] * model.grad_gain);
      ops::adamw_update(r.p[k], r.m[k], r.v[k], grad * grad_scales[s - 1], lr, oc.beta1, oc.beta2, oc.eps,
                        spec.decay ? oc.weight_decay : 0.0f, bc1, bc2);
    }
  }
  return r;
}

// The norm of the whole logical gradient of step `step`, in double.
inline double toy_grad_norm(const ToyModelConfig& model, std::int64_t step) {
  double sum = 0;
  const auto specs = toy_params(model.width);
  for (std::size_t i = 0; i < specs.size(); ++i)
    for (float g : toy_values(model.seed, i, step, specs[i].global.numel())) {
      const double x = static_cast<double>(static_cast<float>(g * model.grad_gain));
      sum += x * x;
    }
  return std::sqrt(sum);
}

}  // namespace kiln::test
