#include "kiln/model/parts/layer_builder.hpp"

#include "kiln/nn/param_store.hpp"

namespace kiln::model {

LayerBuilder::LayerBuilder(ModelContext& ctx, int unit, nn::LayerKind kind, int block, const std::string& name)
    : ctx_(ctx), unit_(unit), layer_(ctx.world.create(name)), prefix_(block >= 0 ? name + "." : "") {
  ctx_.world.emplace<nn::Layer>(layer_, nn::Layer{unit, block, kind, {}});
}

Entity LayerBuilder::param(const std::string& name, Shape global_shape, const TensorShard& shard, ParamInit init,
                           bool decay) {
  nn::Param p;
  p.name = name;
  p.global_shape = global_shape;
  p.shard = shard;
  p.shape = shard.local_shape(global_shape);
  p.weight_decay = decay;
  p.init_std = init.std;
  p.init_value = init.value;
  p.unit = unit_;
  const Entity e = ctx_.world.resource<nn::ParamStore>().add(ctx_.world, std::move(p));
  ctx_.world.get<nn::Layer>(layer_).params.push_back(e);
  return e;
}

Entity LayerBuilder::norm_param(const std::string& name, float value) {
  const Entity e = param(name, {ctx_.cfg.n_embd}, TensorShard{}, ParamInit::constant(value), false);
  ctx_.world.get<nn::Param>(e).tp_partial_grad = ctx_.tp.sequence_parallel();  // norms see this rank's rows only
  return e;
}

Entity LayerBuilder::linear(const std::string& name, nn::LinearRole role, Entity weight, std::optional<Entity> bias,
                            std::int64_t in, std::int64_t out) {
  const Entity e = ctx_.world.create(name);
  ctx_.world.emplace<nn::Linear>(e, nn::Linear{role, unit_, weight, bias, static_cast<int>(in), static_cast<int>(out)});
  return e;
}

Entity LayerBuilder::grouped_linear(const std::string& name, const nn::GroupedLinear& g) {
  const Entity e = ctx_.world.create(name);
  nn::GroupedLinear c = g;
  c.unit = unit_;
  ctx_.world.emplace<nn::GroupedLinear>(e, c);
  return e;
}

}  // namespace kiln::model
