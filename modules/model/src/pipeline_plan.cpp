#include "kiln/model/pipeline_plan.hpp"

#include <algorithm>

#include "kiln/core/error.hpp"
#include "kiln/model/spec.hpp"
#include "kiln/parallel/pipeline_split.hpp"

namespace kiln::model {

PipelinePlan PipelinePlan::single(int n_layer, int micro_batches) {
  PipelinePlan p;
  p.shape = {1, 1, micro_batches};
  p.starts = {0, n_layer};
  return p;
}

PipelinePlan PipelinePlan::make(const parallel::PipelineShape& shape, int rank, const std::vector<int>& layers) {
  KILN_CHECK(static_cast<int>(layers.size()) == shape.virtual_stages(), layers.size(), " chunks' blocks for ",
             shape.virtual_stages(), " virtual stages");
  PipelinePlan p;
  p.shape = shape;
  p.rank = rank;
  p.starts = parallel::split_starts(layers);
  if (shape.pp == 1 && shape.vpp == 1) return p;
  p.passes = parallel::pipeline_schedule(shape, rank);
  p.transfers = parallel::pipeline_transfers(shape, rank);
  // Micro-batches go through each chunk in order, forwards and backwards alike: those in flight on a
  // chunk are consecutive, so micro-batch m can take copy m % copies.
  for (int c = 0; c < shape.vpp; ++c) {
    std::vector<parallel::PipelineAction> mine;
    std::copy_if(p.passes.begin(), p.passes.end(), std::back_inserter(mine),
                 [c](const parallel::PipelineAction& a) { return a.chunk == c; });
    p.copies = std::max(p.copies, parallel::max_in_flight(mine));
  }
  return p;
}

int PipelinePlan::chunk_of(int block) const {
  for (int c = 0; c < chunks(); ++c)
    if (block >= begin(c) && block < end(c)) return c;
  return -1;
}

PipelineLayers pipeline_layers(const ModelConfig& cfg, int T, const parallel::PipelineShape& shape,
                               const std::vector<int>& pp_layers) {
  const int pp = shape.pp, vpp = shape.vpp, L = cfg.n_layer, S = shape.virtual_stages();
  if (!pp_layers.empty())
    if (std::string problem = parallel::split_problem(pp_layers, L, S); !problem.empty())
      return {{}, "parallel.pp_layers", std::move(problem)};
  if (pp == 1) return {};
  if (L < S)
    return {{},
            "parallel.pp",
            cat("splits the blocks into ", S, " pipeline chunks (parallel.pp = ", pp,
                vpp > 1 ? cat(" x parallel.vpp = ", vpp) : std::string(), "), but the model has ", L,
                " (model.n_layer): each chunk needs at least one block")};
  if (const std::string problem = parallel::pipeline_shape_problem(shape); !problem.empty())
    return {{},
            "train.micro_batch_size",
            cat(problem, " (micro-batches per step: train.batch_size / (data-parallel ranks x "
                         "train.micro_batch_size))")};
  if (!pp_layers.empty()) return {pp_layers, {}, {}};
  std::vector<double> costs;
  for (int l = 0; l < L; ++l) costs.push_back(block_flops_estimate(cfg, T, l));
  return {parallel::balanced_split(costs, 0.0, head_flops_estimate(cfg), S), {}, {}};
}

}  // namespace kiln::model
