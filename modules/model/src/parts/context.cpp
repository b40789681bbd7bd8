#include "kiln/model/parts/context.hpp"

#include "kiln/nn/param_store.hpp"

namespace kiln::model {

ModelContext::ModelContext(World& world, const ModelConfig& cfg, ops::Backend& be, parallel::TensorParallel tp, int B,
                           int T, std::int64_t batch_sequences)
    : world(world),
      cfg(cfg),
      be(be),
      tp(tp),
      B(B),
      T(T),
      N(static_cast<std::int64_t>(B) * T),
      Nl(this->tp.local_rows(N)),
      batch_sequences(batch_sequences),
      backend_linear(ops::backend_linear_impl(be)),
      backend_grouped_linear(ops::backend_grouped_linear_impl(be)) {}

ops::DropoutArgs ModelContext::hidden_dropout(float p, const rng::PhiloxArgs& r) const {
  ops::DropoutArgs d;
  d.p = p;
  // This rank's rows of the step's [batch tokens, C] tensor: its micro-batch's, under sequence
  // parallelism its part of them.
  d.row_offset = seq_offset * T + tp.first_local_row(N);
  d.rng = r;
  return d;
}

TensorView ModelContext::param(Entity e, bool grad) const {
  const auto& store = world.resource<nn::ParamStore>();
  const auto& p = world.get<nn::Param>(e);
  return grad ? store.grad_view(p) : store.compute_view(p);
}

}  // namespace kiln::model
