#pragma once
// MLPs of two linears around an activation: FC1 (column-parallel: C -> hidden, split by hidden
// features), the activation, FC2 (row-parallel: hidden -> C, summed over the TP group).
//
// The activation's output is FC2's input. Where FC2's implementation takes the activation as a
// prologue (ops::GeluOnLoad, ops::SwigluOnLoad) FC2 computes it while it loads its input, forward
// and backward, and it is never written; otherwise it is written and kept for the backward pass,
// recomputed there (model.recompute_gelu), or not needed there (FC2 keeps its own copy of its input,
// LinearImpl::keeps_input).
//
// GeluMlp (GPT-2) and SwigluMlp (Llama) are the two types; a model's spec picks one (spec.hpp).
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/model/parts/linear.hpp"
#include "kiln/model/parts/mixer.hpp"

namespace kiln::model {

// Where an activation's output (FC2's input) lives: written and kept for the backward pass, written
// and recomputed there (model.recompute_gelu), written for the forward only (FC2's implementation
// keeps its own copy of its input), or never written (FC2's implementation computes it from FC1's
// output as it loads it).
enum class ActOutput { saved, refilled, forward_only, on_load };
ActOutput act_output_for(bool fc2_takes_prologue, bool fc2_keeps_input, bool recompute);

struct MlpOptions {
  std::string name = "mlp";  // its linears are <name>.fc and <name>.proj
  int hidden = 0;    // hidden features (all ranks): GELU's width, or SwiGLU's gate (and up) width
  bool bias = true;  // FC1 and FC2 biases
  float init_std = 0.02f, proj_init_std = 0.02f;
};

class Mlp : public Mixer {
 public:
  Entity input_linear() const override { return fc_.entity(); }
  void declare(ActivationTable::Rows& rows, const std::string& key, StageSet stage) override;
  void forward_out(const TensorView& out_local) override;
  std::size_t scratch_bytes() const override;
  double flops_per_token() const override;

 protected:
  // FC1's output is `fc_parts` blocks of rows (GELU: one, SwiGLU: gate and up), each split over TP.
  Mlp(LayerBuilder& b, const MlpOptions& o, const std::vector<std::int64_t>& fc_parts, ops::Prologue act_prologue);
  // FC2's input as the prologue computing the activation from FC1's output.
  virtual ops::LinearInput act_on_load() const = 0;
  // The activation's output from FC1's, written (a forward, or a recompute for the backward pass).
  virtual void activate() = 0;
  // Whether the forward writes the activation's output with activate() itself, so that a recompute's
  // output has the bits a refill would (not where FC1's GEMM epilogue computes it).
  virtual bool forward_activates() const { return true; }
  virtual void declare_backward_scratch(ActivationTable::Rows& rows, const std::string& key) { (void)rows, (void)key; }
  // FC2's input, as its forward read it.
  ops::LinearInput fc2_input() const { return act_output_ == ActOutput::on_load ? act_on_load() : ops::LinearInput(act_); }
  bool act_written() const { return act_output_ != ActOutput::on_load; }
  bool act_refilled() const { return act_output_ == ActOutput::refilled; }

  ModelContext& ctx_;
  ColumnLinear fc_;
  RowLinear proj_;
  TensorView pre_;   // saved: FC1's output [N, fc_.local_out()]
  TensorView act_;   // the activation's output, FC2's input [N, proj_.local_in()]
  TensorView dpre_;  // backward scratch: FC1's output gradient (declared by the subclass that needs it)

 private:
  ops::Prologue act_prologue_;
  ActOutput act_output_ = ActOutput::saved;
};

// FC1 -> GELU (tanh approximation) -> FC2. Without GELU on load FC1 writes the GELU's output with
// its pre-activation (the GEMM's epilogue); FC2's data gradient applies gelu'() as its epilogue, or
// hands FC1 the GELU output's gradient where FC1 applies it on load (ops::DgeluOnLoad).
class GeluMlp final : public Mlp {
 public:
  GeluMlp(LayerBuilder& b, const MlpOptions& o);
  void forward_in(const NormOutput& x, float p) override;
  TensorView backward(const TensorView& dout_local, const ops::LinearInput& x, const TensorView& dx_local,
                      float p) override;

 private:
  ops::LinearInput act_on_load() const override { return ops::GeluOnLoad{pre_}; }
  void activate() override;
  bool forward_activates() const override { return false; }  // FC1's epilogue
  void declare_backward_scratch(ActivationTable::Rows& rows, const std::string& key) override;
};

// FC1 (gate and up projections, [N, 2 hidden]) -> silu(gate) * up -> FC2 (Llama).
class SwigluMlp final : public Mlp {
 public:
  SwigluMlp(LayerBuilder& b, const MlpOptions& o);
  void forward_in(const NormOutput& x, float p) override;
  TensorView backward(const TensorView& dout_local, const ops::LinearInput& x, const TensorView& dx_local,
                      float p) override;

 private:
  ops::LinearInput act_on_load() const override { return ops::SwigluOnLoad{pre_}; }
  void activate() override;
  void declare_backward_scratch(ActivationTable::Rows& rows, const std::string& key) override;
  TensorView dact_;  // backward scratch: the SwiGLU output's gradient [N, hidden / tp]
  bool fc1_applies_dswiglu_ = false;  // FC1 takes ops::DswigluOnLoad: dpre_ is never written
};

}  // namespace kiln::model
