#pragma once
#include <cstdint>
#include <string>

#include <boost/describe/enum.hpp>

#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/config/schema.hpp"
#include "kiln/model/moe_config.hpp"
#include "kiln/model/rope_config.hpp"

namespace kiln::model {

// gpt2: LayerNorm with bias, learned positions, GELU MLP (4 x n_embd), biases on every linear,
// multi-head attention, the LM head tied to the embedding. llama: RMSNorm, rotary positions,
// SwiGLU MLP, no biases, grouped-query attention, the LM head tied or not. Both run on the same
// parallel layers and modules (Megatron's GPTModel takes Llama the same way, by configuration).
enum class Arch { gpt2, llama };
BOOST_DESCRIBE_ENUM(Arch, gpt2, llama)

struct ModelConfig {
  Arch arch = Arch::gpt2;
  int n_layer = 12;
  int n_head = 12;
  int n_kv_head = 0;
  int n_embd = 768;
  int ffn_hidden = 0;
  int vocab_size = 50257;
  int max_seq_len = 1024;
  int vocab_multiple = 128;
  float dropout = 0.0f;
  float init_std = 0.02f;
  float norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  RopeScalingConfig rope_scaling;
  bool tie_embeddings = true;
  bool recompute_norm = true;
  bool recompute_gelu = true;
  bool report_activations = false;
  int head_chunk_rows = 0;
  std::string init_from;
  MoeConfig moe;
  void validate(config::Checks& c) const {
    c.expect(n_layer > 0, "n_layer", "must be positive");
    c.expect(n_head > 0, "n_head", "must be positive");
    c.expect(n_embd > 0 && n_head > 0 && n_embd % n_head == 0, "n_embd", "must be a positive multiple of n_head");
    c.expect(vocab_size > 0, "vocab_size", "must be positive");
    c.expect(max_seq_len > 0, "max_seq_len", "must be positive");
    c.expect(vocab_multiple > 0, "vocab_multiple", "must be positive");
    c.expect(dropout >= 0 && dropout < 1, "dropout", "must be in [0, 1)");
    c.expect(init_std > 0, "init_std", "must be positive");
    c.expect(norm_eps > 0, "norm_eps", "must be positive");
    c.expect(n_kv_head >= 0, "n_kv_head", "must be 0 (n_head) or positive");
    c.expect(n_kv_head == 0 || n_head % n_kv_head == 0, "n_kv_head",
             "must divide n_head (each key/value head serves n_head / n_kv_head query heads)");
    c.expect(n_kv_head == 0 || n_kv_head == n_head || arch == Arch::llama, "n_kv_head",
             "grouped-query attention needs arch = \"llama\" (GPT-2 is multi-head: leave it 0)");
    c.expect(head_chunk_rows >= 0, "head_chunk_rows", "must be 0 (the whole micro-batch's logits at once) or positive");
    c.expect(ffn_hidden >= 0, "ffn_hidden", "must be 0 (the architecture's default) or positive");
    c.expect(rope_theta > 0, "rope_theta", "must be positive");
    c.expect(!rope_scaling.enabled() || arch == Arch::llama, "rope_scaling.type",
             "scales rotary embeddings: it needs arch = \"llama\" (gpt2 learns its positions)");
    c.expect(tie_embeddings || arch == Arch::llama, "tie_embeddings",
             "gpt2 ties its LM head to the token embedding (false needs arch = \"llama\")");
    c.expect(arch != Arch::llama || n_head <= 0 || n_embd % n_head != 0 || head_dim() % 2 == 0, "n_embd",
             "rotary embeddings rotate pairs of channels: the head dimension n_embd / n_head must be even");
  }
  int head_dim() const { return n_embd / n_head; }
  int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  // The MLP's hidden width: ffn_hidden, else GPT-2's 4 x n_embd, or Llama's 8/3 x n_embd rounded up
  // to a multiple of 256 (as Meta's reference code with ffn_dim_multiplier 1).
  int mlp_hidden() const {
    if (ffn_hidden > 0) return ffn_hidden;
    if (arch == Arch::gpt2) return 4 * n_embd;
    const int f = 8 * n_embd / 3;
    return (f + 255) / 256 * 256;
  }
  // A mixture of experts' expert width: model.moe.hidden, else the dense MLP's.
  int expert_hidden() const { return moe.hidden > 0 ? moe.hidden : mlp_hidden(); }
  bool llama() const { return arch == Arch::llama; }
  int padded_vocab() const { return (vocab_size + vocab_multiple - 1) / vocab_multiple * vocab_multiple; }
};
KILN_CONFIG(ModelConfig,
            (arch,
             "gpt2 (LayerNorm, learned positions, GELU, biases) or llama (RMSNorm, rotary positions, SwiGLU, no "
             "biases, grouped-query attention)"),
            (n_layer, "transformer blocks"),
            (n_head, "attention (query) heads"),
            (n_kv_head, "key/value heads (llama; 0: n_head, multi-head; 1: multi-query; must divide n_head)"),
            (n_embd, "model width (channels)"),
            (ffn_hidden,
             "the MLP's hidden width (0: 4 x n_embd for gpt2; for llama 8/3 x n_embd rounded up to a multiple of "
             "256)"),
            (vocab_size, "vocabulary size (tokens must be below it)"),
            (max_seq_len,
             "the longest sequence: positions in gpt2's learned position embedding (train.seq_len must not "
             "exceed it)"),
            (vocab_multiple, "the embedding and LM head are padded to a multiple of this"),
            (dropout, "dropout probability on attention probabilities and on the blocks' hidden outputs"),
            (init_std, "standard deviation of the normal weight initialisation"),
            (norm_eps, "the epsilon of the LayerNorms (gpt2) or RMSNorms (llama)"),
            (rope_theta, "llama: the rotary embedding's base (Llama 2: 10000, Llama 3: 500000)"),
            (rope_scaling, "llama: the rotary embedding's frequencies scaled for long contexts ([model.rope_scaling])"),
            (tie_embeddings, "the LM head reuses the token embedding (gpt2 always ties it)"),
            (recompute_norm,
             "recompute the blocks' LayerNorm outputs in the backward pass instead of keeping them (2 of 16 "
             "saved values per token and layer); under sequence parallelism the recomputed rows are gathered "
             "over TP again, so false also saves those gathers (FP8 layers then keep their own FP8 copy)"),
            (recompute_gelu,
             "recompute the MLP's activations (GELU, or SwiGLU for llama) in the backward pass instead of "
             "keeping them (gpt2: 4 of 16 saved values per token and layer)"),
            (report_activations,
             "print at start what a block keeps for its backward pass: each saved tensor's type, shape and bytes"),
            (head_chunk_rows,
             "0: the LM head computes a micro-batch's logits [tokens, vocabulary] in the forward pass and keeps them "
             "(as dlogits) for the backward; N > 0: N tokens' logits at a time, logits, loss and gradients together "
             "in the backward pass, so the logits take N / tokens of the memory (or what the blocks' backward scratch, which "
             "lives there, needs); the loss is reported as before"),
            (init_from,
             "start from these weights instead of random ones: a Hugging Face model directory (Llama or GPT-2: "
             "config.json, whose shape fills this section's architecture keys, and model.safetensors or its "
             "sharded files with the index), or a GPT-2 .safetensors file (this section gives the shape); a "
             "checkpoint to resume from takes precedence"),
            (moe, "mixture-of-experts MLPs ([model.moe])"))

}  // namespace kiln::model
