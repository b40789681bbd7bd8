// The one place model.arch becomes parts.
#include "kiln/model/spec.hpp"

#include <algorithm>
#include <cmath>

namespace kiln::model {

ModelSpec model_spec(const ModelConfig& cfg) {
  ModelSpec s;
  // Residual projections scaled by 1/sqrt(2L): GPT-2's, and Megatron's output_layer_init_method for
  // Llama (Hugging Face's Llama draws them with init_std like every other matrix).
  const float proj_std = cfg.init_std / std::sqrt(2.0f * cfg.n_layer);
  s.attention = {.heads = cfg.n_head, .kv_heads = cfg.kv_heads(), .bias = true, .rope = std::nullopt,
                 .init_std = cfg.init_std, .proj_init_std = proj_std};
  s.mlp_options = {.hidden = cfg.mlp_hidden(), .bias = true, .init_std = cfg.init_std, .proj_init_std = proj_std};
  s.tie_embeddings = cfg.tie_embeddings;
  s.head_chunk_rows = cfg.head_chunk_rows;
  if (cfg.moe.enabled()) {
    s.moe = MoeOptions{.n_experts = cfg.moe.n_experts,
                       .top_k = cfg.moe.top_k,
                       .hidden = cfg.expert_hidden(),
                       .score = cfg.moe.router == MoeRouter::sigmoid ? ops::MoeScore::sigmoid : ops::MoeScore::softmax,
                       .normalize_gates = cfg.moe.normalize_gates,
                       .aux_loss_coeff = cfg.moe.aux_loss_coeff,
                       .z_loss_coeff = cfg.moe.z_loss_coeff,
                       .bias_update_rate = cfg.moe.bias_update_rate,
                       .capacity_factor = cfg.moe.capacity_factor,
                       .expert_dropout = cfg.moe.expert_dropout,
                       .init_std = cfg.init_std,
                       .proj_init_std = proj_std};
    s.moe_every = cfg.moe.every;
    s.shared_experts = cfg.moe.shared_experts;
  }
  switch (cfg.arch) {
    case Arch::gpt2:
      s.norm = NormKind::layernorm;
      s.positions = Positions::learned;
      s.mlp = MlpKind::gelu;
      break;
    case Arch::llama:
      s.norm = NormKind::rmsnorm;
      s.positions = Positions::rotary;
      s.attention.rope = RotaryEmbedding{cfg.rope_theta, cfg.rope_scaling.op()};
      s.attention.bias = false;
      s.mlp = MlpKind::swiglu;
      s.mlp_options.bias = false;
      break;
  }
  // The experts are the architecture's MLP without biases (as Mixtral's and DeepSeek's are).
  if (s.moe) s.moe->activation = s.mlp == MlpKind::swiglu ? ExpertActivation::swiglu : ExpertActivation::gelu;
  return s;
}

std::unique_ptr<Norm> ModelSpec::make_norm(LayerBuilder& b, const std::string& name, Norm::Output output) const {
  if (norm == NormKind::rmsnorm) return std::make_unique<RmsNorm>(b, name, output);
  return std::make_unique<LayerNorm>(b, name, output);
}

std::unique_ptr<OutputHead> ModelSpec::make_head(LayerBuilder& b, std::optional<Entity> tied) const {
  if (head_chunk_rows > 0) return std::make_unique<ChunkedLossHead>(b, *this, tied, head_chunk_rows);
  return std::make_unique<LogitsHead>(b, *this, tied);
}

std::unique_ptr<Mixer> ModelSpec::make_attention(LayerBuilder& b) const {
  return std::make_unique<CausalSelfAttention>(b, attention);
}

std::unique_ptr<Mlp> ModelSpec::make_dense_mlp(LayerBuilder& b, const MlpOptions& o) const {
  if (mlp == MlpKind::swiglu) return std::make_unique<SwigluMlp>(b, o);
  return std::make_unique<GeluMlp>(b, o);
}

std::unique_ptr<Mixer> ModelSpec::make_mlp(LayerBuilder& b, int block) const {
  if (!moe || block % moe_every != 0) return make_dense_mlp(b, mlp_options);
  std::unique_ptr<Mlp> shared;
  if (shared_experts > 0) {  // one dense MLP as wide as the shared experts together, without biases
    MlpOptions o = mlp_options;
    o.name = "mlp.shared";
    o.hidden = shared_experts * moe->hidden;
    o.bias = false;
    shared = make_dense_mlp(b, o);
  }
  return std::make_unique<MoeMlp>(b, *moe, std::move(shared));
}

const char* ModelSpec::norm_stem() const { return norm == NormKind::rmsnorm ? RmsNorm::kStem : LayerNorm::kStem; }

std::vector<parallel::SplitDim> tensor_parallel_splits(const ModelConfig& cfg, std::int64_t tokens,
                                                       bool sequence_parallel, bool vocab_parallel) {
  // The heads split the attention (and with them the width: n_embd = n_head x head dim); the key
  // and value heads, the MLP's hidden width; sequence parallelism the tokens; vocabulary
  // parallelism the padded vocabulary.
  std::vector<parallel::SplitDim> dims = {{cfg.n_head, "model.n_head", "attention heads"}};
  if (cfg.n_kv_head > 0) dims.push_back({cfg.n_kv_head, "model.n_kv_head", "key/value heads"});
  const bool dense_blocks = !cfg.moe.enabled() || (cfg.moe.every > 1 && cfg.n_layer > 1);
  if (dense_blocks)
    dims.push_back({cfg.mlp_hidden(), cfg.ffn_hidden > 0 ? "model.ffn_hidden" : "model.n_embd",
                    "MLP hidden features (model.ffn_hidden, or its default from model.n_embd)"});
  if (cfg.moe.enabled())
    dims.push_back({cfg.expert_hidden(), cfg.moe.hidden > 0 ? "model.moe.hidden" : "model.ffn_hidden",
                    "expert hidden features (model.moe.hidden, or the dense MLP's width)"});
  if (sequence_parallel)
    dims.push_back({tokens, "parallel.sequence_parallel",
                    "tokens of a micro-batch (train.micro_batch_size x train.seq_len)"});
  if (vocab_parallel)
    dims.push_back({cfg.padded_vocab(), "parallel.vocab_parallel",
                    cat("vocabulary rows (model.vocab_size ", cfg.vocab_size, " padded to a multiple of model.vocab_multiple = ",
                        cfg.vocab_multiple, ")")});
  return dims;
}

}  // namespace kiln::model

namespace kiln::model {

double block_flops_estimate(const ModelConfig& cfg, int T, int block) {
  const double C = cfg.n_embd, D = cfg.head_dim(), kv = cfg.kv_heads();
  const double parts = cfg.llama() ? 2.0 : 1.0;  // FC1's rows per hidden feature (SwiGLU: gate and up)
  const double attention = 6.0 * ((C + 2.0 * kv * D) * C + C * C) + 12.0 * T * C;
  auto mlp = [&](double hidden) { return 6.0 * (parts * hidden * C + hidden * C); };
  if (!cfg.moe.enabled() || block % std::max(1, cfg.moe.every) != 0) return attention + mlp(cfg.mlp_hidden());
  const double experts = cfg.moe.top_k * mlp(cfg.expert_hidden()) + 6.0 * C * cfg.moe.n_experts;
  return attention + experts + (cfg.moe.shared_experts > 0 ? mlp(cfg.moe.shared_experts * cfg.expert_hidden()) : 0.0);
}

double head_flops_estimate(const ModelConfig& cfg) { return 6.0 * cfg.n_embd * cfg.padded_vocab(); }

}  // namespace kiln::model
