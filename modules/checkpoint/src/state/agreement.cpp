#include "agreement.hpp"

#include <vector>

#include "kiln/parallel/module.hpp"

namespace kiln::checkpoint {

std::string failing_ranks(World& w, bool failed) {
  auto& comm = *w.resource<parallel::Communicators>().world;
  std::vector<std::int32_t> flags(static_cast<std::size_t>(comm.size()));
  std::int32_t mine = failed ? 1 : 0;
  comm.all_gather(TensorView(flags.data(), {comm.size()}, DType::i32, Device::cpu),
                  TensorView(&mine, {1}, DType::i32, Device::cpu), nullptr);
  std::string who;
  for (int r = 0; r < comm.size(); ++r)
    if (flags[static_cast<std::size_t>(r)]) who += (who.empty() ? "" : ", ") + std::to_string(comm.members()[r]);
  return who;
}

std::int32_t sum_over_ranks(World& w, std::int32_t v) {
  w.resource<parallel::Communicators>().world->all_reduce(TensorView(&v, {1}, DType::i32, Device::cpu),
                                                          parallel::ReduceOp::sum, nullptr);
  return v;
}

}  // namespace kiln::checkpoint
