#pragma once
// Registers one layer unit of a model as entities: the unit's nn::Layer, its parameters (nn::Param,
// in the ParamStore, in the order they are made: initialisation draws and the flat layout follow
// it) and its linear layers (nn::Linear, where modules attach their components).
#include <cstdint>
#include <optional>
#include <string>

#include "kiln/model/parts/context.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/tensor/shard.hpp"

namespace kiln::model {

// How a parameter starts: normal(0, std) draws from the tracker's default state, or a constant.
struct ParamInit {
  float std = 0;
  float value = 0;
  static ParamInit normal(float std) { return {std, 0}; }
  static ParamInit constant(float value) { return {0, value}; }
};

class LayerBuilder {
 public:
  // The layer `name` of unit `unit` (0: embeddings, 1..L: blocks, L + 1: final norm and head).
  LayerBuilder(ModelContext& ctx, int unit, nn::LayerKind kind, int block, const std::string& name);

  ModelContext& ctx() const { return ctx_; }
  Entity layer() const { return layer_; }
  int unit() const { return unit_; }
  // Parameter names start with it ("blocks.3." for block 3, "" elsewhere).
  const std::string& prefix() const { return prefix_; }

  // A parameter of `global_shape`, of which this rank holds `shard`; matrices decay, the rest not.
  Entity param(const std::string& name, Shape global_shape, const TensorShard& shard, ParamInit init, bool decay);
  // A norm's weight or bias [C]: replicated over TP, but under sequence parallelism its gradient is
  // this rank's rows' part (nn::Param::tp_partial_grad), summed over TP once per step.
  Entity norm_param(const std::string& name, float value);
  // A linear layer's entity over its weight (and bias) parameters, this rank's in -> out features.
  Entity linear(const std::string& name, nn::LinearRole role, Entity weight, std::optional<Entity> bias,
                std::int64_t in, std::int64_t out);
  // A grouped linear layer's entity (nn::GroupedLinear) over its stacked experts' weight.
  Entity grouped_linear(const std::string& name, const nn::GroupedLinear& g);

 private:
  ModelContext& ctx_;
  int unit_;
  Entity layer_;
  std::string prefix_;
};

}  // namespace kiln::model
