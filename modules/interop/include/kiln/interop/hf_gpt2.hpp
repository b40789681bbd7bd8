#pragma once
// kiln's GPT-2 parameters as Hugging Face's GPT2LMHeadModel names them, for export to and import
// from model.safetensors + config.json. HF keeps the Conv1D weights as [in, out], the transpose of
// kiln's [out, in]; its wte has vocab_size rows where kiln's has padded_vocab; the LM head is wte.
// A plain library: it knows the model only by the shape it is given (Gpt2Shape; kiln's model
// converts its config, kiln/model/hf.hpp).
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kiln/tensor/dtype.hpp"

namespace kiln::interop {

// What the Hugging Face GPT-2 layout needs to know of a model.
struct Gpt2Shape {
  int n_layer = 12, n_head = 12, n_embd = 768;
  int vocab_size = 50257;
  int padded_vocab = 50304;  // kiln's embedding rows (the vocabulary padded)
  int max_seq_len = 1024;    // HF's n_positions
  float norm_eps = 1e-5f;    // layer_norm_epsilon
  float init_std = 0.02f;    // initializer_range
  float dropout = 0.0f;      // resid_pdrop, embd_pdrop, attn_pdrop
};

struct HfTensor {
  std::string kiln_name;                 // "blocks.0.attn.qkv.weight"
  std::vector<std::int64_t> kiln_shape;  // global: [3C, C]
  std::string hf_name;                   // "transformer.h.0.attn.c_attn.weight"
  std::vector<std::int64_t> hf_shape;    // [C, 3C]
  bool transposed = false;               // hf = kiln^T (the Conv1D weights)
  std::int64_t rows = 0;                 // kiln rows that exist in HF (vocab_size for wte, else all)
};

// Every kiln parameter, in kiln's order.
std::vector<HfTensor> hf_gpt2_layout(const Gpt2Shape& shape);

// Writes `path` (a model.safetensors, F32 or BF16, round to nearest even) and config.json beside
// it. `weight(kiln_name)` gives the global f32 tensor in kiln's layout (wte with its padding rows).
void export_hf_gpt2(const Gpt2Shape& shape, const std::function<const float*(const std::string& kiln_name)>& weight,
                    const std::string& path, DType dtype = DType::f32);

// Reads a GPT-2 model.safetensors (names with or without "transformer."; F32, BF16 or F16) into
// kiln's names and layouts, wte padded with zero rows. The causal-mask buffers (h.N.attn.bias,
// h.N.attn.masked_bias) and an lm_head.weight equal to wte are skipped; a missing tensor, a shape
// that does not fit `shape` or an unexpected tensor is an error naming the file and the tensor.
std::map<std::string, std::vector<float>> import_hf_gpt2(const Gpt2Shape& shape, const std::string& path);

// The GPT-2 config.json's n_layer, n_head, n_embd, vocab_size, n_positions (-> max_seq_len) and
// layer_norm_epsilon (if present) over `base` (padded_vocab is left to the caller, who pads); an
// error naming the file and the key if one is missing or the model is not one kiln computes
// (another activation, n_inner other than 4 n_embd).
Gpt2Shape read_hf_gpt2_config(const std::string& config_json, Gpt2Shape base = {});

// The config.json export_hf_gpt2 writes.
std::string hf_gpt2_config_json(const Gpt2Shape& shape, DType dtype);

}  // namespace kiln::interop
