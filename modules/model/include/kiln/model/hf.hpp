#pragma once
// The model's configuration as kiln::interop's Hugging Face layouts take it (interop knows no
// model), and what model.init_from names: a Hugging Face model directory (config.json + weights,
// Llama or GPT-2) or a GPT-2 model.safetensors file.
#include <string>

#include "kiln/engine/config/node.hpp"
#include "kiln/interop/hf_gpt2.hpp"
#include "kiln/interop/hf_llama.hpp"
#include "kiln/model/config.hpp"

namespace kiln::model {

// A GPT-2 model's shape (model.arch = gpt2; another architecture is an error naming it).
interop::Gpt2Shape gpt2_shape(const ModelConfig& cfg);
// `base` with the shape's n_layer, n_head, n_embd, vocab_size, max_seq_len and norm_eps (a GPT-2).
ModelConfig with_gpt2_shape(ModelConfig base, const interop::Gpt2Shape& shape);

// A Llama model's shape (model.arch = llama, dense MLPs; else an error naming what differs).
interop::LlamaShape llama_shape(const ModelConfig& cfg);
// `base` with the shape's architecture keys (arch, n_layer, n_head, n_kv_head, n_embd, ffn_hidden,
// vocab_size, max_seq_len, norm_eps, rope_theta, tie_embeddings, rope_scaling).
ModelConfig with_llama_shape(ModelConfig base, const interop::LlamaShape& shape);

// What a path given as starting weights is.
struct HfModelPath {
  enum class Kind { gpt2_file, gpt2_dir, llama_dir } kind;
  std::string weights;      // the .safetensors file (gpt2) or the directory
  std::string config_json;  // "" for a bare GPT-2 file without config.json beside it
};
// A directory must hold config.json with model_type "llama" or "gpt2" and the weights; a file must
// be a .safetensors (GPT-2). Anything else is a FileError naming the path and what was expected.
HfModelPath classify_hf_path(const std::string& path);

// The model's configuration from a Hugging Face directory's config.json over `base`.
ModelConfig config_from_hf_dir(ModelConfig base, const HfModelPath& path);

// [model] completion (ModuleDesc::complete): when init_from is a Hugging Face directory, its
// config.json sets the architecture keys the pipeline leaves out; one the pipeline sets to another
// value is an error naming the key's source and the config.json field.
void complete_from_hf(ModelConfig& cfg, const config::Node& doc, const std::string& file, config::Errors& errors);

}  // namespace kiln::model
