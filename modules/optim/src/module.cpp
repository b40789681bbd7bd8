#include <cmath>
#include <numbers>

#include "kiln/engine/engine_module.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/optim/optim.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/train/train.hpp"

namespace kiln::optim {

double learning_rate(const OptimConfig& cfg, std::int64_t step, std::int64_t total) {
  if (cfg.warmup_steps > 0 && step <= cfg.warmup_steps)
    return cfg.lr * static_cast<double>(step) / static_cast<double>(cfg.warmup_steps);
  if (cfg.schedule == Schedule::constant) return cfg.lr;
  const double span = std::max<std::int64_t>(1, total - cfg.warmup_steps);
  const double ratio = std::clamp(static_cast<double>(step - cfg.warmup_steps) / span, 0.0, 1.0);
  const double min_lr = cfg.lr * cfg.min_lr_ratio;
  return min_lr + 0.5 * (1.0 + std::cos(std::numbers::pi * ratio)) * (cfg.lr - min_lr);
}

namespace {

// Segments covering the whole flat buffer: each parameter (decayed or not; left alone where another
// module updates it, nn::UpdatedBy), and its alignment padding (no decay).
std::vector<ops::AdamWSegment> segments(World& w) {
  const auto& store = w.resource<nn::ParamStore>();
  std::vector<ops::AdamWSegment> out;
  std::int64_t at = 0;
  for (Entity e : store.order) {
    const auto& p = w.get<nn::Param>(e);
    if (p.offset > at) out.push_back({at, p.offset - at, false});
    out.push_back({p.offset, p.numel, p.weight_decay, w.try_get<nn::UpdatedBy>(e) == nullptr});
    at = p.offset + p.numel;
  }
  if (store.total > at) out.push_back({at, store.total - at, false});
  return out;
}

// Each parameter's gradient as a flat view, in the store's order.
std::vector<TensorView> parameter_gradients(World& w) {
  const auto& store = w.resource<nn::ParamStore>();
  std::vector<TensorView> out;
  out.reserve(store.order.size());
  for (Entity e : store.order) {
    const auto& p = w.get<nn::Param>(e);
    out.push_back(store.grad_view(p).reshape({p.numel}));
  }
  return out;
}

// The squared norm of the whole (logical) gradient. With tensor parallelism a rank holds shards of
// some parameters and full copies of the others: the shards' squares are summed over the TP group,
// the replicated parameters counted once (each rank adds 1/tp of theirs before the all-reduce).
double global_sum_squares(World& w, ops::Backend& be) {
  const auto& store = w.resource<nn::ParamStore>();
  auto& tp = *w.resource<parallel::Communicators>().tp;
  if (tp.size() == 1) return be.sum_squares(store.grads_flat());
  const std::vector<double> each = be.sum_squares_each(parameter_gradients(w));
  double local = 0;
  for (std::size_t i = 0; i < store.order.size(); ++i)
    local += w.get<nn::Param>(store.order[i]).shard.sharded() ? each[i] : each[i] / tp.size();
  float v = static_cast<float>(local);
  tp.all_reduce(TensorView(&v, {1}, DType::f32, Device::cpu), parallel::ReduceOp::sum, nullptr);
  return v;
}

// Names the parameters whose gradient is not finite (slow path, only after a failure).
std::string non_finite_gradients(World& w, ops::Backend& be) {
  const auto& store = w.resource<nn::ParamStore>();
  const std::vector<double> each = be.sum_squares_each(parameter_gradients(w));
  std::string names;
  for (std::size_t i = 0; i < store.order.size(); ++i)
    if (!std::isfinite(each[i]))
      names += (names.empty() ? "'" : ", '") + w.get<nn::Param>(store.order[i]).name + "'";
  return names.empty() ? "(no single tensor; the sum overflowed)" : names;
}

void install(World& w, const OptimConfig& cfg) {
  auto& be = w.resource<ops::ActiveBackend>().get();
  const auto& store = w.resource<nn::ParamStore>();
  auto& st = w.emplace_resource<OptimState>();
  st.m = be.alloc(static_cast<std::size_t>(store.total) * 4);
  st.v = be.alloc(static_cast<std::size_t>(store.total) * 4);
  be.zero(st.m.view(DType::f32, {store.total}));
  be.zero(st.v.view(DType::f32, {store.total}));
  // The segments once every module is installed (a later one may mark parameters nn::UpdatedBy).
  w.systems().add({"optim.segments", Phase::setup,
                   [](World& world) { world.resource<OptimState>().segments = segments(world); }});

  w.systems().add({"optim.step", Phase::optimizer, [cfg](World& world) {
                     auto& be = world.resource<ops::ActiveBackend>().get();
                     auto& store = world.resource<nn::ParamStore>();
                     auto& st = world.resource<OptimState>();
                     auto& ts = world.resource<train::TrainState>();
                     const auto step = world.resource<RunControl>().step;
                     const double norm = std::sqrt(global_sum_squares(world, be));
                     if (!std::isfinite(norm))
                       KILN_THROW("step ", step, ": non-finite gradient in ", non_finite_gradients(world, be),
                                  "; stopping");
                     ops::AdamW a;
                     a.params = store.master_flat();
                     a.params_act = store.compute_flat();
                     a.grads = store.grads_flat();
                     a.m = st.m.view(DType::f32, {store.total});
                     a.v = st.v.view(DType::f32, {store.total});
                     a.segments = st.segments;
                     a.lr = static_cast<float>(learning_rate(cfg, step, world.resource<train::TrainConfig>().steps));
                     a.beta1 = cfg.beta1;
                     a.beta2 = cfg.beta2;
                     a.eps = cfg.eps;
                     a.weight_decay = cfg.weight_decay;
                     a.grad_scale = (cfg.grad_clip > 0 && norm > cfg.grad_clip)
                                        ? static_cast<float>(cfg.grad_clip / (norm + 1e-6))
                                        : 1.0f;
                     a.step = ++st.steps_taken;
                     be.adamw(a);
                     // The parameters another module updates (nn::UpdatedBy), with the same step.
                     world.events().publish(nn::AdamWStep{a.step, a.lr, a.beta1, a.beta2, a.eps, a.weight_decay,
                                                          a.grad_scale, a.m, a.v});
                     ts.lr = a.lr;
                     ts.grad_norm = norm;
                   }});
}

}  // namespace

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<OptimConfig>("optim", "AdamW with a warm-up + cosine schedule and gradient clipping",
                                        {"model"}, install));
}

}  // namespace kiln::optim
