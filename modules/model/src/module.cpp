#include "kiln/model/module.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <iostream>

#include "activation_report.hpp"
#include "init_from.hpp"
#include "kiln/model/gpt.hpp"
#include "kiln/model/hf.hpp"
#include "kiln/model/spec.hpp"
#include "kiln/model/step_graph.hpp"
#include "kiln/parallel/pipeline_split.hpp"
#include "kiln/nn/param_store.hpp"
#include "sample.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/rng/module.hpp"
#include "kiln/train/state.hpp"
#include "kiln/train/train.hpp"

namespace kiln::model {

namespace {

// Subscriptions live as long as the World.
struct ModelHooks {
  Subscription evaluate, sample;
};

// The step's zeroing of the gradient accumulation: per unit whose gradients are where the step
// accumulates them (ParamStore::unit_grads), every range but the gradients their first micro-batch
// writes (nn::GradWrittenFirst); ranges that meet in memory are zeroed together.
void zero_grads(nn::ParamStore& store, ops::Backend& be, const std::vector<std::vector<nn::UnitRange>>& ranges) {
  // The runs of adjacent ranges, zeroed together (one launch on CUDA).
  const DType d = store.unit_grad_dtype();
  const std::size_t elem = size_of(d);
  std::vector<TensorView> runs;
  char* run = nullptr;
  std::int64_t n = 0;
  auto flush = [&] {
    if (n > 0) runs.push_back(TensorView(run, {n}, d, store.device()));
    n = 0;
  };
  for (std::size_t u = 0; u < ranges.size(); ++u) {
    auto* base = static_cast<char*>(store.unit_grads(u));
    if (!base) continue;
    for (const auto& r : ranges[u]) {
      char* at = base + static_cast<std::size_t>(r.begin) * elem;
      if (n > 0 && run + static_cast<std::size_t>(n) * elem == at) {
        n += r.size();
        continue;
      }
      flush();
      run = at;
      n = r.size();
    }
  }
  flush();
  be.zero_many(runs);
}

// What of a mixture of experts does not run, as config errors naming the key: expert parallelism
// without experts or with experts that do not split, and weights from Hugging Face GPT-2 files
// (dense MLPs).
void check_moe_layout(World& w, const ModelConfig& cfg) {
  // Expert parallelism splits the experts: it needs some, and as many on every rank.
  const int ep = w.resource<parallel::ParallelState>().ep_size();
  if (ep > 1 && !cfg.moe.enabled())
    throw config_error(w, "parallel.ep",
                       cat("is ", ep, ", but the model has no mixture of experts (model.moe.n_experts = 0): set it to 1"));
  if (ep > 1 && cfg.moe.n_experts % ep != 0)
    throw config_error(w, "parallel.ep",
                       cat(ep, " does not divide model.moe.n_experts = ", cfg.moe.n_experts,
                           " (each expert-parallel rank holds n_experts / ep of them)"));
  if (!cfg.moe.enabled()) return;
  if (!cfg.init_from.empty())
    throw config_error(w, "model.init_from",
                       "reads Hugging Face weights with dense MLPs; this model has a mixture of experts");
}

// This rank's stage of the model (parallel.pp > 1): the blocks split into pp x vpp chunks, balanced by
// their FLOPs (the head's counted on the last) or as parallel.pp_layers says, and the rank's
// schedule over the step's micro-batches. Bad splits are config errors naming the key. One stage:
// the whole model, one chunk.
PipelinePlan pipeline_plan(World& w, const ModelConfig& cfg, int micro_batches, int T) {
  const auto& par = w.resource<parallel::ParallelState>();
  const parallel::PipelineShape shape{par.pp_size(), par.vpp, micro_batches};
  PipelineLayers split = pipeline_layers(cfg, T, shape, par.pp_layers);
  if (!split.problem.empty()) throw config_error(w, split.key, split.problem);
  if (shape.pp == 1) return PipelinePlan::single(cfg.n_layer, micro_batches);
  return PipelinePlan::make(shape, par.coords.pp, split.layers);
}

// model.init_from names weights of this architecture (a Llama's come in a Hugging Face directory).
void check_init_from(World& w, const ModelConfig& cfg) {
  if (cfg.init_from.empty()) return;
  HfModelPath path;
  try {
    path = classify_hf_path(cfg.init_from);
  } catch (const Error& e) {
    throw config_error(w, "model.init_from", e.what());
  }
  const bool llama = path.kind == HfModelPath::Kind::llama_dir;
  if (llama != cfg.llama())
    throw config_error(w, "model.init_from",
                       cat(cfg.init_from, " holds ", llama ? "a Llama" : "GPT-2 weights", ", but model.arch is ",
                           cfg.llama() ? "llama (a Llama starts from a Hugging Face directory)" : "gpt2"));
}

// The parts' state that is neither parameter nor activation (routers' balancing biases) in
// training-state checkpoints: the same on every rank, so any rank's copy restores it.
void save_part_state(World& w, GptModel& model) {
  if (model.part_state_size() == 0) return;
  w.resource<train::TrainingState>().blobs.push_back(
      {"model.parts",
       [&model] {
         const std::vector<float> v = model.part_state();
         return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
       },
       [&model](const train::SavedBlobs& saved) -> std::function<void()> {
         const std::size_t want = model.part_state_size();
         if (saved.all.empty())
           KILN_FILE_ERROR("checkpoint ", saved.checkpoint, " holds no 'model.parts' state (the routers' balancing "
                           "biases) for this model's ", want, " values");
         const std::string& bytes = saved.own ? *saved.own : saved.all.front();
         if (bytes.size() != want * sizeof(float))
           KILN_FILE_ERROR("checkpoint ", saved.checkpoint, ": 'model.parts' holds ", bytes.size() / sizeof(float),
                           " values, this model's parts need ", want, " (another model shape?)");
         std::vector<float> v(want);
         std::memcpy(v.data(), bytes.data(), bytes.size());
         return [&model, v] { model.set_part_state(v); };
       }});
}

// The parameter store's held buffers on the backend: master and gradients (in the store's gradient
// dtype) zeroed (padding stays zero).
nn::HeldBuffers held_buffers(ops::Backend& be, const nn::ParamStore& store) {
  const std::int64_t held = store.held();
  const auto n = static_cast<std::size_t>(held);
  nn::HeldBuffers b{be.alloc(n * 4), be.alloc(store.held_compute_bytes(be.act_dtype())),
                    be.alloc(n * size_of(store.grad_dtype())), be.act_dtype(), be.stream()};
  be.zero(b.master.view(DType::f32, {held}));
  be.zero(b.grads.view(store.grad_dtype(), {held}));
  return b;
}

void install(World& w, const ModelConfig& cfg) {
  const auto& par = w.resource<parallel::ParallelState>();
  const auto& tc = w.resource<train::TrainConfig>();
  auto& ts = w.resource<train::TrainState>();
  if (tc.seq_len > cfg.max_seq_len)
    throw config_error(w, "train.seq_len", cat(tc.seq_len, " exceeds model.max_seq_len = ", cfg.max_seq_len));
  // What the model splits over the tensor-parallel group, before any rank allocates anything.
  const int tp = par.tp_size();
  for (const auto& problem : parallel::check_splits(
           tp, tensor_parallel_splits(cfg, ts.micro_batch_size * tc.seq_len, par.sequence_parallel_applies(),
                                      par.vocab_parallel_applies())))
    throw config_error(w, problem.key, problem.message);
  check_moe_layout(w, cfg);
  check_init_from(w, cfg);
  PipelinePlan plan = pipeline_plan(w, cfg, ts.micro_batches, static_cast<int>(tc.seq_len));
  if (plan.pipelined()) {
    StepPasses order;
    for (const auto& a : plan.passes)
      order.passes.push_back({a.kind == parallel::PipelineAction::Kind::forward, a.micro_batch, a.chunk});
    w.emplace_resource<StepPasses>(std::move(order));
  }
  auto& model = w.emplace_resource<GptModel>(w, cfg, ts.micro_batch_size, static_cast<int>(tc.seq_len),
                                             ts.micro_batches, std::move(plan));
  model.set_loss_scale(1.0f / static_cast<float>(tc.batch_size * tc.seq_len));
  ts.flops_per_token = model.flops_per_token();
  ts.peak_flops = w.resource<ops::ActiveBackend>().get().peak_bf16_flops();

  auto& hooks = w.emplace_resource<ModelHooks>();
  hooks.evaluate = w.events().subscribe<train::EvaluationRequested>([&w](const train::EvaluationRequested&) {
    auto& val = w.resource<train::ValidationSet>();
    if (val.batches.empty())
      KILN_THROW("a validation loss was requested (log.val_every) but there is no validation data (data.val_files)");
    w.resource<train::TrainState>().val_loss = w.resource<GptModel>().evaluate(val.batches);
  });

  hooks.sample = w.events().subscribe<train::SampleRequested>([&w, cfg](const train::SampleRequested& e) {
    const std::string text = sample_text(w, cfg, e);
    if (!text.empty()) w.resource<train::TrainState>().sample = text;
  });

  // The parameters' flat buffers, laid out now that every module has said how (a module that
  // shards them orders its planning before this system, one that uses them after it).
  w.systems().add({"params.allocate", Phase::setup, [moe = cfg.moe.enabled()](World& world) {
                     auto& store = world.resource<nn::ParamStore>();
                     // The experts' grouped linears write f32 gradients.
                     if (moe && store.grad_dtype() == DType::bf16)
                       throw config_error(world, "optim.grads",
                                          "is \"bf16\", which a mixture of experts (model.moe.n_experts > 0) does "
                                          "not support yet (its grouped linears write f32 gradients): use "
                                          "optim.grads = \"f32\"");
                     store.lay_out(world);
                     store.allocate(held_buffers(world.resource<ops::ActiveBackend>().get(), store));
                   }});
  w.systems().add({"model.init", Phase::setup, [](World& world) {
                     auto& m = world.resource<GptModel>();
                     m.allocate_activations();  // after every module attached its components
                     world.emplace_resource<nn::BlockScratch>(m.block_scratch());
                     m.initialise(world.resource<rng::RngStatesTracker>());
                     // Counted over the pipeline stages: every rank takes part.
                     const std::int64_t total = m.parameter_count(), active = m.active_parameter_count();
                     if (world.resource<RankInfo>().rank == 0) {
                       std::cout << "model: " << total << " parameters"
                                 << (active < total ? cat(" (", active, " active per token)") : std::string()) << " on "
                                 << world.resource<ops::ActiveBackend>().get().name() << ", activation memory "
                                 << std::fixed << std::setprecision(3)
                                 << static_cast<double>(m.activation_bytes()) / (1 << 30) << " GiB\n"
                                 << std::defaultfloat;
                       if (world.resource<ModelConfig>().report_activations)
                         std::cout << activation_report(m.activation_table(), m.residual_stream());
                     }
                   },
                   {"params.allocate"}});
  if (const auto* backend = w.try_resource<ops::BackendConfig>(); backend && backend->cuda_graph)
    w.systems().add({"model.cuda_graph", Phase::setup, [](World& world) { StepGraph::install(world); }, {"model.init"}});
  if (!cfg.init_from.empty())
    w.systems().add({"model.init_from", Phase::setup,
                     [cfg](World& world) { load_initial_weights(world, cfg, cfg.init_from); }, {"model.init"}});
  // Every gradient but those their first micro-batch writes (the model marked them
  // nn::GradWrittenFirst as it made its parameters, above): the gaps between them.
  w.systems().add({"model.zero_grad", Phase::step_begin, [ranges = std::vector<std::vector<nn::UnitRange>>()](
                                                              World& world) mutable {
                     auto& store = world.resource<nn::ParamStore>();
                     if (ranges.empty()) ranges = store.grad_zero_ranges(world);
                     zero_grads(store, world.resource<ops::ActiveBackend>().get(), ranges);
                   }});
  // The micro-batch's tokens go up in the data phase, after whatever filled the batch; the forward
  // phase is device work alone (what a captured step replays, StepGraph).
  w.systems().add({"model.load_batch", Phase::data,
                   [](World& world) {
                     world.resource<GptModel>().load(world.resource<train::Batch>(),
                                                     world.resource<RunControl>().micro_batch, true,
                                                     &world.resource<rng::RngStatesTracker>());
                   },
                   {kAllSystems}});
  // Device work alone (what a captured step replays, StepGraph); what differs between steps reaches
  // the device outside them (the tokens above, the RNG's base offsets).
  w.systems().add({.name = "model.forward",
                   .phase = Phase::forward,
                   .run = [](World& world) {
                     const auto& ctl = world.resource<RunControl>();
                     world.resource<GptModel>().forward_pass(ctl.micro_batch, ctl.chunk,
                                                             &world.resource<rng::RngStatesTracker>());
                   },
                   .replayable = true});
  w.systems().add({.name = "model.backward",
                   .phase = Phase::backward,
                   .run = [](World& world) {
                     const auto& ctl = world.resource<RunControl>();
                     world.resource<GptModel>().backward_pass(ctl.micro_batch, ctl.chunk);
                   },
                   .replayable = true});
  // The loss is read (and checked) at the step's end, with its other reads (no wait for the device
  // between the backward pass and the optimizer), before optim.check reads the gradient's norm: a
  // non-finite loss is reported as such rather than as non-finite gradients, and its non-finite
  // gradients made the optimizer write nothing (ops::AdamW::scalars).
  // The losses' copy to the host is queued behind the step's device work before the step's one
  // synchronisation (model.sync), so reading them costs no round trip of its own.
  w.systems().add({"model.loss_read", Phase::step_end,
                   [](World& world) {
                     world.resource<GptModel>().queue_loss_read(world.resource<train::TrainState>().micro_batches);
                   },
                   {},
                   {"model.sync"}});
  w.systems().add({"model.loss", Phase::step_end, [](World& world) {
                     auto& ts = world.resource<train::TrainState>();
                     ts.loss = world.resource<GptModel>().mean_loss(ts.micro_batches);
                     if (!std::isfinite(ts.loss))
                       KILN_THROW("step ", world.resource<RunControl>().step, ": the loss is ", ts.loss,
                                  " (non-finite); stopping");
                   },
                   {"model.sync"},
                   {"train.step_end"}});
  save_part_state(w, model);
  // The parts' numbers of the step (a mixture of experts' losses and loads) for the metrics; the
  // routers' balancing biases move by them.
  w.systems().add({"model.metrics", Phase::step_end,
                   [](World& world) {
                     world.resource<train::TrainState>().metrics = world.resource<GptModel>().step_metrics();
                   },
                   {},
                   {"train.step_end"}});
  // The step's device work (the optimizer) finishes before the step timer stops. The memory in use
  // (cudaMemGetInfo: ~75 us on an H200, with the GPU idle) is read over the first steps, where the
  // buffers reach their sizes, then every tenth step and at the last.
  w.systems().add({"model.sync", Phase::step_end,
                   [](World& world) {
                     auto& be = world.resource<ops::ActiveBackend>().get();
                     be.synchronize();
                     auto& ts = world.resource<train::TrainState>();
                     const std::int64_t step = world.resource<RunControl>().step;
                     if (step <= 5 || step % 10 == 0 || step >= world.resource<train::TrainConfig>().steps)
                       ts.peak_device_memory = std::max(ts.peak_device_memory, be.device_memory_in_use());
                   },
                   {},
                   {"train.step_end"}});
}

}  // namespace

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<ModelConfig>("model",
                                        "the transformer (GPT-2 or Llama blocks): entities, flat parameters, "
                                        "forward/backward",
                                        {"backend", "train", "rng", "parallel"}, install, complete_from_hf));
}

}  // namespace kiln::model
