#include "kiln/model/hf.hpp"

#include "kiln/core/error.hpp"

namespace kiln::model {

interop::Gpt2Shape gpt2_shape(const ModelConfig& cfg) {
  KILN_CHECK(cfg.arch == Arch::gpt2, "Hugging Face GPT-2 weights are for model.arch = \"gpt2\"; this model is a llama");
  KILN_CHECK(!cfg.moe.enabled(), "Hugging Face GPT-2 weights have dense MLPs; this model has a mixture of experts");
  return {.n_layer = cfg.n_layer,
          .n_head = cfg.n_head,
          .n_embd = cfg.n_embd,
          .vocab_size = cfg.vocab_size,
          .padded_vocab = cfg.padded_vocab(),
          .max_seq_len = cfg.max_seq_len,
          .norm_eps = cfg.norm_eps,
          .init_std = cfg.init_std,
          .dropout = cfg.dropout};
}

ModelConfig with_gpt2_shape(ModelConfig base, const interop::Gpt2Shape& shape) {
  base.arch = Arch::gpt2;
  base.n_layer = shape.n_layer;
  base.n_head = shape.n_head;
  base.n_embd = shape.n_embd;
  base.vocab_size = shape.vocab_size;
  base.max_seq_len = shape.max_seq_len;
  base.norm_eps = shape.norm_eps;
  return base;
}

}  // namespace kiln::model
