#include "topology_info.hpp"

#include "kiln/nn/param_store.hpp"
#include "kiln/parallel/module.hpp"

namespace kiln::checkpoint {

std::map<std::string, std::int64_t> topology_of(World& w) {
  const auto& par = w.resource<parallel::ParallelState>();
  const auto s = par.topology.sizes();
  return {{"world", s.world()},
          {"tp", s.tp},
          {"dp", par.dp_size()},
          {"pp", s.pp},
          {"cp", s.cp},
          {"ep", s.ep},
          {"fsdp_shards", w.resource<nn::ParamStore>().shards()},
          {"sequence_parallel", par.sequence_parallel},
          {"vocab_parallel", par.vocab_parallel}};
}

std::map<std::string, int> coords_of(World& w) {
  const auto& par = w.resource<parallel::ParallelState>();
  const auto& c = par.coords;
  return {{"tp", c.tp}, {"dp", par.dp_rank()}, {"pp", c.pp}, {"cp", c.cp}, {"ep", c.ep}};
}

}  // namespace kiln::checkpoint
