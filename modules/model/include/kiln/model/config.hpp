#pragma once
#include <cstdint>
#include <string>

#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/config/schema.hpp"

namespace kiln::model {

struct ModelConfig {
  int n_layer = 12;
  int n_head = 12;
  int n_embd = 768;
  int vocab_size = 50257;
  int max_seq_len = 1024;
  int vocab_multiple = 128;
  float dropout = 0.0f;
  float init_std = 0.02f;
  float ln_eps = 1e-5f;
  bool recompute_norm = true;
  bool recompute_gelu = true;
  std::string init_from;
  void validate(config::Checks& c) const {
    c.expect(n_layer > 0, "n_layer", "must be positive");
    c.expect(n_head > 0, "n_head", "must be positive");
    c.expect(n_embd > 0 && n_head > 0 && n_embd % n_head == 0, "n_embd", "must be a positive multiple of n_head");
    c.expect(vocab_size > 0, "vocab_size", "must be positive");
    c.expect(max_seq_len > 0, "max_seq_len", "must be positive");
    c.expect(vocab_multiple > 0, "vocab_multiple", "must be positive");
    c.expect(dropout >= 0 && dropout < 1, "dropout", "must be in [0, 1)");
    c.expect(init_std > 0, "init_std", "must be positive");
    c.expect(ln_eps > 0, "ln_eps", "must be positive");
  }
  int head_dim() const { return n_embd / n_head; }
  int padded_vocab() const { return (vocab_size + vocab_multiple - 1) / vocab_multiple * vocab_multiple; }
};
KILN_CONFIG(ModelConfig,
            (n_layer, "transformer blocks"),
            (n_head, "attention heads"),
            (n_embd, "model width (channels)"),
            (vocab_size, "vocabulary size (tokens must be below it)"),
            (max_seq_len, "positions in the learned position embedding (train.seq_len must not exceed it)"),
            (vocab_multiple, "the embedding and LM head are padded to a multiple of this"),
            (dropout, "dropout probability on attention probabilities and on the blocks' hidden outputs"),
            (init_std, "standard deviation of the normal weight initialisation"),
            (ln_eps, "LayerNorm epsilon"),
            (recompute_norm,
             "recompute the blocks' LayerNorm outputs in the backward pass instead of keeping them (2 of 16 "
             "saved values per token and layer)"),
            (recompute_gelu,
             "recompute the GELU activations in the backward pass instead of keeping them (4 of 16 saved values "
             "per token and layer)"),
            (init_from,
             "start from these weights instead of random ones: a safetensors file with Hugging Face GPT-2 names "
             "(config.json beside it is not read; this section's shape must match); a checkpoint to resume from "
             "takes precedence"))

}  // namespace kiln::model
