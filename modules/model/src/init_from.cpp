#include "init_from.hpp"

#include <cstring>
#include <iostream>

#include "kiln/engine/engine_module.hpp"
#include "kiln/model/hf.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"

namespace kiln::model {

void load_initial_weights(World& w, const ModelConfig& cfg, const std::string& path) {
  const auto weights = interop::import_hf_gpt2(gpt2_shape(cfg), path);
  auto& store = w.resource<nn::ParamStore>();
  auto& be = w.resource<ops::ActiveBackend>().get();
  // The held master weights in host memory first (padding zero), then one copy.
  Buffer staging = be.alloc_host(static_cast<std::size_t>(store.held()) * 4);
  std::memset(staging.data(), 0, staging.bytes());
  float* held = static_cast<float*>(staging.data());
  for (Entity e : store.order()) {
    const auto& p = w.get<nn::Param>(e);
    const auto it = weights.find(p.name);
    if (it == weights.end()) KILN_FILE_ERROR(path, ": no tensor for kiln's parameter '", p.name, "'");
    const std::vector<float>& global = it->second;
    store.for_each_held(p, [&](const nn::HeldPart& part) {
      p.shard.for_each_block(p.global_shape, part.first, part.first + part.count, [&](const TensorShard::Block& b) {
        std::memcpy(held + part.held + (b.local - part.first), global.data() + b.global,
                    static_cast<std::size_t>(b.count) * 4);
      });
    });
  }
  be.copy(store.master_flat(), staging.view(DType::f32, {store.held()}));
  be.convert(store.compute_flat(), store.master_flat());
  be.synchronize();
  w.events().publish(nn::ParamsLoaded{0});
  if (w.resource<RankInfo>().rank == 0) std::cout << "model: weights from " << path << "\n";
}

}  // namespace kiln::model
