#include "kiln/model/pipeline_plan.hpp"

#include <algorithm>

#include "kiln/core/error.hpp"
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

}  // namespace kiln::model
