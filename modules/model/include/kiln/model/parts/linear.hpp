#pragma once
// One linear layer of a part: its entity (nn::Linear, to which a module may attach its own
// ops::LinearImpl), its weight and bias parameters, and its tensor-parallel layer
// (parallel::ColumnParallelLinear or RowParallelLinear). A part fills in the activations of each
// call; this fills in the weights, the gradients and the implementation.
#include <optional>
#include <string>

#include "kiln/engine/engine_module.hpp"
#include "kiln/model/parts/layer_builder.hpp"
#include "kiln/ops/linear_impl.hpp"
#include "kiln/parallel/parallel_linear.hpp"

namespace kiln::model {

template <class Layer>
class ModelLinear {
 public:
  // Registers weight [out, in] (drawn with `std`), a zero bias [out] when `bias`, and the linear
  // `name` (role `role`). The weight's gradient has this layer as its only producer unless it is
  // another part's parameter (`weight` given: a tied LM head).
  ModelLinear(LayerBuilder& b, const std::string& name, nn::LinearRole role, Layer layer, bool bias, float std,
              std::optional<Entity> weight = std::nullopt)
      : ctx_(b.ctx()), layer_(std::move(layer)) {
    const std::string p = b.prefix() + name;
    const Shape shape{layer_.out(), layer_.in()};
    weight_ = weight ? *weight : b.param(p + ".weight", shape, layer_.weight_shard(), ParamInit::normal(std), true);
    if (!weight) ctx_.world.emplace<nn::GradWrittenFirst>(weight_);
    if (bias) bias_ = b.param(p + ".bias", {layer_.out()}, bias_shard(), ParamInit::constant(0), false);
    entity_ = b.linear(p, role, weight_, bias_, local_in(), local_out());
  }

  const Layer& layer() const { return layer_; }
  Entity entity() const { return entity_; }
  std::int64_t local_in() const;
  std::int64_t local_out() const;
  // The implementation that multiplies: the one a module attached, else the backend's.
  const ops::LinearImpl& impl() const {
    const auto* attached = ctx_.world.try_get<ops::LinearImpl>(entity_);
    return attached ? *attached : ctx_.backend_linear;
  }
  // Bytes of scratch the implementation may borrow at most for one call on N tokens (one-byte copies
  // of the output gradient, twice, and of the input: an FP8 layer's backward).
  std::size_t scratch_bytes(std::int64_t N) const {
    return static_cast<std::size_t>(N * (2 * local_out() + local_in()));
  }

  // The layer's forward with `a`'s activations and this layer's weight and bias (`local`: the
  // tensor-parallel layer's x_local or out_local).
  void forward(ops::LinearForward a, const TensorView& local) const { layer_.forward(impl(), with_weights(a), local); }
  // A column-parallel layer's forward whose gathered input nothing reads afterwards where
  // `input_read_after` is false (parallel::ColumnParallelLinear::forward: an FP8 layer keeping its
  // input then gathers it as one-byte codes).
  void forward(ops::LinearForward a, const TensorView& local, bool input_read_after) const {
    layer_.forward(impl(), with_weights(a), local, input_read_after);
  }
  // The layer's backward: `a`'s activations, this layer's weight and gradients; the weight gradient
  // written rather than accumulated on a step's first micro-batch where this layer is its only
  // producer (nn::GradWrittenFirst, so the step's zeroing skipped it).
  auto backward(ops::LinearBackward a, const TensorView& local) const {
    return layer_.backward(impl(), with_weights(a), local);
  }
  // The GEMMs alone, on an input whole on this rank already (a layer whose weight is whole on every
  // rank, fed by rows another part gathered; or a chunk of rows whose communication the caller does
  // itself): no tensor-parallel communication, the input gradient this rank's partial sum.
  // `accumulate`: the weight gradient is added to, never written (a later chunk of rows).
  void forward_whole(ops::LinearForward a) const { impl().forward(with_weights(a)); }
  void backward_whole(ops::LinearBackward a, bool accumulate = false) const {
    ops::LinearBackward b = with_weights(a);
    if (accumulate) b.dweight_overwrite = false;
    impl().backward(b);
  }

 private:
  TensorShard bias_shard() const;
  ops::LinearForward with_weights(ops::LinearForward a) const {
    a.weight = ctx_.param(weight_, false);
    a.bias = bias_ ? ctx_.param(*bias_, false) : TensorView{};
    return a;
  }
  ops::LinearBackward with_weights(ops::LinearBackward a) const {
    a.weight = ctx_.param(weight_, false);
    a.dweight = ctx_.param(weight_, true);
    a.dbias = bias_ ? ctx_.param(*bias_, true) : TensorView{};
    const auto* run = ctx_.world.try_resource<RunControl>();
    a.dweight_overwrite = (!run || run->micro_batch == 0) && ctx_.world.has<nn::GradWrittenFirst>(weight_);
    return a;
  }

  ModelContext& ctx_;
  Layer layer_;
  Entity weight_{}, entity_{};
  std::optional<Entity> bias_;
};

// Column-parallel: weight and bias split by output features; row-parallel: weight split by input
// features, the bias whole (added once, on TP rank 0).
template <>
inline std::int64_t ModelLinear<parallel::ColumnParallelLinear>::local_in() const { return layer_.in(); }
template <>
inline std::int64_t ModelLinear<parallel::ColumnParallelLinear>::local_out() const { return layer_.local_out(); }
template <>
inline TensorShard ModelLinear<parallel::ColumnParallelLinear>::bias_shard() const { return layer_.weight_shard(); }
template <>
inline std::int64_t ModelLinear<parallel::RowParallelLinear>::local_in() const { return layer_.local_in(); }
template <>
inline std::int64_t ModelLinear<parallel::RowParallelLinear>::local_out() const { return layer_.out(); }
template <>
inline TensorShard ModelLinear<parallel::RowParallelLinear>::bias_shard() const { return {}; }

using ColumnLinear = ModelLinear<parallel::ColumnParallelLinear>;
using RowLinear = ModelLinear<parallel::RowParallelLinear>;

}  // namespace kiln::model
