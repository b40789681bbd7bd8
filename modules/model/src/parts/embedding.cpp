#include "kiln/model/parts/embedding.hpp"

namespace kiln::model {

Embedding::Embedding(LayerBuilder b, bool learned_positions)
    : ctx_(b.ctx()), layer_(ctx_.tp, ctx_.cfg.padded_vocab(), ctx_.cfg.n_embd) {
  const float std = ctx_.cfg.init_std;
  wte_ = b.param("wte", {layer_.vocab(), ctx_.cfg.n_embd}, layer_.weight_shard(), ParamInit::normal(std), true);
  if (learned_positions)
    wpe_ = b.param("wpe", {ctx_.cfg.max_seq_len, ctx_.cfg.n_embd}, TensorShard{}, ParamInit::normal(std), true);
}

Entity Embedding::table_copy(LayerBuilder& b) {
  ModelContext& ctx = b.ctx();
  const parallel::VocabParallelEmbedding layer(ctx.tp, ctx.cfg.padded_vocab(), ctx.cfg.n_embd);
  return b.param("wte", {layer.vocab(), ctx.cfg.n_embd}, layer.weight_shard(), ParamInit::normal(ctx.cfg.init_std), true);
}

void Embedding::forward(const TensorView& tokens, const TensorView& out_local) const {
  // Every rank looks up all rows and keeps its own (sequence parallelism), or its vocabulary rows'
  // part of all of them, summed over TP (vocabulary parallelism).
  ops::EmbeddingForward a{ctx_.stream.full, tokens, ctx_.param(wte_, false),
                          wpe_ ? ctx_.param(*wpe_, false) : TensorView{}, ctx_.T};
  a.positions = wpe_.has_value();
  layer_.forward(a, out_local);
}

void Embedding::backward(const TensorView& tokens, const std::int32_t* tokens_host, const TensorView& dout_local) const {
  layer_.backward({ctx_.param(wte_, true), wpe_ ? ctx_.param(*wpe_, true) : TensorView{}, ctx_.stream.full, tokens,
                   tokens_host, ctx_.T},
                  dout_local);
}

}  // namespace kiln::model
