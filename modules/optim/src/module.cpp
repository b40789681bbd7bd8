#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <span>

#include "kiln/engine/engine_module.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/optim/optim.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/train/state.hpp"
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

float step_learning_rate(World& w, const OptimConfig& cfg) {
  return static_cast<float>(
      learning_rate(cfg, w.resource<RunControl>().step, w.resource<train::TrainConfig>().steps));
}

// The parameters' parts this rank holds, ordered by their place in the held buffers.
struct HeldGradient {
  const nn::Param* param;
  nn::HeldPart part;
  bool updated_here;  // not left to another module (nn::UpdatedBy)
  bool counted;       // in sums over the parameters (not another stage's copy: nn::TiedAcrossStages)
};
std::vector<HeldGradient> held_parts(World& w) {
  const auto& store = w.resource<nn::ParamStore>();
  std::vector<HeldGradient> out;
  for (Entity e : store.order()) {
    const auto& p = w.get<nn::Param>(e);
    const auto* tied = w.try_get<nn::TiedAcrossStages>(e);
    store.for_each_held(p, [&](const nn::HeldPart& part) {
      out.push_back({&p, part, !w.has<nn::UpdatedBy>(e), !tied || !tied->copy});
    });
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.part.held < b.part.held; });
  return out;
}

// Segments covering the held buffers: each parameter's part (decayed or not; left alone where
// another module updates it, nn::UpdatedBy), and the alignment padding between them (no decay).
// Each with where its act-dtype compute copy is (nn::ParamStore::act_at: at its own index, elsewhere
// where the one-byte compute copies are apart, or none); the padding's copy is written only where it
// lies at its own index.
std::vector<ops::AdamWSegment> segments(World& w) {
  const auto& store = w.resource<nn::ParamStore>();
  const std::int64_t padding_act = store.codes_apart() ? ops::AdamWSegment::kNoAct : ops::AdamWSegment::kActAtOffset;
  std::vector<ops::AdamWSegment> out;
  std::int64_t at = 0;
  for (const auto& h : held_parts(w)) {
    if (h.part.held > at) out.push_back({at, h.part.held - at, false, true, padding_act});
    const std::int64_t act = store.act_at(*h.param, h.part);
    out.push_back({h.part.held, h.part.count, h.param->weight_decay, h.updated_here,
                   act < 0 ? ops::AdamWSegment::kNoAct : act});
    at = h.part.held + h.part.count;
  }
  if (store.held() > at) out.push_back({at, store.held() - at, false, true, padding_act});
  return out;
}

// The gradient of each held part, as flat views, in held order.
std::vector<TensorView> gradient_views(const nn::ParamStore& store, const std::vector<HeldGradient>& parts) {
  std::vector<TensorView> out;
  out.reserve(parts.size());
  for (const auto& h : parts) out.push_back(nn::ParamStore::held_view(store.grads_flat(), h.part));
  return out;
}

// Whether the gradient's norm is the plain one of the held gradient buffer (one rank holding every
// gradient once): then it is computed on the device (ops::GradClip), with no synchronisation.
bool norm_of_held_buffer(World& w) {
  if (parallel::param_shards(w).size() != 1) return false;
  for (const auto& h : held_parts(w))
    if (!h.counted || parallel::replicas_in_param_shards(w, *h.param) != 1) return false;
  return true;
}

// The squared norm of the whole (logical) gradient into `out` (f32 [1] on the backend's device), on
// the stream: no host value, so a captured step replays it. A rank holds shards of some parameters
// under tensor (and expert) parallelism and full copies of the others, and under FSDP its part of
// each unit: the squares are summed over the ranks that together hold one copy of the parameters
// (parallel::param_shards: over the pipeline stages too, one all-reduce), a part held by several of
// them counted once (each of its n holders adds 1/n of it: parallel::replicas_in_param_shards), a
// stage's copy of another stage's parameter (nn::TiedAcrossStages) not at all.
void global_sum_squares(World& w, ops::Backend& be, const TensorView& out) {
  const auto& store = w.resource<nn::ParamStore>();
  const auto parts = held_parts(w);
  std::vector<int> divisors;
  bool all_once = true;
  for (const auto& h : parts) {
    divisors.push_back(h.counted ? parallel::replicas_in_param_shards(w, *h.param) : 0);  // 0: not counted
    all_once = all_once && divisors.back() == 1;
  }
  if (all_once) {  // the held buffer's sum, as one
    const TensorView whole = store.grads_flat();
    const int one = 1;
    be.sum_squares_parts({std::span(&whole, 1), std::span(&one, 1), out});
  } else {
    const std::vector<TensorView> views = gradient_views(store, parts);
    be.sum_squares_parts({views, divisors, out});
  }
  parallel::param_shards(w).all_reduce(out, parallel::ReduceOp::sum,
                                       out.device == Device::cpu ? nullptr : be.stream());
}

