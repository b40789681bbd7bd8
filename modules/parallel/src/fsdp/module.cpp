// The "fsdp" engine module: checks the layout, makes the shard (and replica) groups, tells the
// parameter store how it is split, and drives the Runner from the layer events.
#include <algorithm>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <vector>

#include "fsdp_runner.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/fsdp.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/train/state.hpp"

namespace kiln::parallel {

namespace {

// World resource: the groups the module made and its machinery.
struct FsdpState {
  std::unique_ptr<Communicator> own_shard, own_replica, own_param_shards;
  std::unique_ptr<fsdp::Runner> runner;
  std::vector<Subscription> subscriptions;
};

// This rank's coordinates with data-parallel rank `d` (the ep and dp axes: d = ep + EP dp) and TP rank `t`.
Coords at_dp_rank(const ParallelState& par, int d, int t) {
  Coords c = par.coords;
  c.ep = d % par.ep_size();
  c.dp = d / par.ep_size();
  c.tp = t;
  return c;
}

// The ranks that differ from this one only in their data-parallel rank, for the DP ranks `dps`.
std::vector<int> dp_members(const ParallelState& par, const std::vector<int>& dps) {
  std::vector<int> out;
  for (int d : dps) out.push_back(par.topology.rank(at_dp_rank(par, d, par.coords.tp)));
  return out;
}

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

void install(World& w, const FsdpConfig& cfg) {
  const auto& par = w.resource<ParallelState>();
  auto& comms = w.resource<Communicators>();
  auto& be = w.resource<ops::ActiveBackend>().get();
  const int dp = par.dp_size(), d = par.dp_rank();
  if (cfg.strategy != FsdpStrategy::hybrid_shard && cfg.shard_size != 0)
    throw config_error(w, "fsdp.shard_size",
                       "only hybrid_shard takes a shard size (the other strategies shard over all data-parallel ranks)");
  int S = dp;
  if (cfg.strategy == FsdpStrategy::hybrid_shard) {
    if (cfg.shard_size <= 0 || dp % cfg.shard_size != 0)
      throw config_error(w, "fsdp.shard_size",
                         cat(cfg.shard_size, " does not divide the ", dp, " data-parallel ranks (hybrid_shard shards "
                             "inside groups of shard_size of them)"));
    S = cfg.shard_size;
  }
  if (cfg.strategy == FsdpStrategy::hybrid_shard && par.ep_size() > 1)
    throw config_error(w, "fsdp.strategy",
                       "hybrid_shard does not run with expert parallelism yet (parallel.ep > 1): use full_shard or "
                       "shard_grad_op");
  if (cfg.param_dtype == FsdpDType::fp32 && be.device() == Device::cuda)
    throw config_error(w, "fsdp.param_dtype", "fp32: the CUDA backend computes with bf16 weights");
  // no_shard is plain data parallelism (the parallel module's buckets); one rank per shard group
  // has whole units: nothing to gather or reduce-scatter, its gradients reduce as in plain DP.
  if (cfg.strategy == FsdpStrategy::no_shard || S == 1) {
    if (w.resource<RankInfo>().rank == 0)
      std::cout << "fsdp: " << (cfg.strategy == FsdpStrategy::no_shard ? "no_shard" : "one rank per shard group")
                << ": parameters whole on every rank, gradients all-reduced over the " << dp
                << " data-parallel ranks\n";
    return;
  }

  auto& st = w.emplace_resource<FsdpState>();
  // Shard groups: S consecutive DP ranks; replica groups (hybrid): the DP ranks of equal index in
  // their shard group. Every rank makes them in the same order.
  const int k = d / S, i = d % S;
  std::vector<int> shard_dps, replica_dps;
  for (int j = 0; j < S; ++j) shard_dps.push_back(k * S + j);
  for (int j = 0; j < dp / S; ++j) replica_dps.push_back(j * S + i);
  Communicator* shard = comms.dp.get();
  Communicator* replica = nullptr;
  // One copy of the parameters: TP x the shard group (x the pipeline stages).
  Communicator* param_shards = comms.tp_dp.get();
  if (S < dp || par.pp_size() > 1) {
    if (S < dp) {
      const auto shard_members = dp_members(par, shard_dps), replica_members = dp_members(par, replica_dps);
      st.own_shard = make_group(w, "fsdp_shard", shard_members.front(), shard_members);
      st.own_replica = make_group(w, "fsdp_replica", replica_members.front(), replica_members);
      shard = st.own_shard.get();
      replica = st.own_replica.get();
    }
    std::vector<int> tp_shard;
    for (int p = 0; p < par.pp_size(); ++p)
      for (int t = 0; t < par.tp_size(); ++t)
        for (int j : shard_dps) {
          Coords c = at_dp_rank(par, j, t);
          c.pp = p;
          tp_shard.push_back(par.topology.rank(c));
        }
    std::sort(tp_shard.begin(), tp_shard.end());
    st.own_param_shards = make_group(w, "fsdp_tp_shard", tp_shard.front(), tp_shard);
    param_shards = st.own_param_shards.get();
  }
  // The gradients are reduce-scattered here instead of all-reduced: the parallel module stands
  // aside, and sums over the parameters run over these groups.
  w.emplace_resource<ShardedParameters>(ShardedParameters{"fsdp", param_shards, shard});

  // The parameter store holds this rank's part of every unit from its layout on: of the dense
  // parameters over the shard group, of the experts (under expert parallelism) over the ranks holding
  // the same experts (the expert-data-parallel group; full_shard and shard_grad_op shard over all
  // data-parallel ranks, so over all of those).
  auto& store = w.resource<nn::ParamStore>();
  store.shard_over(S, i);
  Communicator* expert_shard = nullptr;
  if (par.ep_size() > 1) {
    expert_shard = comms.edp.get();
    store.shard_experts_over(expert_shard->size(), expert_shard->rank());
  }
  st.runner = std::make_unique<fsdp::Runner>(w, cfg, *shard, expert_shard, replica, be);

  w.systems().add({"fsdp.setup", Phase::setup,
                   [](World& world) {
                     auto& s = world.resource<FsdpState>();
                     s.runner->setup();
                     FsdpMemory mem = s.runner->memory();
                     // The optimizer's state: every buffer laid out like the held parameters (the
                     // optimizer's moments, f32 or bf16).
                     std::size_t per_element = 0;
                     for (const auto& h : world.resource<train::TrainingState>().held) per_element += size_of(h.dtype);
                     const auto& store = world.resource<nn::ParamStore>();
                     mem.optimizer = static_cast<std::size_t>(store.held()) * per_element;
                     mem.optimizer_unsharded = static_cast<std::size_t>(store.total()) * per_element;
                     const FsdpMemory m = world.emplace_resource<FsdpMemory>(mem);
                     const auto& r = world.resource<RankInfo>();
                     std::ostringstream os;
                     os << std::fixed << std::setprecision(1) << "fsdp rank " << r.rank << " holds 1/" << m.shards
                        << ": parameters " << mib(m.params) << " MiB (unsharded " << mib(m.params_unsharded)
                        << "), gradients " << mib(m.grads) << " (" << mib(m.grads_unsharded) << "), optimizer state "
                        << mib(m.optimizer) << " (" << mib(m.optimizer_unsharded) << "), gathered units "
                        << mib(m.gathered) << "\n";
                     std::cout << os.str();
                   },
                   {"params.allocate"}});
  auto& bus = w.events();
  fsdp::Runner* run = st.runner.get();
  st.subscriptions.push_back(bus.subscribe<nn::LayerForwardBegin>([run](const auto& e) { run->forward_begin(e.unit); }));
  st.subscriptions.push_back(bus.subscribe<nn::LayerForwardEnd>([run](const auto& e) { run->forward_end(e.unit); }));
  st.subscriptions.push_back(bus.subscribe<nn::LayerBackwardBegin>([run](const auto& e) { run->backward_begin(e.unit); }));
  st.subscriptions.push_back(bus.subscribe<nn::LayerBackwardEnd>([run](const auto& e) { run->backward_end(e.unit); }));
  st.subscriptions.push_back(bus.subscribe<nn::AdamWStep>([run](const auto&) { run->weights_changed(); }));
  st.subscriptions.push_back(bus.subscribe<nn::ParamsLoaded>([run](const auto&) { run->weights_changed(); }));
  st.subscriptions.push_back(bus.subscribe<nn::PassesGraphBegin>([run](const auto& e) { run->graph_begin(e.micro_batch); }));
  st.subscriptions.push_back(bus.subscribe<nn::PassesCaptureEnd>([run](const auto& e) { run->capture_end(e.micro_batch); }));
  st.subscriptions.push_back(bus.subscribe<nn::PassesReplayed>([run](const auto& e) { run->replayed(e.micro_batch); }));
  // The step's gradients complete before the TP sums of sequence-parallel partial gradients and
  // everything after them (FP8 amax reduction, the optimizer).
  w.systems().add({"fsdp.grad_sync", Phase::grad_sync, [run](World&) { run->finish_gradients(); },
                   {"parallel.dp_grad_sync"}, {"parallel.tp_grad_sync"}});
}

}  // namespace

void register_fsdp_module(ModuleRegistry& registry) {
  registry.add(make_module<FsdpConfig>(
      "fsdp", "fully sharded data parallelism: parameters, gradients and optimizer state sharded per layer unit",
      {"model", "parallel"}, install));
}

}  // namespace kiln::parallel
