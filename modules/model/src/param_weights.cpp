#include "kiln/model/param_weights.hpp"

#include "kiln/core/error.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"

namespace kiln::model {

WeightSource param_store_weights(World& world) {
  return [&world](const std::string& name) {
    const auto& store = world.resource<nn::ParamStore>();
    KILN_CHECK(!store.sharded(), "reading weight '", name, "': the parameters are sharded over ", store.shards(),
               " ranks (FSDP); gather them first");
    for (Entity e : store.order()) {
      const auto& p = world.get<nn::Param>(e);
      if (p.name != name) continue;
      KILN_CHECK(p.shape == p.global_shape, "reading weight '", name, "': this rank holds a tensor-parallel shard ",
                 p.shape.str(), " of ", p.global_shape.str());
      std::vector<float> host(static_cast<std::size_t>(p.numel));
      auto& be = world.resource<ops::ActiveBackend>().get();
      be.copy(TensorView(host.data(), p.shape, DType::f32, Device::cpu), store.master_view(p));
      be.synchronize();
      return host;
    }
    KILN_THROW("reading weight '", name, "': the model has no such parameter");
  };
}

}  // namespace kiln::model
