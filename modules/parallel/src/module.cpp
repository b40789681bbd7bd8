#include "kiln/parallel/module.hpp"

#include <algorithm>
#include <map>

#include "kiln/engine/engine_module.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/grad_buckets.hpp"
#include "kiln/train/layout.hpp"

#ifdef KILN_WITH_CUDA
#include "kiln/parallel/copy_engine.hpp"
#include "kiln/parallel/nccl.hpp"
#endif

namespace kiln::parallel {

namespace {

// Context parallelism exists as ranks (the topology, the groups, the seeds) but nothing runs it yet:
// a larger size would silently train the same model on every rank. (Pipeline stages are the model
// module's, expert parallelism runs where the model has experts; the model module checks both.)
void refuse_parallelisms_that_do_not_run(World& w, const ParallelConfig& cfg) {
  if (cfg.cp > 1)
    throw config_error(w, "parallel.cp",
                       cat("is ", cfg.cp, ", but context parallelism does not run yet (every rank would train the "
                           "whole sequence); set it to 1 (`kiln topology FILE --world N` still shows the groups of "
                           "such a layout)"));
}

// World resource with NCCL: the watchdog's timing of replayed passes' collectives.
struct ReplayWatch {
  Subscription on_replayed;
};

// The other stage's gradient of a tied parameter, on its way (parallel.tied_grad_sync).
struct TiedGradScratch {
  Buffer buf;
};

void sum_tied_gradients(World& w) {
  const auto* store = w.try_resource<nn::ParamStore>();
  auto* scratch = w.try_resource<TiedGradScratch>();
  if (!store || !scratch) return;
  const PipelineParallel pipe = pipeline_parallel(w);
  ops::Backend& be = w.resource<ops::ActiveBackend>().get();
  for (Entity e : store->order()) {
    const auto* tied = w.try_get<nn::TiedAcrossStages>(e);
    if (!tied) continue;
    const auto& p = w.get<nn::Param>(e);
    store->for_each_held(p, [&](const nn::HeldPart& part) {
      const TensorView grad = nn::ParamStore::held_view(store->grads_flat(), part);
      if (scratch->buf.bytes() < grad.bytes()) scratch->buf = be.alloc(grad.bytes());
      const TensorView other(scratch->buf.data(), grad.shape, grad.dtype, grad.device);
      pipe.sum_with(tied->peer, grad, other, store->stream(), cat("sum of '", p.name, "''s gradient over its stages"),
                    [&be](const TensorView& into, const TensorView& from) { be.add(into, from); });
    });
  }
}

// The partial gradients of sequence parallelism's replicated parameters (nn::Param::tp_partial_grad),
// summed over the TP group in one all-reduce: the runs of consecutive held elements they occupy in the
// gradient buffer are packed into scratch, reduced, and copied back (a single run is reduced in place).
// Elementwise sums, so the values are those of one all-reduce per parameter.
struct TpGradScratch {
  std::vector<nn::HeldPart> runs;  // [held, held + count) of grads_flat; found at the first step
  bool planned = false;
  Buffer buf;
};

void sum_tp_partial_gradients(World& w) {
  auto& c = w.resource<Communicators>();
  const auto* store = w.try_resource<nn::ParamStore>();
  auto* scratch = w.try_resource<TpGradScratch>();
  if (c.tp->size() == 1 || !store || !scratch) return;  // no parameters: nothing to reduce
  const TensorView grads = store->grads_flat();
  if (!scratch->planned) {
    for (Entity e : store->order()) {
      const auto& p = w.get<nn::Param>(e);
      if (!p.tp_partial_grad) continue;
      store->for_each_held(p, [&](const nn::HeldPart& part) {
        auto& runs = scratch->runs;
        if (!runs.empty() && runs.back().held + runs.back().count == part.held)
          runs.back().count += part.count;
        else
          runs.push_back(part);
      });
    }
    scratch->planned = true;
  }
  const auto& runs = scratch->runs;
  if (runs.empty()) return;
  if (runs.size() == 1) {
    c.tp->all_reduce(nn::ParamStore::held_view(grads, runs[0]), ReduceOp::sum, store->stream());
    return;
  }
  std::int64_t total = 0;
  for (const auto& r : runs) total += r.count;
  ops::Backend& be = w.resource<ops::ActiveBackend>().get();
  const std::size_t bytes = static_cast<std::size_t>(total) * size_of(grads.dtype);
  if (scratch->buf.bytes() < bytes) scratch->buf = be.alloc(bytes);
  const TensorView packed(scratch->buf.data(), Shape{total}, grads.dtype, grads.device);
  std::int64_t at = 0;
  for (const auto& r : runs) {
    be.copy(packed.flat_slice(at, r.count), nn::ParamStore::held_view(grads, r));
    at += r.count;
  }
  c.tp->all_reduce(packed, ReduceOp::sum, store->stream());
  at = 0;
  for (const auto& r : runs) {
    be.copy(nn::ParamStore::held_view(grads, r), packed.flat_slice(at, r.count));
    at += r.count;
  }
}

// The data-parallel gradient buckets, planned at their first use (the parameters are laid out in
// Phase::setup): one bucket run per group of consecutive units. Under expert parallelism each unit's
// dense gradients (summed over every data-parallel rank) and its experts' (summed over the ranks
// holding the same experts) go to two bucket sets. Null without buckets (parallel.dp_bucket_mb = 0
// and no experts: one all-reduce of everything).
DpGradSync* dp_buckets(World& w) {
  auto& st = w.resource<DpGradState>();
  if (st.sync || w.try_resource<ShardedParameters>()) return st.sync.get();
  const auto* store = w.try_resource<nn::ParamStore>();
  if (!store || !store->laid_out()) return nullptr;
  std::vector<UnitSpan> dense, experts;
  for (int u = 0; u < store->num_units(); ++u) {
    std::int64_t split = store->unit(u).end;  // where the unit's expert groups begin
    for (const auto& g : store->groups(u))
      if (g.domain == nn::ShardDomain::expert) split = std::min(split, g.begin);
    if (split > store->unit(u).begin) dense.push_back({u, store->unit(u).begin, split});
    if (store->unit(u).end > split) experts.push_back({u, split, store->unit(u).end});
  }
  if (st.bucket_mb <= 0 && experts.empty()) return nullptr;
  const auto elems = static_cast<std::int64_t>(st.bucket_mb * 1e6 / static_cast<double>(size_of(store->grad_dtype())));
  auto& comms = w.resource<Communicators>();
  const bool bridge = experts.empty();  // the gaps between dense spans are padding only
  st.sync = std::make_shared<DpGradSync>(*comms.dp, store->grads_flat(), plan_buckets(dense, elems, bridge),
                                         store->stream());
  if (!experts.empty())
    st.expert_sync = std::make_shared<DpGradSync>(*comms.edp, store->grads_flat(), plan_buckets(experts, elems, false),
                                                  store->stream());
  return st.sync.get();
}

void install(World& w, const ParallelConfig& cfg) {
  refuse_parallelisms_that_do_not_run(w, cfg);
  const auto& r = w.resource<RankInfo>();
  // Expert parallelism is carved out of data parallelism (topology.hpp).
  const long long model_ranks = 1LL * cfg.tp * cfg.pp * cfg.cp;
  const long long data_ranks = cfg.dp > 0 ? cfg.dp : (r.world_size % model_ranks == 0 ? r.world_size / model_ranks : 0);
  if (data_ranks > 0 && data_ranks % cfg.ep != 0)
    throw config_error(w, "parallel.ep",
                       cat(cfg.ep, " does not divide the ", data_ranks, " data-parallel ranks (", r.world_size,
                           " ranks / tp ", cfg.tp, "; expert parallelism is carved out of data parallelism)"));
  Topology topo = [&] {
    try {
      return Topology(r.world_size, cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.dp);
    } catch (const Error& e) {
      throw config_error(w, cfg.dp > 0 ? "parallel.dp" : "parallel.tp", cat(e.what(), " (", r.world_size, " ranks)"));
    }
  }();
  const Coords at = topo.coords(r.rank);
  w.emplace_resource<ParallelState>(
      ParallelState{topo, r.rank, at, cfg.sequence_parallel, cfg.vocab_parallel, cfg.vpp, cfg.pp_layers,
                    cfg.tp_comm_overlap, cfg.tp_comm_chunks, cfg.tp_comm_sms});
  const Sizes n = topo.sizes();
  const auto& state = w.resource<ParallelState>();
  w.emplace_resource<train::ParallelLayout>(train::ParallelLayout{n.world(), n.tp, n.cp, n.ep, state.dp_size(), n.pp,
                                                                  at.tp, at.cp, at.ep, state.dp_rank(), at.pp});

  auto& comms = w.emplace_resource<Communicators>();
  // Every rank creates its groups in the same order (NCCL splits are collective over the world).
  auto make = [&](const std::string& name, std::initializer_list<Axis> axes) {
    return make_group(w, name, topo.group_index(r.rank, axes), topo.group(r.rank, axes));
  };
  comms.world = make("world", {Axis::tp, Axis::cp, Axis::ep, Axis::dp, Axis::pp});
  comms.tp = make("tp", {Axis::tp});
  comms.dp = make("dp", {Axis::ep, Axis::dp});
  comms.tp_dp = make("tp_dp", {Axis::tp, Axis::ep, Axis::dp});
  comms.ep = make("ep", {Axis::ep});
  comms.tp_ep = make("tp_ep", {Axis::tp, Axis::ep});
  comms.edp = make("expert_dp", {Axis::dp});
#ifdef KILN_WITH_CUDA
  if (auto* launch = w.try_resource<LaunchContext>(); cfg.copy_engine && launch && launch->nccl) {
    // Collective over each group, in the same order on every rank.
    CopyEngineOptions o;
    o.timeout_s = cfg.timeout_s + 10;  // the watchdog names a stuck call first
    for (auto* c : {&comms.tp, &comms.ep, &comms.dp, &comms.edp})
      if ((*c)->size() > 1) *c = make_copy_engine_communicator(std::move(*c), launch->nccl, o);
  }
#endif
  comms.self = make_self_communicator("self", r.rank);
  comms.pp = make("pp", {Axis::pp});
  if (n.pp > 1) {
    comms.tp_pp = make("tp_pp", {Axis::tp, Axis::pp});
    comms.tp_ep_pp = make("tp_ep_pp", {Axis::tp, Axis::ep, Axis::pp});
  }
#ifdef KILN_WITH_CUDA
  // A job aborted between collectives (a rank died) stops at the end of the step at the latest.
  if (auto* launch = w.try_resource<LaunchContext>(); launch && launch->nccl) {
    w.systems().add({"parallel.check", Phase::step_end,
                     [nccl = launch->nccl](World&) { nccl->check(); }});
    // Collectives inside captured passes (backend.cuda_graph) are timed per replay, as one.
    w.emplace_resource<ReplayWatch>().on_replayed = w.events().subscribe<nn::PassesReplayed>(
        [&w, nccl = launch->nccl](const nn::PassesReplayed& e) {
          nccl->track(w.resource<ops::ActiveBackend>().get().stream(),
                      cat("the collectives of micro-batch ", e.micro_batch, "'s replayed forward and backward",
                          e.through_optimizer ? ", gradient sync and optimizer step" : ""));
        });
  }
#endif

  // Sequence parallelism: parameters replicated over TP but fed by this rank's tokens only have
  // partial gradients; they are summed over the TP group once per step, after the DP sync (the sums
  // commute; the DP buckets may still be reducing these gradients on the communication stream until
  // parallel.dp_grad_sync has made the compute stream wait for them). One all-reduce for all of them
  // (sum_tp_partial_gradients): a 1.3B model has 98 such vectors, and a collective each cost ~10 ms a
  // step on two H200s.
  // Replayable by a captured step (StepGraph): the copies and the all-reduce are queued on the compute
  // stream, into scratch made at the first (eager) step.
  if (n.tp > 1) w.emplace_resource<TpGradScratch>();
  w.systems().add({.name = "parallel.tp_grad_sync",
                   .phase = Phase::grad_sync,
                   .run = sum_tp_partial_gradients,
                   .after = {"parallel.dp_grad_sync"},
                   .replayable = true});

  // A parameter two pipeline stages hold (nn::TiedAcrossStages: the first stage's token table and the
  // last stage's copy its tied head multiplies by) has its two gradients summed, the same sum on both,
  // as Megatron-LM all-reduces its embedding group's: after the data-parallel and tensor-parallel sums
  // (they commute), before anything reads the gradients. Nothing to do on one stage.
  if (n.pp > 1) w.emplace_resource<TiedGradScratch>();
  w.systems().add({.name = "parallel.tied_grad_sync",
                   .phase = Phase::grad_sync,
                   .run = sum_tied_gradients,
                   .after = {"parallel.dp_grad_sync", "parallel.tp_grad_sync"},
                   .replayable = n.pp == 1});

  // Data parallelism: every DP rank computed the gradients of its slice of the global batch, with
  // the loss scaled by 1 / (tokens in the global batch), so summing them gives the batch gradient.
  // In buckets during the backward pass (see grad_buckets.hpp), or all at once here. Registered
  // whatever the DP size, so other systems can order themselves after it.
  auto& dp_state = w.emplace_resource<DpGradState>();
  dp_state.bucket_mb = cfg.dp_bucket_mb;
  if (cfg.dp_bucket_mb > 0 && comms.dp->size() > 1) {
    dp_state.on_backward = w.events().subscribe<nn::LayerBackwardEnd>([&w](const nn::LayerBackwardEnd& e) {
      const auto& rc = w.resource<RunControl>();
      auto* sync = dp_buckets(w);
      if (!sync || rc.micro_batch != rc.micro_batches - 1) return;
      sync->unit_ready(e.unit);
      if (auto& experts = w.resource<DpGradState>().expert_sync) experts->unit_ready(e.unit);
    });
    // Captured passes (backend.cuda_graph): the buckets the last micro-batch's backward started are
    // part of its graph, joined into the compute stream before the capture ends; a replay started them.
    auto on_graph = [&w](int micro_batch, void (DpGradSync::*what)()) {
      const auto& rc = w.resource<RunControl>();
      if (micro_batch != rc.micro_batches - 1) return;
      auto& st = w.resource<DpGradState>();
      for (auto* sync : {st.sync.get(), st.expert_sync.get()})
        if (sync) (sync->*what)();
    };
    dp_state.on_capture_end = w.events().subscribe<nn::PassesCaptureEnd>(
        [on_graph](const nn::PassesCaptureEnd& e) { on_graph(e.micro_batch, &DpGradSync::capture_end); });
    dp_state.on_replayed = w.events().subscribe<nn::PassesReplayed>(
        [on_graph](const nn::PassesReplayed& e) { on_graph(e.micro_batch, &DpGradSync::replayed); });
  }
  w.systems().add({.name = "parallel.dp_grad_sync", .phase = Phase::grad_sync, .run = [](World& world) {
                     auto& c = world.resource<Communicators>();
                     const auto* store = world.try_resource<nn::ParamStore>();
                     // One rank, no parameters, or a module that reduces them itself (fsdp).
                     if (c.dp->size() == 1 || !store || world.try_resource<ShardedParameters>()) return;
                     if (auto* sync = dp_buckets(world)) {
                       sync->finish();
                       if (auto& experts = world.resource<DpGradState>().expert_sync) experts->finish();
                       return;
                     }
                     c.dp->all_reduce(store->grads_flat(), ReduceOp::sum, store->stream());
                   },
                   // Replayable (StepGraph): the all-reduce on the compute stream; the buckets' last
                   // launches on the communication stream, which the compute stream then waits for.
                   .replayable = true});
}

}  // namespace

std::unique_ptr<Communicator> make_group(World& w, const std::string& name, int color, const std::vector<int>& members) {
  const auto& r = w.resource<RankInfo>();
  if (members.size() == 1) return make_self_communicator(name, r.rank);
  auto* launch = w.try_resource<LaunchContext>();
#ifdef KILN_WITH_CUDA
  if (launch && launch->nccl) return launch->nccl->group(name, color, members);
#else
  (void)color;
#endif
  if (!launch || !launch->hub)
    KILN_THROW("rank ", r.rank, ": a ", members.size(), "-rank '", name, "' group needs a launcher (kiln run --nproc N)");
  return launch->hub->communicator(name, members, r.rank);
}

Communicator& param_shards(World& w) {
  if (const auto* s = w.try_resource<ShardedParameters>()) return *s->param_shards;
  // Without sharding one copy is split over TP and the pipeline stages, and under expert parallelism
  // the experts over EP too.
  auto& c = w.resource<Communicators>();
  const auto& par = w.resource<ParallelState>();
  if (par.pp_size() > 1) return par.ep_size() > 1 ? *c.tp_ep_pp : *c.tp_pp;
  return par.ep_size() > 1 ? *c.tp_ep : *c.tp;
}

int replicas_in_param_shards(World& w, const nn::Param& p) {
  const auto& par = w.resource<ParallelState>();
  int n = p.shard.sharded() ? 1 : par.tp_size();  // a whole tensor on every TP rank
  // Unsharded under expert parallelism, a dense parameter is the same on every rank of the EP group.
  if (par.ep_size() > 1 && !p.expert_parallel && !w.try_resource<ShardedParameters>()) n *= par.ep_size();
  return n;
}

Communicator& held_parts(World& w) {
  if (const auto* s = w.try_resource<ShardedParameters>()) return *s->held_parts;
  return *w.resource<Communicators>().self;
}

TensorParallel tensor_parallel(World& w, ops::Backend& backend) {
  const auto& par = w.resource<ParallelState>();
  return TensorParallel(*w.resource<Communicators>().tp, backend,
                        {par.sequence_parallel, par.vocab_parallel, par.tp_comm_overlap, par.tp_comm_chunks,
                         par.tp_comm_sms});
}

DataParallel data_parallel(World& w) { return DataParallel(*w.resource<Communicators>().dp); }

PipelineParallel pipeline_parallel(World& w) { return PipelineParallel(*w.resource<Communicators>().pp); }

ExpertParallel expert_parallel(World& w, ops::Backend& backend, int n_experts) {
  return ExpertParallel(*w.resource<Communicators>().ep, backend, n_experts);
}

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<ParallelConfig>(
      "parallel", "topology, communicators and data-parallel gradient averaging", {}, install));
}

}  // namespace kiln::parallel
