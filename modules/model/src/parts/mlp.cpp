// Mlp (FC1, the activation's output, FC2: what the GELU and SwiGLU MLPs share), GeluMlp, SwigluMlp.
#include "kiln/model/parts/mlp.hpp"

#include <algorithm>

#include "kiln/ops/linear_impl.hpp"

namespace kiln::model {

ActOutput act_output_for(bool fc2_takes_prologue, bool fc2_keeps_input, bool recompute) {
  if (fc2_takes_prologue) return ActOutput::on_load;
  if (fc2_keeps_input) return ActOutput::forward_only;
  return recompute ? ActOutput::refilled : ActOutput::saved;
}

Mlp::Mlp(LayerBuilder& b, const MlpOptions& o, const std::vector<std::int64_t>& fc_parts, ops::Prologue act_prologue)
    : ctx_(b.ctx()),
      fc_(b, o.name + ".fc", nn::LinearRole::mlp_in, parallel::ColumnParallelLinear(ctx_.tp, ctx_.cfg.n_embd, fc_parts), o.bias,
          o.init_std),
      proj_(b, o.name + ".proj", nn::LinearRole::mlp_out, parallel::RowParallelLinear(ctx_.tp, o.hidden, ctx_.cfg.n_embd),
            o.bias, o.proj_init_std),
      act_prologue_(act_prologue) {
  // FC2's input is stored for its backward alone where it is not recomputed: an implementation
  // keeping its own copy instead (LinearImpl::keeps_input) then saves that memory.
  ctx_.world.get<nn::Linear>(proj_.entity()).input_stored_for_backward = !ctx_.cfg.recompute_gelu;
}

void Mlp::declare(ActivationTable::Rows& rows, const std::string& key, StageSet stage) {
  const DType act = ctx_.act();
  rows.saved(pre_, key + ".pre", act, {ctx_.N, fc_.local_out()}, stage);
  const auto* impl = ctx_.world.try_get<ops::LinearImpl>(proj_.entity());
  // Recomputed for the backward only where the block's recompute (activation checkpointing) does
  // not write it just before anyway, with the same bits (a refill computes it as activate() does;
  // FC1's GELU epilogue rounds differently, and the backward must read what a run without
  // recompute reads).
  act_output_ = act_output_for(impl && impl->prologues.has(act_prologue_), impl && impl->keeps_input,
                               ctx_.cfg.recompute_gelu && !(rows.recomputes(stage) && forward_activates()));
  const Shape act_shape{ctx_.N, proj_.local_in()};
  if (act_output_ == ActOutput::saved)
    rows.saved(act_, key + ".act", act, act_shape, stage);
  else if (act_written())  // one tensor for every block
    rows.scratch(act_, key + ".act", act, act_shape);
  declare_backward_scratch(rows, key);
}

void Mlp::forward_out(const TensorView& out_local) {
  proj_.forward({ctx_.stream.row_out, {}, fc2_input()}, out_local);
}

std::size_t Mlp::scratch_bytes() const { return std::max(fc_.scratch_bytes(ctx_.N), proj_.scratch_bytes(ctx_.N)); }

double Mlp::flops_per_token() const {
  const auto& f = fc_.layer();
  const auto& p = proj_.layer();
  return 6.0 * (double(f.out()) * double(f.in()) + double(p.out()) * double(p.in()));
}

GeluMlp::GeluMlp(LayerBuilder& b, const MlpOptions& o) : Mlp(b, o, {o.hidden}, ops::Prologue::gelu) {}

void GeluMlp::declare_backward_scratch(ActivationTable::Rows& rows, const std::string& key) {
  rows.backward_scratch(dpre_, key + ".dpre", ctx_.act(), {ctx_.N, fc_.local_out()});
}

void GeluMlp::forward_in(const NormOutput& x, float) {
  if (act_written())  // the GEMM's epilogue writes the GELU's output and its pre-activation
    fc_.forward({act_, pre_, x.input}, x.local, x.read_after);
  else  // FC2 computes the GELU as it loads its input
    fc_.forward({pre_, {}, x.input}, x.local, x.read_after);
}

void GeluMlp::activate() { ctx_.be.gelu_forward({act_, pre_}); }

TensorView GeluMlp::backward(const TensorView& dout_local, const ops::LinearInput& x, const TensorView& dx_local,
                             float) {
  if (act_refilled()) activate();
  // FC2's input gradient through the GELU: in FC2's data-gradient GEMM (its epilogue), or where FC1
  // takes it, in FC1's pass over its output gradient (ops::DgeluOnLoad).
  const bool fc1_applies_dgelu = fc_.impl().prologues.has(ops::Prologue::dgelu);
  proj_.backward({.dx = dpre_,
                  .dout = ctx_.stream.full,
                  .x = fc2_input(),
                  .dx_gelu_pre = fc1_applies_dgelu ? TensorView{} : pre_},
                 dout_local);
  const ops::OutputGrad dfc = fc1_applies_dgelu ? ops::OutputGrad(ops::DgeluOnLoad{dpre_, pre_}) : ops::OutputGrad(dpre_);
  return fc_.backward({.dx = ctx_.stream.col_dx, .dout = dfc, .x = x}, dx_local);
}

SwigluMlp::SwigluMlp(LayerBuilder& b, const MlpOptions& o) : Mlp(b, o, {o.hidden, o.hidden}, ops::Prologue::swiglu) {}

void SwigluMlp::declare_backward_scratch(ActivationTable::Rows& rows, const std::string& key) {
  rows.backward_scratch(dact_, key + ".dact", ctx_.act(), {ctx_.N, proj_.local_in()});
  // FC1's output gradient, unless FC1 computes it from the SwiGLU output's as it loads it.
  fc1_applies_dswiglu_ = fc_.impl().prologues.has(ops::Prologue::dswiglu);
  if (!fc1_applies_dswiglu_) rows.backward_scratch(dpre_, key + ".dpre", ctx_.act(), {ctx_.N, fc_.local_out()});
}

void SwigluMlp::forward_in(const NormOutput& x, float) {
  fc_.forward({pre_, {}, x.input}, x.local, x.read_after);
  if (act_written()) activate();
}

void SwigluMlp::activate() { ctx_.be.swiglu_forward({act_, pre_}); }

TensorView SwigluMlp::backward(const TensorView& dout_local, const ops::LinearInput& x, const TensorView& dx_local,
                               float) {
  if (act_refilled()) activate();
  proj_.backward({.dx = dact_, .dout = ctx_.stream.full, .x = fc2_input()}, dout_local);
  if (fc1_applies_dswiglu_)
    return fc_.backward({.dx = ctx_.stream.col_dx, .dout = ops::DswigluOnLoad{dact_, pre_}, .x = x}, dx_local);
  ctx_.be.swiglu_backward({dpre_, dact_, pre_});
  return fc_.backward({.dx = ctx_.stream.col_dx, .dout = dpre_, .x = x}, dx_local);
}

}  // namespace kiln::model
