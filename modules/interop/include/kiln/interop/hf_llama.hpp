#pragma once
// kiln's Llama parameters in Hugging Face's LlamaForCausalLM layout (Llama 2/3.x, SmolLM, TinyLlama
// checkpoints), for init_from, kiln eval / generate and kiln export. The layouts differ only by
// fusion: kiln's attn.qkv is q_proj, k_proj and v_proj stacked by rows, its mlp.fc is gate_proj
// then up_proj, and its embedding and LM head have padded_vocab rows where HF has vocab_size (the
// padding is zero). Both rotate query and key pairs (i, i + D/2) (rotate_half), so no permutation.
// A plain library: it knows the model only by the shape it is given (kiln/model/hf.hpp converts).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kiln/interop/hf_checkpoint.hpp"
#include "kiln/tensor/dtype.hpp"

namespace kiln::interop {

// What the Hugging Face Llama layout and its config.json know of a model.
struct LlamaShape {
  int n_layer = 16, n_head = 32, n_kv_head = 8, n_embd = 2048, ffn_hidden = 8192;
  int vocab_size = 128256;
  int padded_vocab = 128256;   // kiln's embedding rows
  int max_seq_len = 131072;    // max_position_embeddings
  float norm_eps = 1e-5f;      // rms_norm_eps
  float rope_theta = 500000.0f;
  float init_std = 0.02f;      // initializer_range
  bool tie_embeddings = true;  // tie_word_embeddings
  // rope_scaling of type "llama3" (factor 0: none).
  float rope_factor = 0.0f, rope_low_freq_factor = 1.0f, rope_high_freq_factor = 4.0f;
  int rope_original_max_seq_len = 8192;
  int head_dim() const { return n_embd / n_head; }
};

// Rows [row, row + hf_shape[0]) of a kiln tensor are the Hugging Face tensor `hf_name`.
struct HfPiece {
  std::string hf_name;
  std::vector<std::int64_t> hf_shape;
  std::int64_t row = 0;
};
struct HfLlamaTensor {
  std::string kiln_name;                 // "blocks.0.attn.qkv.weight"
  std::vector<std::int64_t> kiln_shape;  // global: [(H + 2 K) D, C]
  std::vector<HfPiece> pieces;           // in row order; rows they leave (vocabulary padding) are zero
};

// Every kiln parameter, in kiln's order (lm_head only when untied).
std::vector<HfLlamaTensor> hf_llama_layout(const LlamaShape& shape);

// Reads kiln's tensors out of a Hugging Face checkpoint piece by piece, so a rank reads only what
// it holds. The constructor checks the whole checkpoint against the shape first: every tensor there
// with the right shape, nothing it does not know (the rotary inv_freq buffers older exports carry
// are skipped), and an lm_head.weight of a tied model equal to the embedding; each problem is a
// FileError naming the file, the tensor and the shape.
class HfLlamaReader {
 public:
  HfLlamaReader(const LlamaShape& shape, const std::string& dir);
  const LlamaShape& shape() const { return shape_; }
  const std::vector<HfLlamaTensor>& layout() const { return layout_; }
  // Values [begin, begin + count) of kiln's flattened global tensor `kiln_name` (padding rows zero).
  void read(const std::string& kiln_name, std::int64_t begin, std::int64_t count, float* out);
  // The whole tensor.
  std::vector<float> read(const std::string& kiln_name);
  HfCheckpoint& checkpoint() { return ckpt_; }

 private:
  const HfLlamaTensor& find(const std::string& kiln_name) const;
  LlamaShape shape_;
  std::vector<HfLlamaTensor> layout_;
  HfCheckpoint ckpt_;
};

// A Llama config.json: num_hidden_layers, num_attention_heads, num_key_value_heads (default: the
// heads), hidden_size, intermediate_size, vocab_size, max_position_embeddings, rms_norm_eps,
// rope_theta (default 10000), tie_word_embeddings (default false, as LlamaConfig's),
// initializer_range and rope_scaling (null or type "llama3"), or transformers 5's rope_parameters
// (rope_theta with rope_type "default" or "llama3") in their place. What kiln cannot compute is an error
// naming the file and the key: another model_type or hidden_act, attention or MLP biases, a
// head_dim other than hidden_size / heads, another rope_scaling type. padded_vocab is left to the
// caller.
LlamaShape read_hf_llama_config(const std::string& config_json);

// The model_type a config.json declares ("" when it has none); a FileError if it is not JSON.
std::string hf_model_type(const std::string& config_json);

// The config.json export_hf_llama writes (RoPE's numbers both as rope_theta + rope_scaling and as
// rope_parameters, for transformers 4 and 5); `extra` (JSON object text, may be empty) adds keys kiln
// does not model, such as bos_token_id / eos_token_id carried over from the model it started from.
std::string hf_llama_config_json(const LlamaShape& shape, DType dtype, const std::string& extra = "");

// Writes `dir`/config.json and the weights (model.safetensors, or shards and the index above
// max_shard_bytes), F32 or BF16 (round to nearest even). `weight(kiln_name)` gives the global f32
// tensor in kiln's layout (embedding and head with their padding rows); each is asked for once and
// dropped once sliced, so the host holds the output's bytes and one tensor. Returns the weight files.
std::vector<std::string> export_hf_llama(const LlamaShape& shape,
                                         const std::function<std::vector<float>(const std::string& kiln_name)>& weight,
                                         const std::string& dir, DType dtype = DType::f32,
                                         std::uint64_t max_shard_bytes = kHfMaxShardBytes,
                                         const std::string& extra_config = "");

}  // namespace kiln::interop
