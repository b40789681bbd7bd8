#pragma once
// A normalisation of this rank's rows of the residual stream, feeding one column-parallel linear
// (its consumer): a block's pre-norms (QKV's and FC1's inputs) and the final norm (the LM head's).
//
// Its output is the consumer's input. It is written (and gathered over the TP group under sequence
// parallelism), or, where the consumer's implementation takes the norm as a prologue
// (ops::LayerNormOnLoad), computed by the consumer itself while it loads its input: then nothing is
// written or recomputed. The consumer's backward reads it again: kept from the forward, recomputed
// (model.recompute_norm), or not at all (the consumer keeps its own copy, LinearImpl::keeps_input).
//
// LayerNorm and RmsNorm are the two types; a model's spec picks one (spec.hpp).
#include <memory>
#include <optional>
#include <string>

#include "kiln/model/parts/activation_table.hpp"
#include "kiln/model/parts/layer_builder.hpp"
#include "kiln/ops/prologue.hpp"

namespace kiln::model {

// What a norm hands its consumer: the input of its forward, and this rank's rows of it, which a
// column-parallel linear gathers under sequence parallelism (empty for a prologue: nothing to gather).
struct NormOutput {
  ops::LinearInput input;
  TensorView local;
  // Whether anything reads `input` after the consumer's linear has gathered it under sequence
  // parallelism: that linear's backward (the output saved for it), or a MoE layer's router beside its
  // shared experts. Then it is gathered as it is; else the linear may gather it in its own form
  // (ops::LinearImpl::forward_gathered: FP8 codes), `input` left unwritten.
  bool read_after = true;
};

class Norm {
 public:
  // How the output is kept: as model.recompute_norm says (a block's pre-norm), or always (the final
  // norm, whose output is the model's own tensor).
  enum class Output { per_config, always_kept };
  virtual ~Norm() = default;
  Norm(const Norm&) = delete;
  Norm& operator=(const Norm&) = delete;

  // The linear that reads the output; made after the norm (it belongs to the next part).
  void feed(Entity consumer);
  // Declares the statistics and the output, once modules have attached their components (the
  // consumer's implementation decides what is written). `key` names the rows (e.g. "attention.norm");
  // `stage`: the block stage that writes them.
  void declare(ActivationTable::Rows& rows, const std::string& key, StageSet stage);
  // Normalises this rank's rows of x [Nl, C]; returns the consumer's input.
  NormOutput forward(const TensorView& x);
  // The consumer's input for its backward pass, recomputed first where it was not kept.
  ops::LinearInput backward_input(const TensorView& x);
  // dx [Nl, C] += the gradient through the norm of x, given this rank's rows of the output's gradient.
  virtual void backward(const TensorView& dx, const TensorView& dout, const TensorView& x) = 0;

 protected:
  Norm(LayerBuilder& b, Output output);
  // The statistics' rows ([Nl] f32 each).
  virtual void declare_stats(ActivationTable::Rows& rows, const std::string& key, StageSet stage) = 0;
  // The norm of x into out (this rank's rows), writing the statistics.
  virtual void run(const TensorView& out, const TensorView& x) = 0;
  // The prologue that computes this norm of x while its consumer loads its input (ops::LayerNormOnLoad),
  // where this norm has one, and the prologue itself.
  virtual std::optional<ops::Prologue> prologue_kind() const { return std::nullopt; }
  virtual ops::LinearInput prologue(const TensorView& x) const;

  ModelContext& ctx_;
  TensorView w(bool grad) const;
  TensorView b(bool grad) const;  // empty without a bias
  Entity weight_{};
  std::optional<Entity> bias_;

 private:
  Output output_kind_;
  Entity consumer_{};
  TensorView output_;      // [N, C]: the consumer's whole input
  bool refill_ = false;    // recomputed for the backward pass
  bool saved_ = true;      // the output is kept for the consumer's backward (NormOutput::read_after)
  bool on_load_ = false;   // computed by the consumer (a prologue): never written
};

// LayerNorm: (x - mean) * rstd * weight + bias (GPT-2). Parameters `<prefix>ln_<name>.weight/bias`.
class LayerNorm final : public Norm {
 public:
  static constexpr const char* kStem = "ln_";
  LayerNorm(LayerBuilder& b, const std::string& name, Output output);
  void backward(const TensorView& dx, const TensorView& dout, const TensorView& x) override;

 private:
  void declare_stats(ActivationTable::Rows& rows, const std::string& key, StageSet stage) override;
  void run(const TensorView& out, const TensorView& x) override;
  std::optional<ops::Prologue> prologue_kind() const override { return ops::Prologue::layernorm; }
  ops::LinearInput prologue(const TensorView& x) const override;
  TensorView mean_, rstd_;
};

// RMSNorm: x * rstd * weight, no mean, no bias (Llama). Parameter `<prefix>norm_<name>.weight`.
class RmsNorm final : public Norm {
 public:
  static constexpr const char* kStem = "norm_";
  RmsNorm(LayerBuilder& b, const std::string& name, Output output);
  void backward(const TensorView& dx, const TensorView& dout, const TensorView& x) override;

 private:
  void declare_stats(ActivationTable::Rows& rows, const std::string& key, StageSet stage) override;
  void run(const TensorView& out, const TensorView& x) override;
  TensorView rstd_;
};

}  // namespace kiln::model
