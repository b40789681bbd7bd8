#pragma once
// The data-parallel group as a model sees it: replicas that each computed on their slice of the
// global batch. (Their gradients are summed by the parallel module's buckets, grad_buckets.hpp.)
#include <span>

#include "kiln/parallel/communicator.hpp"

namespace kiln::parallel {

class DataParallel {
 public:
  explicit DataParallel(Communicator& comm) : comm_(comm) {}
  int size() const { return comm_.size(); }
  int rank() const { return comm_.rank(); }
  // The mean over the replicas of a host value (a loss), identical on every replica; synchronous.
  double mean(double local) const;
  // Host values summed over the replicas in place (f32, one all-reduce), identical on every replica.
  void sum(std::span<float> values) const;

 private:
  Communicator& comm_;
};

}  // namespace kiln::parallel
