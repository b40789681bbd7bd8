#include "kiln/model/parts/attention.hpp"

#include <algorithm>
#include <cmath>

#include "kiln/core/error.hpp"

namespace kiln::model {

namespace {
// The fused projection's rows: the query heads, then the key and the value heads, each split over TP.
parallel::ColumnParallelLinear qkv_layer(const ModelContext& ctx, const AttentionOptions& o) {
  const std::int64_t D = ctx.cfg.n_embd / o.heads;
  return parallel::ColumnParallelLinear(ctx.tp, ctx.cfg.n_embd, {o.heads * D, o.kv_heads * D, o.kv_heads * D});
}
}  // namespace

CausalSelfAttention::CausalSelfAttention(LayerBuilder& b, const AttentionOptions& o)
    : ctx_(b.ctx()),
      o_(o),
      D_(ctx_.cfg.n_embd / o.heads),
      Hl_(o.heads / ctx_.tp.size()),
      Kl_(o.kv_heads / ctx_.tp.size()),
      head_begin_(static_cast<int>(ctx_.tp.split(o.heads).first)),
      qkv_(b, "attn.qkv", nn::LinearRole::qkv, qkv_layer(ctx_, o), o.bias, o.init_std),
      proj_(b, "attn.proj", nn::LinearRole::attn_out, parallel::RowParallelLinear(ctx_.tp, ctx_.cfg.n_embd, ctx_.cfg.n_embd),
            o.bias, o.proj_init_std) {
  KILN_CHECK(o.heads > 0 && o.kv_heads > 0 && o.heads % o.kv_heads == 0 && ctx_.cfg.n_embd % o.heads == 0,
             "attention: ", o.heads, " query heads, ", o.kv_heads, " key/value heads, width ", ctx_.cfg.n_embd);
}

void CausalSelfAttention::declare(ActivationTable::Rows& rows, const std::string& key, StageSet stage) {
  const DType act = ctx_.act();
  rows.saved(qkv_out_, key + ".qkv", act, {ctx_.B, ctx_.T, Hl_ + 2 * Kl_, D_}, stage);
  rows.saved(context_, key + ".context", act, {ctx_.B, ctx_.T, Hl_, D_}, stage);
  rows.saved(lse_, key + ".lse", DType::f32, {ctx_.B, Hl_, ctx_.T}, stage);
  rows.backward_scratch(dcontext_, key + ".dcontext", act, {ctx_.N, proj_.local_in()});
  rows.backward_scratch(dqkv_, key + ".dqkv", act, {ctx_.N, qkv_.local_out()});
}

void CausalSelfAttention::draw(rng::RngStatesTracker* tracker, float p) {
  probs_rng_ = {};
  if (p <= 0) return;
  // The probabilities are sharded by heads under tensor parallelism: the model-parallel state, by
  // global head index.
  auto scope = tracker->fork(rng::kModelParallelRng);
  probs_rng_ = tracker->draw(static_cast<std::uint64_t>(ctx_.batch_sequences) * o_.heads * ctx_.T * ctx_.T);
}

TensorView CausalSelfAttention::heads_view(const TensorView& qkv) const {
  return Kl_ == Hl_ ? qkv.reshape({ctx_.B, ctx_.T, 3, Hl_, D_}) : qkv;
}

float CausalSelfAttention::scale() const { return 1.0f / std::sqrt(static_cast<float>(D_)); }

void CausalSelfAttention::rotate(const TensorView& qkv, bool inverse) const {
  // Positions count from each sequence's start (a micro-batch holds whole sequences).
  ctx_.be.rope({qkv, Hl_ + Kl_, o_.rope->theta, 0, inverse, o_.rope->scaling});
}

void CausalSelfAttention::forward_in(const NormOutput& x, float p) {
  qkv_.forward({qkv_out_.reshape({ctx_.N, qkv_.local_out()}), {}, x.input}, x.local, x.read_after);
  if (o_.rope) rotate(qkv_out_, false);
  ctx_.be.attention_forward({context_, lse_, heads_view(qkv_out_), scale(), p, probs_rng_, head_begin_, o_.heads,
                             ctx_.seq_offset, kv_heads_arg(), ctx_.doc_start});
}

void CausalSelfAttention::forward_out(const TensorView& out_local) {
  proj_.forward({ctx_.stream.row_out, {}, context_.reshape({ctx_.N, proj_.local_in()})}, out_local);
}

TensorView CausalSelfAttention::backward(const TensorView& dout_local, const ops::LinearInput& x,
                                         const TensorView& dx_local, float p) {
  proj_.backward({.dx = dcontext_, .dout = ctx_.stream.full, .x = context_.reshape({ctx_.N, proj_.local_in()})},
                 dout_local);
  const TensorView dqkv = dqkv_.reshape(qkv_out_.shape);
  ctx_.be.attention_backward({heads_view(dqkv), dcontext_.reshape(context_.shape), context_, lse_, heads_view(qkv_out_),
                              scale(), p, probs_rng_, head_begin_, o_.heads, ctx_.seq_offset, kv_heads_arg(),
                              ctx_.doc_start});
  if (o_.rope) rotate(dqkv, true);  // the rotation's backward is the inverse rotation
  return qkv_.backward({.dx = ctx_.stream.col_dx, .dout = dqkv_, .x = x}, dx_local);
}

std::size_t CausalSelfAttention::scratch_bytes() const {
  return std::max(qkv_.scratch_bytes(ctx_.N), proj_.scratch_bytes(ctx_.N));
}

double CausalSelfAttention::flops_per_token() const {
  // 6 per weight element (forward and two backward GEMMs), and the scores and values: 4 T C
  // forward per token, times 3, counted without causal savings (PaLM).
  const auto& q = qkv_.layer();
  const auto& o = proj_.layer();
  return 6.0 * (double(q.out()) * double(q.in()) + double(o.out()) * double(o.in())) +
         12.0 * ctx_.T * ctx_.cfg.n_embd;
}

}  // namespace kiln::model
