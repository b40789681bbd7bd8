#pragma once
// Pipeline schedules: the order in which each pipeline rank runs the forward and backward passes of
// a step's micro-batches over its model chunks, and a simulation of the timeline they give.
//
// A model split into pp x vpp chunks (virtual stages 0 .. pp vpp - 1, in the order the layers run)
// puts virtual stage s on pipeline rank s % pp as its chunk s / pp (Megatron's interleaving: each rank
// holds vpp non-adjacent chunks; vpp = 1 is plain 1F1B). Micro-batch m's forward runs on virtual
// stage s after it ran on s - 1; its backward on s after it ran on s + 1 and after its forward on s.
//   1F1B (vpp = 1): rank r runs min(pp - r - 1, m) forwards (warm-up), then alternates one forward and
//     one backward (steady state), then runs the backwards left (cool-down): at most pp - r
//     micro-batches' activations are alive on rank r. Bubble: (pp - 1) / (m + pp - 1) of the step.
//   Interleaved 1F1B (vpp > 1, Megatron-LM's schedule): micro-batches go through the chunks in groups
//     of pp; warm-up (pp - r - 1) 2 + (vpp - 1) pp forwards (all of them when m = pp). Bubble:
//     (pp - 1) / (vpp m + pp - 1) of the step; needs m a multiple of pp.
#include <string>
#include <vector>

namespace kiln::parallel {

struct PipelineShape {
  int pp = 1;              // pipeline ranks
  int vpp = 1;             // model chunks per rank (virtual pipeline size)
  int micro_batches = 1;   // per step
  int virtual_stages() const { return pp * vpp; }
};

struct PipelineAction {
  enum class Kind { forward, backward };
  Kind kind = Kind::forward;
  int micro_batch = 0;
  int chunk = 0;  // the rank's chunk: virtual stage chunk * pp + rank
  bool operator==(const PipelineAction&) const = default;
};

// Why a shape has no schedule (empty: it has one): pp, vpp and micro_batches positive, and with
// vpp > 1, micro_batches a multiple of pp.
std::string pipeline_shape_problem(const PipelineShape& s);
// The actions pipeline rank `rank` runs in one step, in order (every micro-batch's forward and
// backward on each of its chunks, once). Throws kiln::Error on a shape with a problem.
std::vector<PipelineAction> pipeline_schedule(const PipelineShape& s, int rank);
// The most (micro-batch, chunk) forwards whose backward has not run yet at any point of `actions`:
// the sets of activations the rank keeps alive at once (1F1B: min(pp - rank, m)).
int max_in_flight(const std::vector<PipelineAction>& actions);
// The bubble fraction of the schedule with every virtual stage's forward and backward costing the
// same: (pp - 1) / (vpp m + pp - 1).
double pipeline_bubble(const PipelineShape& s);

// A rank's action placed in time.
struct TimedAction {
  PipelineAction action;
  double start = 0, end = 0;
};
struct PipelineTimeline {
  std::vector<std::vector<TimedAction>> ranks;  // by pipeline rank, in the order each ran them
  double makespan = 0;                          // the step's time: the last action's end
  double bubble = 0;                            // idle time over all ranks / (pp x makespan)
};
// Runs the schedules of every rank against each other: each action starts once the rank finished
// its previous one and the action it needs from a neighbour has ended (plus `transfer` for the
// activation or gradient to arrive). One chunk's forward costs `forward`, its backward `backward`.
// Throws kiln::Error naming the ranks and actions if the schedules wait on each other forever.
PipelineTimeline simulate_pipeline(const PipelineShape& s, double forward, double backward, double transfer = 0);
// The same for given schedules (plans[r]: rank r's actions), e.g. to check a hand-made one.
PipelineTimeline simulate_pipeline(const PipelineShape& s, const std::vector<std::vector<PipelineAction>>& plans,
                                   double forward, double backward, double transfer = 0);

// A transfer between pipeline ranks: micro-batch m's activation from virtual stage `from` to from + 1
// (the output of a forward), or its gradient from `from` to from - 1 (the input gradient of a backward).
struct PipelineMessage {
  bool activation = true;
  int micro_batch = 0;
  int from = 0;  // virtual stage
  int to() const { return activation ? from + 1 : from - 1; }
  bool operator==(const PipelineMessage&) const = default;
};
// One grouped call of sends and receives (Communicator::p2p).
struct PipelineTransfers {
  std::vector<PipelineMessage> sends, recvs;
};
// The calls a pipeline rank makes around its passes (as Megatron-LM batches them): before pass i,
// one call sending what pass i - 1 produced and receiving what pass i needs; after the last pass, one
// sending what it produced. n passes, n + 1 calls (some empty). A message's peer is the rank of its
// other virtual stage: stage v lives on rank v % pp.
std::vector<PipelineTransfers> pipeline_transfers(const PipelineShape& s, int rank);
// Checks every rank's calls against each other as NCCL runs them: a call's transfers complete once
// the peer's call holding the other side is posted, a rank posts its next call once its current one
// completed, and the k-th send from a rank to a peer meets the peer's k-th receive from it (so both
// must be the same message). Empty when every call completes; else what goes wrong.
std::string check_pipeline_transfers(const PipelineShape& s);

// "F0 F1 B0 F2 B1 ..." (chunk c > 0 as "F3.1": micro-batch 3 on chunk 1).
std::string format_actions(const std::vector<PipelineAction>& actions);

}  // namespace kiln::parallel
