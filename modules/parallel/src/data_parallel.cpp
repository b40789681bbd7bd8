#include "kiln/parallel/data_parallel.hpp"

namespace kiln::parallel {

double DataParallel::mean(double local) const {
  if (comm_.size() == 1) return local;
  // f32 on the wire, as the losses' mean always was (every replica gets the same bits).
  float m = static_cast<float>(local);
  comm_.all_reduce(TensorView(&m, {1}, DType::f32, Device::cpu), ReduceOp::avg, nullptr);
  return m;
}

void DataParallel::sum(std::span<float> values) const {
  if (comm_.size() == 1 || values.empty()) return;
  comm_.all_reduce(TensorView(values.data(), {static_cast<std::int64_t>(values.size())}, DType::f32, Device::cpu),
                   ReduceOp::sum, nullptr);
}

}  // namespace kiln::parallel