// Names the parameters whose gradient (the part held here) is not finite (slow path, only after a
// failure).
std::string non_finite_gradients(World& w, ops::Backend& be) {
  const auto& store = w.resource<nn::ParamStore>();
  const auto parts = held_parts(w);
  const std::vector<double> each = be.sum_squares_each(gradient_views(store, parts));
  std::string names;
  for (std::size_t i = 0; i < parts.size(); ++i)
    if (!std::isfinite(each[i])) names += (names.empty() ? "'" : ", '") + parts[i].param->name + "'";
  const auto& par = w.resource<parallel::ParallelState>();
  const std::string stage = par.pp_size() > 1 ? cat(" on pipeline stage ", par.coords.pp, " of ", par.pp_size()) : "";
  if (!names.empty()) return names + stage;
  if (par.pp_size() > 1) return cat("(none of pipeline stage ", par.coords.pp, "'s tensors: another stage's, or the sum overflowed)");
  return store.sharded() ? "(none of this rank's parts; another rank's, or the sum overflowed)"
                         : "(no single tensor; the sum overflowed)";
}

void install(World& w, const OptimConfig& cfg) {
  auto& state = w.emplace_resource<OptimState>();
  state.moment_dtype = cfg.moments == MomentDType::bf16 ? DType::bf16 : DType::f32;
  // The gradients' dtype, before the model allocates the held buffers (params.allocate).
  w.resource<nn::ParamStore>().set_grad_dtype(cfg.grads == GradDType::bf16 ? DType::bf16 : DType::f32);
  // What a checkpoint saves: the moments (laid out like the held parameters) and the step count
  // (the bias corrections).
  auto& saved = w.resource<train::TrainingState>();
  const auto held = [&w] { return w.resource<nn::ParamStore>().held(); };
  saved.held.push_back(
      {"optimizer/exp_avg", [&state, held] { return state.m.view(state.moment_dtype, {held()}); }, state.moment_dtype});
  saved.held.push_back({"optimizer/exp_avg_sq", [&state, held] { return state.v.view(state.moment_dtype, {held()}); },
                        state.moment_dtype});
  saved.counters.push_back({"optimizer.steps", [&state] { return state.steps_taken; },
                            [&state](std::int64_t v) { state.steps_taken = v; }});
  // The moments of what this rank holds, once the parameters are laid out.
  w.systems().add({"optim.setup", Phase::setup,
                   [](World& world) {
                     auto& be = world.resource<ops::ActiveBackend>().get();
                     const auto& store = world.resource<nn::ParamStore>();
                     auto& st = world.resource<OptimState>();
                     const std::size_t bytes = static_cast<std::size_t>(store.held()) * size_of(st.moment_dtype);
                     st.m = be.alloc(bytes);
                     st.v = be.alloc(bytes);
                     be.zero(st.m.view(st.moment_dtype, {store.held()}));
                     be.zero(st.v.view(st.moment_dtype, {store.held()}));
                     st.scalars = be.alloc(OptimState::kSumSquaresAt + sizeof(float));
                     st.scalars_host = be.alloc_host(st.scalars.bytes());
                   },
                   {"params.allocate"}});

  // The step's numbers go up at its beginning (outside a captured step's graph, StepGraph, which
  // replays the optimizer below): the learning rate and the bias corrections of step t, counted once
  // the step before was known finite (optim.check).
  w.systems().add({"optim.numbers", Phase::step_begin, [cfg](World& world) {
                     auto& be = world.resource<ops::ActiveBackend>().get();
                     auto& st = world.resource<OptimState>();
                     const auto lr = step_learning_rate(world, cfg);
                     float numbers[ops::kAdamWScalars] = {lr, 1.0f, 0.0f, 0.0f};
                     ops::adamw_bias_corrections(cfg.beta1, cfg.beta2, st.steps_taken + 1, numbers[ops::kAdamWBc1],
                                                 numbers[ops::kAdamWBc2]);
                     be.copy(TensorView(st.scalars.data(), {ops::kAdamWScalars}, DType::f32, be.device()),
                             TensorView(numbers, {ops::kAdamWScalars}, DType::f32, Device::cpu));
                     world.resource<train::TrainState>().lr = lr;
                   }});

  // The step on the stream, without waiting for the device: the gradient's norm and clipping scale
  // are made on the device (ops::GradClip; where ranks share the gradient, from the squares each
  // sums, all-reduced on the stream), and every AdamW kernel reads them and the step's numbers from
  // there when it runs (a non-finite norm makes the scale NaN: nothing is updated). So it is
  // replayable by a captured step; the host values below (the learning rate, t) are the CPU
  // backend's, or unused.
  w.systems().add({.name = "optim.step", .phase = Phase::optimizer, .run = [cfg](World& world) {
                     auto& be = world.resource<ops::ActiveBackend>().get();
                     auto& store = world.resource<nn::ParamStore>();
                     auto& st = world.resource<OptimState>();
                     const std::int64_t t = st.steps_taken + 1;  // counted once the step is known finite
                     const auto lr = step_learning_rate(world, cfg);
                     const Device dev = be.device();
                     auto* scalars = static_cast<float*>(st.scalars.data());
                     auto* norm = reinterpret_cast<double*>(static_cast<char*>(st.scalars.data()) + OptimState::kNormAt);
                     if (norm_of_held_buffer(world)) {
                       be.grad_clip({store.grads_flat(), cfg.grad_clip, scalars, norm});
                     } else {
                       const TensorView sum(static_cast<char*>(st.scalars.data()) + OptimState::kSumSquaresAt, {1},
                                            DType::f32, dev);
                       global_sum_squares(world, be, sum);
                       be.grad_clip({.max_norm = cfg.grad_clip, .scalars = scalars, .norm = norm,
                                     .sum_squares = sum.as<float>()});
                     }
                     ops::AdamW a;
                     a.params = store.master_flat();
                     a.params_act = store.compute_flat();
                     a.grads = store.grads_flat();
                     a.m = st.m.view(st.moment_dtype, {store.held()});
                     a.v = st.v.view(st.moment_dtype, {store.held()});
                     // At the first step, once every module has said which parameters it updates
                     // itself (nn::UpdatedBy, during install or setup).
                     if (st.segments.empty()) st.segments = segments(world);
                     a.segments = st.segments;
                     a.lr = lr;
                     a.beta1 = cfg.beta1;
                     a.beta2 = cfg.beta2;
                     a.eps = cfg.eps;
                     a.weight_decay = cfg.weight_decay;
                     a.step = t;
                     a.scalars = scalars;
                     be.adamw(a);
                     // The parameters another module updates (nn::UpdatedBy), with the same step.
                     world.events().publish(
                         nn::AdamWStep{t, lr, a.beta1, a.beta2, a.eps, a.weight_decay, scalars, a.m, a.v});
                   }, .replayable = true});
  // After the step (one read of the norm and scale, with the step's other reads): the norm for the
  // log, and a non-finite gradient stops the run naming the tensors, the weights as they were. After
  // the model's loss check where there is one, which names a non-finite loss first.
  std::vector<std::string> check_after;
  if (w.systems().has("model.loss")) check_after.emplace_back("model.loss");
  // The copy queued behind the step's work, before the step's synchronisation where the model has
  // one (model.sync), so the read after it waits for nothing.
  std::vector<std::string> read_before;
  if (w.systems().has("model.sync")) read_before.emplace_back("model.sync");
  w.systems().add({"optim.read", Phase::step_end,
                   [](World& world) {
                     auto& be = world.resource<ops::ActiveBackend>().get();
                     auto& st = world.resource<OptimState>();
                     const auto bytes = static_cast<std::int64_t>(st.scalars.bytes());
                     be.copy_to_host_async(TensorView(st.scalars_host.data(), {bytes}, DType::u8, Device::cpu),
                                           TensorView(st.scalars.data(), {bytes}, DType::u8, be.device()));
                   },
                   {},
                   read_before});
  check_after.emplace_back("optim.read");
  w.systems().add({"optim.check", Phase::step_end,
                   [](World& world) {
                     auto& be = world.resource<ops::ActiveBackend>().get();
                     auto& st = world.resource<OptimState>();
                     be.synchronize();  // optim.read's copy (the stream is idle by now where model.sync ran)
                     const auto* host = static_cast<const unsigned char*>(st.scalars_host.data());
                     double norm = 0;
                     std::memcpy(&st.grad_scale, host + ops::kAdamWGradScale * sizeof(float), sizeof(float));
                     std::memcpy(&norm, host + OptimState::kNormAt, sizeof(double));
                     world.resource<train::TrainState>().grad_norm = norm;
                     if (!std::isfinite(norm))
                       KILN_THROW("step ", world.resource<RunControl>().step, ": non-finite gradient in ",
                                  non_finite_gradients(world, be), "; stopping");
                     ++st.steps_taken;
                   },
                   check_after,
                   {"train.step_end"}});
}

}  // namespace

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<OptimConfig>("optim", "AdamW with a warm-up + cosine schedule and gradient clipping",
                                        {"model"}, install));
}

}  // namespace kiln::optim
