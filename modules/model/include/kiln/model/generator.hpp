#pragma once
// Autoregressive generation with a KV cache from the weights of a model the spec of model.arch
// describes (spec.hpp: GPT-2's or Llama's parts). An inference class apart from the training model
// (GptModel keeps only what training needs): the same forward pass (the spec's norm, positions,
// attention with its key/value heads, MLP and biases; 1/sqrt(D) attention scale, pre-norm
// residuals, tied or untied LM head) through the same backend ops, on one sequence.
//
// The KV cache of each block is its fused QKV projection for every position, [max_seq_len, H + 2K,
// D] (the layout attention_forward reads; [max_seq_len, 3, H, D] with as many key/value heads as
// query heads), rotated by RoPE as it is written where the spec has rotary positions: the QKV linear
// writes each new position's row into it, a prompt is
// prefilled by the causal attention_forward over its rows, and each later token attends over the
// cache with attention_decode. The cached q rows cost more memory than K and V alone, and save
// every copy.
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "kiln/model/arena.hpp"
#include "kiln/model/config.hpp"
#include "kiln/model/sampling.hpp"
#include "kiln/model/spec.hpp"
#include "kiln/ops/backend.hpp"

namespace kiln::model {

// A parameter's whole f32 weight by its kiln name ("wte", "blocks.0.attn.qkv.weight", ...), in its
// global shape, row-major (see GptModel for the names and shapes).
using WeightSource = std::function<std::vector<float>(const std::string& name)>;

class Generator {
 public:
  // Uploads the weights in the backend's activation dtype (rounded as the training compute copy is)
  // and allocates the cache and the activations for max_seq_len positions.
  Generator(const ModelConfig& cfg, ops::Backend& backend, const WeightSource& weights);

  // Positions in the cache, and how many it holds at most (model.max_seq_len).
  int length() const { return length_; }
  int capacity() const { return cfg_.max_seq_len; }
  void reset() { length_ = 0; }

  // Empties the cache and runs the prompt in one pass of causal attention. Returns the next-token
  // logits over the real vocabulary: of every prompt position ([prompt.size(), vocab_size] row-major)
  // with all_positions, else of the last one ([vocab_size]). With `doc_start` (one per prompt token,
  // packed documents as a training batch carries them), position i attends to [doc_start[i], i] only.
  std::vector<float> prefill(std::span<const int> prompt, bool all_positions = false,
                             std::span<const std::int32_t> doc_start = {});
  // Appends one token at position length() (which must be below capacity()); returns the logits of
  // the token that follows it, [vocab_size].
  std::vector<float> decode(int token);

  // Prefills the prompt, then samples `new_tokens` tokens one at a time; returns them. At the
  // context limit it stops early: the prompt and the new tokens together never exceed
  // max_seq_len, so every returned token was predicted from its whole context (no sliding window).
  // It also stops after a token of options.stop, which is the last one returned.
  std::vector<int> generate(std::span<const int> prompt, int new_tokens, const SamplingOptions& options);

 private:
  struct Block {
    TensorView ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fcp_w, fcp_b;
    TensorView cache;  // [max_seq_len, 3C]: this block's q, k, v of every position
  };
  void upload(const WeightSource& weights);
  // Runs `tokens` at positions [length(), length() + n): a prompt from position 0 (causal attention
  // over its rows), or one token over the cache.
  void forward(std::span<const int> tokens, std::span<const std::int32_t> doc_start = {});
  // Logits over the real vocabulary of x rows [first, first + count), after the final LayerNorm.
  std::vector<float> logits(int first, int count);
  void check_tokens(std::span<const int> tokens) const;
  std::int64_t qkv_width() const;  // (H + 2K) D
  // The block's pre-norm (LayerNorm or RMSNorm) of `rows` rows.
  void norm(const TensorView& out, const TensorView& x, const TensorView& w, const TensorView& b, int rows);

  ModelConfig cfg_;
  ModelSpec spec_;
  ops::Backend& be_;
  int C_, H_, K_, D_, F_, Vp_, Tmax_;
  int length_ = 0;
  int logit_rows_;  // rows of logits computed at once (bounds the logits buffers)

  Arena weights_, acts_;
  TensorView wte_, wpe_, lnf_w_, lnf_b_, head_w_;  // head_w_: wte_ when tied
  std::vector<Block> blocks_;
  TensorView tokens_;           // [Tmax] i32
  TensorView doc_start_;        // [Tmax] i32: a prefill's document starts, when it has them
  TensorView x_, ln_, atty_, tmp_;  // [Tmax, C]: residual stream, LayerNorm output, attention output, linear output
  TensorView mean_, rstd_;      // [Tmax] f32
  TensorView lse_;              // [H * Tmax] f32 (attention_forward's statistic, unused here)
  TensorView fc_pre_, fc_;      // [Tmax, F]; fc_pre [Tmax, 2F] for SwiGLU (gate and up)
  TensorView logits_, logits_f32_;  // [logit_rows, Vp]
  std::vector<std::int32_t> host_tokens_, host_doc_start_;
};

}  // namespace kiln::model
