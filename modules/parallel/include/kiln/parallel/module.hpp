#pragma once
// The "parallel" module: the job's topology and this rank's place in it.
#include <memory>
#include <vector>

#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/event_bus.hpp"
#include "kiln/engine/module.hpp"
#include "kiln/parallel/communicator.hpp"
#include "kiln/parallel/data_parallel.hpp"
#include "kiln/parallel/expert_parallel.hpp"
#include "kiln/parallel/in_process.hpp"
#include "kiln/parallel/pipeline_parallel.hpp"
#include "kiln/parallel/tensor_parallel.hpp"
#include "kiln/parallel/topology.hpp"

namespace kiln::nn {
struct Param;
}

namespace kiln::parallel {

struct ParallelConfig {
  int tp = 1;
  int pp = 1;
  int vpp = 1;
  std::vector<int> pp_layers;
  int cp = 1;
  int ep = 1;
  int dp = 0;
  bool sequence_parallel = false;
  bool vocab_parallel = false;
  bool tp_comm_overlap = false;
  int tp_comm_chunks = 1;
  int tp_comm_sms = 0;
  bool copy_engine = false;
  double timeout_s = 300;
  double dp_bucket_mb = 25;
  void validate(config::Checks& c) const {
    c.expect(dp_bucket_mb >= 0, "dp_bucket_mb", "must be 0 (one all-reduce after the backward pass) or positive");
    c.expect(timeout_s > 0, "timeout_s", "must be positive");
    c.expect(tp > 0, "tp", "must be positive");
    c.expect(tp_comm_chunks > 0, "tp_comm_chunks", "must be positive");
    c.expect(tp_comm_sms >= 0, "tp_comm_sms", "must be 0 or positive");
    c.expect(pp > 0, "pp", "must be positive");
    c.expect(vpp > 0, "vpp", "must be positive");
    c.expect(vpp == 1 || pp > 1, "vpp", "interleaves the chunks of a pipeline: needs parallel.pp > 1");
    c.expect(cp > 0, "cp", "must be positive");
    c.expect(ep > 0, "ep", "must be positive");
    c.expect(dp >= 0, "dp", "must be positive, or 0 to derive it from the world size");
  }
};
KILN_CONFIG(ParallelConfig,
            (tp, "tensor-parallel size"),
            (pp,
             "pipeline-parallel size: the blocks split into pp stages (the embedding in the first, the head and loss "
             "in the last), each rank holding one; micro-batches (train.micro_batch_size) flow through them in a "
             "1F1B schedule (`kiln topology FILE --world N --schedule` prints it)"),
            (vpp,
             "model chunks per pipeline rank (Megatron's interleaved 1F1B: rank r holds virtual stages r, r + pp, "
             "...; the bubble shrinks by vpp; the micro-batches per step must be a multiple of pp)"),
            (pp_layers,
             "blocks per chunk, in the order the layers run (pp x vpp numbers summing to model.n_layer); empty: "
             "balanced by the blocks' and the head's FLOPs"),
            (cp, "context-parallel size; only 1 runs yet (`kiln topology` plans larger layouts)"),
            (ep,
             "expert-parallel size: a mixture of experts' experts split over groups of ep data-parallel ranks "
             "(Megatron-Core's layout: ep divides the data-parallel size; each rank holds model.moe.n_experts / ep "
             "experts, tokens move to them by all-to-all)"),
            (dp, "data-parallel size (expert parallelism included); 0 = world size / (tp * pp * cp)"),
            (sequence_parallel,
             "outside the tensor-parallel regions each TP rank keeps 1/tp of the tokens (LayerNorm, dropout and "
             "residuals on sequence shards; all-gather before and reduce-scatter after each TP region)"),
            (vocab_parallel,
             "split the embedding table and the LM head's logits by vocabulary rows over the TP group "
             "(vocabulary-parallel embedding and cross-entropy: the [tokens, vocabulary] logits are 1/tp per rank)"),
            (tp_comm_overlap,
             "tensor parallelism: each linear layer's collectives run on a communication stream beside its GEMMs "
             "(the GEMM split by token rows: a row-parallel output's sum starts piece by piece, a gathered input "
             "is used piece by piece as it arrives, an input gradient is summed while the weight gradient is "
             "computed); FP8 layers take part in the sums (their input quantised once, then one GEMM a piece) and, "
             "under sequence parallelism, gather their inputs' FP8 codes in pieces where they can. "
             "NCCL's kernels beside the GEMMs: on two H200s over NVLink it does not pay yet (docs/PERF.md)"),
            (tp_comm_chunks, "with tp_comm_overlap: pieces per rank's share of a micro-batch's token rows"),
            (tp_comm_sms,
             "with tp_comm_overlap: streaming multiprocessors the overlapped GEMMs leave free for the collectives "
             "beside them (cuBLASLt's SM count target; 0: the GEMMs take all)"),
            (copy_engine,
             "GPUs under NCCL: the tensor-, expert- and data-parallel groups (FSDP's shard group too) move "
             "activations and gradients with the GPUs' copy engines over NVLink (CUDA IPC peer memory, flags "
             "between the GPUs; sums by a small kernel on each part's owner) instead of NCCL's kernels, so the SMs "
             "stay with the GEMMs beside them; host buffers, messages under 256 KiB and broadcasts stay on NCCL; "
             "needs the group's GPUs on one host with peer access; CPU ranks ignore it (docs/PERF.md: on two H200s "
             "it pays with FSDP, tp_comm_overlap and expert parallelism, not for plain TP)"),
            (timeout_s, "a collective waiting longer than this for another rank stops the run, naming it"),
            (dp_bucket_mb,
             "data parallelism: gradients are summed in buckets of about this many MB (f32), each started on a "
             "communication stream as soon as the backward pass has finished its layers, overlapping the rest of "
             "the backward pass; 0: one all-reduce of all gradients after the backward pass"))

// World resource: the topology and this rank's coordinates. (The same numbers, for modules that need
// nothing else of this module: train::ParallelLayout, which the module emplaces too.)
struct ParallelState {
  Topology topology;
  int rank = 0;
  Coords coords;
  bool sequence_parallel = false;  // parallel.sequence_parallel as configured
  bool vocab_parallel = false;     // parallel.vocab_parallel as configured
  int vpp = 1;                     // parallel.vpp
  std::vector<int> pp_layers;      // parallel.pp_layers
  bool tp_comm_overlap = false;    // parallel.tp_comm_overlap
  int tp_comm_chunks = 1;          // parallel.tp_comm_chunks
  int tp_comm_sms = 0;             // parallel.tp_comm_sms
  int tp_size() const { return topology.sizes().tp; }
  // Data parallelism spans the ep and dp axes (topology.hpp): its size and this rank's index in it.
  int dp_size() const { return topology.data_parallel_size(); }
  int dp_rank() const { return coords.ep + topology.sizes().ep * coords.dp; }
  int ep_size() const { return topology.sizes().ep; }
  int pp_size() const { return topology.sizes().pp; }
  // Whether they apply: only with more than one tensor-parallel rank (the one place this is decided;
  // kiln::tensor_parallel's layers decide the same for their group).
  bool sequence_parallel_applies() const { return sequence_parallel && tp_size() > 1; }
  bool vocab_parallel_applies() const { return vocab_parallel && tp_size() > 1; }
};

class NcclWorld;

// How this World's rank reaches the others, set by the launcher before modules are installed: an
// in-process hub when ranks are threads of one process, NCCL when they are processes (one per GPU).
// Without either, the job must have one rank.
struct LaunchContext {
  std::shared_ptr<InProcessHub> hub;
  std::shared_ptr<NcclWorld> nccl;
};

class DpGradSync;

// World resource: the data-parallel gradient buckets (when parallel.dp_bucket_mb > 0 and dp > 1),
// planned at their first use.
struct DpGradState {
  double bucket_mb = 0;
  std::shared_ptr<DpGradSync> sync;
  // Under expert parallelism: the experts' gradients, summed over the expert-data-parallel group
  // (the dense ones over every data-parallel rank).
  std::shared_ptr<DpGradSync> expert_sync;
  Subscription on_backward, on_capture_end, on_replayed;
};

// World resource: this rank's communicators, one per kind of group.
struct Communicators {
  std::unique_ptr<Communicator> world, tp, dp, tp_dp;  // dp: every data-parallel rank (expert parallelism included)
  std::unique_ptr<Communicator> ep;   // the expert-parallel group
  std::unique_ptr<Communicator> tp_ep;  // TP x EP: under expert parallelism, one copy of every parameter
  std::unique_ptr<Communicator> edp;  // the expert-data-parallel group: the ranks holding the same experts
  std::unique_ptr<Communicator> self;  // this rank alone
  std::unique_ptr<Communicator> pp;    // the pipeline group: the ranks holding the other stages
  // With pipeline stages, one copy of every parameter: TP x PP (and under expert parallelism TP x EP
  // x PP); null with one stage (then tp and tp_ep are).
  std::unique_ptr<Communicator> tp_pp, tp_ep_pp;
};

// World resource a module that shards the parameters over data-parallel ranks emplaces at install
// (fsdp), announcing that it reduces the gradients itself (reduce-scatter to the shards): the
// parallel module's data-parallel all-reduce then stands aside. Its groups are where sums over the
// parameters run (the module owns them; they outlive the World's use of them).
struct ShardedParameters {
  std::string owner;  // the module, for messages
  // The ranks among which one copy of the parameters is split, each holding a different part: TP x
  // the shard group.
  Communicator* param_shards = nullptr;
  // The ranks among which each of this rank's parameters is split: the shard group.
  Communicator* held_parts = nullptr;
};

// The ranks among which one copy of the parameters is split, each holding a different part (sums
// over all parameters, such as the gradient norm, are taken over them): the TP group, or the groups
// of ShardedParameters where a module shards them.
Communicator& param_shards(World& w);
// How many ranks of param_shards(w) hold the part of `p` this rank holds (1: each a different
// part): a sum over the parameters there counts each part once by dividing by it (its TP replicas;
// under expert parallelism without sharding, a dense parameter's EP replicas too).
int replicas_in_param_shards(World& w, const nn::Param& p);
// The ranks among which each of this rank's parameters is split, each holding another part of it
// (a module making a part's values from a statistic of the whole tensor agrees on it over them):
// this rank alone, or the shard group of ShardedParameters.
Communicator& held_parts(World& w);

// This rank's communicator of the group `members` (global ranks, ascending; this rank among them),
// one of the groups `color` numbers (each group its own color). Collective over the world: every
// rank asks for its group of the kind at the same time.
std::unique_ptr<Communicator> make_group(World& w, const std::string& name, int color, const std::vector<int>& members);

// This rank's tensor-parallel group, for layers computing on `backend`: the World's TP communicator
// and the [parallel] section's sequence_parallel and vocab_parallel. (The model builds its layers on
// it and never touches a communicator.)
TensorParallel tensor_parallel(World& w, ops::Backend& backend);
// This rank's data-parallel group.
DataParallel data_parallel(World& w);
// This rank's pipeline-parallel group (the ranks holding the model's other stages).
PipelineParallel pipeline_parallel(World& w);
// This rank's expert-parallel group, for mixture-of-experts layers of `n_experts` computing on `backend`.
ExpertParallel expert_parallel(World& w, ops::Backend& backend, int n_experts);

void register_module(ModuleRegistry& registry);

}  // namespace kiln::parallel
