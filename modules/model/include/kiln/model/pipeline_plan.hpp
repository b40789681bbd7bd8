#pragma once
// This rank's part of a model split into pipeline stages (parallel.pp > 1; pipeline_schedule.hpp):
// which chunks of blocks it runs, the order of its passes and the transfers between them. One stage
// (pp = 1) is the whole model as one chunk, run in the engine's default order.
#include <string>
#include <vector>

#include "kiln/model/config.hpp"
#include "kiln/parallel/pipeline_schedule.hpp"

namespace kiln::model {

struct PipelinePlan {
  parallel::PipelineShape shape;                       // pp, vpp, micro-batches per step
  int rank = 0;                                        // this rank's pipeline rank
  std::vector<int> starts;                             // each virtual stage's first block, then n_layer
  std::vector<parallel::PipelineAction> passes;        // this rank's schedule (pp > 1)
  std::vector<parallel::PipelineTransfers> transfers;  // the calls around them (pipeline_transfers)
  int copies = 1;  // activation copies: the most micro-batches in flight on one chunk

  // The whole model on one rank: blocks [0, n_layer), one chunk.
  static PipelinePlan single(int n_layer, int micro_batches);
  // Rank `rank`'s plan for blocks split as `layers` (one count per virtual stage).
  static PipelinePlan make(const parallel::PipelineShape& shape, int rank, const std::vector<int>& layers);

  bool pipelined() const { return shape.pp > 1; }
  int chunks() const { return shape.vpp; }
  int virtual_stages() const { return shape.virtual_stages(); }
  int virtual_stage(int chunk) const { return chunk * shape.pp + rank; }
  int begin(int chunk) const { return starts[static_cast<std::size_t>(virtual_stage(chunk))]; }
  int end(int chunk) const { return starts[static_cast<std::size_t>(virtual_stage(chunk)) + 1]; }
  // The embedding runs before virtual stage 0, the head and loss after the last.
  bool first(int chunk) const { return virtual_stage(chunk) == 0; }
  bool last(int chunk) const { return virtual_stage(chunk) == virtual_stages() - 1; }
  bool holds_embedding() const { return rank == 0; }
  bool holds_head() const { return rank == shape.pp - 1; }
  // The chunk holding block l on this rank, or -1.
  int chunk_of(int block) const;
  // The activation copy micro-batch m uses on every chunk.
  int copy_of(int micro_batch) const { return micro_batch % copies; }
};

// The blocks of each virtual stage of `shape` (pp x vpp chunks): `pp_layers` when given (the key
// parallel.pp_layers), else balanced by the blocks' FLOPs at sequence length T with the head's counted
// on the last. A split that cannot be made gives the problem and the key to name instead (one stage:
// no layers and no problem, unless pp_layers is wrong). `kiln run` and `kiln topology --schedule`
// both split this way.
struct PipelineLayers {
  std::vector<int> layers;
  std::string key, problem;  // problem empty: the split is good
};
PipelineLayers pipeline_layers(const ModelConfig& cfg, int T, const parallel::PipelineShape& shape,
                               const std::vector<int>& pp_layers);

}  // namespace kiln::model
