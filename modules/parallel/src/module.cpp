#include "kiln/parallel/module.hpp"

#include <algorithm>
#include <map>

#include "kiln/engine/engine_module.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/parallel/grad_buckets.hpp"
#include "kiln/train/layout.hpp"

#ifdef KILN_WITH_CUDA
#include "kiln/parallel/nccl.hpp"
#endif

namespace kiln::parallel {

namespace {

// Pipeline, context and expert parallelism exist as ranks (the topology, the groups, the seeds) but
// nothing runs them yet: larger sizes would silently train the same model on every stage.
void refuse_parallelisms_that_do_not_run(World& w, const ParallelConfig& cfg) {
  const std::pair<const char*, int> sizes[] = {{"pp", cfg.pp}, {"cp", cfg.cp}, {"ep", cfg.ep}};
  const char* what[] = {"pipeline", "context", "expert"};
  for (std::size_t i = 0; i < 3; ++i)
    if (sizes[i].second > 1)
      throw config_error(w, cat("parallel.", sizes[i].first),
                         cat("is ", sizes[i].second, ", but ", what[i],
                             " parallelism does not run yet (every stage would train the whole model); set it to "
                             "1 (`kiln topology FILE --world N` still shows the groups of such a layout)"));
}

// The data-parallel gradient buckets, planned at their first use (the parameters are laid out in
// Phase::setup): one bucket run per group of consecutive units. Null without buckets.
DpGradSync* dp_buckets(World& w) {
  auto& st = w.resource<DpGradState>();
  if (st.sync || st.bucket_mb <= 0 || w.try_resource<ShardedParameters>()) return st.sync.get();
  const auto* store = w.try_resource<nn::ParamStore>();
  if (!store || !store->laid_out()) return nullptr;
  std::vector<UnitSpan> spans;
  for (int u = 0; u < store->num_units(); ++u)
    if (store->unit(u).size() > 0) spans.push_back({u, store->unit(u).begin, store->unit(u).end});
  const auto elems = static_cast<std::int64_t>(st.bucket_mb * 1e6 / 4);
  st.sync = std::make_shared<DpGradSync>(*w.resource<Communicators>().dp, store->grads_flat(),
                                         plan_buckets(spans, elems), store->stream());
  return st.sync.get();
}

void install(World& w, const ParallelConfig& cfg) {
  refuse_parallelisms_that_do_not_run(w, cfg);
  const auto& r = w.resource<RankInfo>();
  Topology topo = [&] {
    try {
      return Topology(r.world_size, cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.dp);
    } catch (const Error& e) {
      throw config_error(w, cfg.dp > 0 ? "parallel.dp" : "parallel.tp", cat(e.what(), " (", r.world_size, " ranks)"));
    }
  }();
  const Coords at = topo.coords(r.rank);
  w.emplace_resource<ParallelState>(ParallelState{topo, r.rank, at, cfg.sequence_parallel, cfg.vocab_parallel});
  const Sizes n = topo.sizes();
  w.emplace_resource<train::ParallelLayout>(
      train::ParallelLayout{n.world(), n.tp, n.cp, n.ep, n.dp, n.pp, at.tp, at.cp, at.ep, at.dp, at.pp});

  auto& comms = w.emplace_resource<Communicators>();
  // Every rank creates its groups in the same order (NCCL splits are collective over the world).
  auto make = [&](const std::string& name, std::initializer_list<Axis> axes) {
    return make_group(w, name, topo.group_index(r.rank, axes), topo.group(r.rank, axes));
  };
  comms.world = make("world", {Axis::tp, Axis::cp, Axis::ep, Axis::dp, Axis::pp});
  comms.tp = make("tp", {Axis::tp});
  comms.dp = make("dp", {Axis::dp});
  comms.tp_dp = make("tp_dp", {Axis::tp, Axis::dp});
  comms.ep = make("ep", {Axis::ep});
  comms.self = make_self_communicator("self", r.rank);
#ifdef KILN_WITH_CUDA
  // A job aborted between collectives (a rank died) stops at the end of the step at the latest.
  if (auto* launch = w.try_resource<LaunchContext>(); launch && launch->nccl)
    w.systems().add({"parallel.check", Phase::step_end,
                     [nccl = launch->nccl](World&) { nccl->check(); }});
#endif

  // Sequence parallelism: parameters replicated over TP but fed by this rank's tokens only have
  // partial gradients; they are summed over the TP group once per step, after the DP sync (the sums
  // commute; the DP buckets may still be reducing these gradients on the communication stream until
  // parallel.dp_grad_sync has made the compute stream wait for them).
  w.systems().add({"parallel.tp_grad_sync", Phase::grad_sync,
                   [](World& world) {
                     auto& c = world.resource<Communicators>();
                     const auto* store = world.try_resource<nn::ParamStore>();
                     if (c.tp->size() == 1 || !store) return;  // no parameters: nothing to reduce
                     for (Entity e : store->order()) {
                       const auto& p = world.get<nn::Param>(e);
                       if (!p.tp_partial_grad) continue;
                       store->for_each_held(p, [&](const nn::HeldPart& part) {
                         c.tp->all_reduce(nn::ParamStore::held_view(store->grads_flat(), part), ReduceOp::sum,
                                          store->stream());
                       });
                     }
                   },
                   {"parallel.dp_grad_sync"}});

  // Data parallelism: every DP rank computed the gradients of its slice of the global batch, with
  // the loss scaled by 1 / (tokens in the global batch), so summing them gives the batch gradient.
  // In buckets during the backward pass (see grad_buckets.hpp), or all at once here. Registered
  // whatever the DP size, so other systems can order themselves after it.
  auto& dp_state = w.emplace_resource<DpGradState>();
  dp_state.bucket_mb = cfg.dp_bucket_mb;
  if (cfg.dp_bucket_mb > 0 && comms.dp->size() > 1)
    dp_state.on_backward = w.events().subscribe<nn::LayerBackwardEnd>([&w](const nn::LayerBackwardEnd& e) {
      const auto& rc = w.resource<RunControl>();
      auto* sync = dp_buckets(w);
      if (sync && rc.micro_batch == rc.micro_batches - 1) sync->unit_ready(e.unit);
    });
  w.systems().add({"parallel.dp_grad_sync", Phase::grad_sync, [](World& world) {
                     auto& c = world.resource<Communicators>();
                     const auto* store = world.try_resource<nn::ParamStore>();
                     // One rank, no parameters, or a module that reduces them itself (fsdp).
                     if (c.dp->size() == 1 || !store || world.try_resource<ShardedParameters>()) return;
                     if (auto* sync = dp_buckets(world)) {
                       sync->finish();
                       return;
                     }
                     c.dp->all_reduce(store->grads_flat(), ReduceOp::sum, store->stream());
                   }});
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
  return *w.resource<Communicators>().tp;
}

Communicator& held_parts(World& w) {
  if (const auto* s = w.try_resource<ShardedParameters>()) return *s->held_parts;
  return *w.resource<Communicators>().self;
}

TensorParallel tensor_parallel(World& w, ops::Backend& backend) {
  const auto& par = w.resource<ParallelState>();
  return TensorParallel(*w.resource<Communicators>().tp, backend, {par.sequence_parallel, par.vocab_parallel});
}

DataParallel data_parallel(World& w) { return DataParallel(*w.resource<Communicators>().dp); }

ExpertParallel expert_parallel(World& w, ops::Backend& backend, int n_experts) {
  return ExpertParallel(*w.resource<Communicators>().ep, backend, n_experts);
}

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<ParallelConfig>(
      "parallel", "topology, communicators and data-parallel gradient averaging", {}, install));
}

}  // namespace kiln::parallel
