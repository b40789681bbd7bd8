#pragma once
// A transformer block (Megatron-Core's TransformerLayer): two pre-norm residual sublayers, attention
// then the MLP, each `x + dropout(mixer(norm(x)))`, with the parts its spec names. The block owns
// what is about the block as a whole: its recompute plan (activation checkpointing), its dropout
// draws, and the saved input split over the TP group when that is asked for.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kiln/model/parts/mixer.hpp"
#include "kiln/model/parts/norm.hpp"

namespace kiln::model {

struct ModelSpec;

// The stages of a block's forward pass: a forward runs them all; a recompute in the backward pass
// those the block's recompute scope names (its output, FC2 and the last residual, never: the next
// block's saved input is that output, and the backward reads only the block's inner activations).
enum BlockStage : StageSet {
  kAttentionIn = 1,   // the attention's norm, QKV and the attention core
  kAttentionOut = 2,  // the attention's output projection, dropout and residual add
  kMlpIn = 4,         // the MLP's norm, FC1 and its activation
  kMlpOut = 8,        // FC2, dropout and the residual add
  kAllStages = 15,
};

// out = x + dropout(mixer(norm(x))): stage `in` runs the norm and the mixer's first part, stage `out`
// the mixer's last linear and the residual add.
class Sublayer {
 public:
  Sublayer(ModelContext& ctx, std::unique_ptr<Norm> norm, std::unique_ptr<Mixer> mixer, std::string key,
           StageSet in, StageSet out);

  void declare(ActivationTable::Rows& rows);
  // This forward's dropout masks (p > 0; else none): the mixer's own, then the hidden output's.
  void draw(rng::RngStatesTracker* tracker, float p);
  void forward(StageSet stages, const TensorView& x, const TensorView& out, float p);
  // The residual stream's gradient (ctx.stream.dres) through the sublayer, whose input was x.
  void backward(const TensorView& x, float p);
  const Mixer& mixer() const { return *mixer_; }
  Mixer& mixer() { return *mixer_; }

 private:
  ModelContext& ctx_;
  std::unique_ptr<Norm> norm_;
  std::unique_ptr<Mixer> mixer_;
  std::string key_;
  StageSet in_, out_;
  rng::PhiloxArgs dropout_rng_;
};

class TransformerBlock {
 public:
  // Block `index` (layer unit index + 1), its parameters registered through `b`.
  TransformerBlock(LayerBuilder b, int index, const ModelSpec& spec);

  int unit() const { return index_ + 1; }
  // Reads the block's recompute plan (an nn::ActivationRecompute component on its layer) and declares
  // its rows, once every module is installed.
  void declare(ActivationTable& table);
  // Once the table is allocated: tells an offloading module where the block's saved rows live (the
  // region of its nn::ActivationOffload slot).
  void placed(const ActivationTable& table);
  // Whether the block keeps only this TP rank's rows of its input (the input's full rows are then
  // scratch the model shares between blocks).
  bool distributes_input() const { return distribute_; }
  // Its dropout masks' draws from the tracker (p > 0; else none), as its forward makes them.
  void draw(rng::RngStatesTracker* tracker, float p);
  // x [Nl, C] -> out [Nl, C]; draws its dropout masks from the tracker (training with dropout).
  void forward(const TensorView& x, const TensorView& out, float p, rng::RngStatesTracker* tracker, bool training);
  // The residual stream's gradient (ctx.stream.dres) through the block, whose input was x; first
  // recomputes what the forward did not keep, between LayerRecomputeBegin and LayerRecomputeEnd.
  void backward(const TensorView& x);
  std::size_t scratch_bytes() const;
  double flops_per_token() const;
  // Its mixers, the attention's then the MLP's, with the names of their parameters' prefixes
  // ("blocks.3.attn", "blocks.3.mlp"): what the model asks of every mixer (its step's numbers, its
  // state, its inactive parameters) goes through them.
  std::vector<std::pair<std::string, Mixer*>> mixers();
  std::vector<std::pair<std::string, const Mixer*>> mixers() const;

 private:
  void recompute(const TensorView& x);
  void run(StageSet stages, const TensorView& x, const TensorView& out, float p, rng::RngStatesTracker* tracker);

  ModelContext& ctx_;
  int index_;
  Entity layer_;
  Sublayer attention_, mlp_;
  TensorView mid_;          // saved: x + the attention branch, the MLP's input [Nl, C]
  StageSet recomputed_ = 0;  // what the backward pass recomputes
  bool distribute_ = false;
  TensorView input_part_;   // with distribute_: this TP rank's rows of x
};

}  // namespace kiln::model
